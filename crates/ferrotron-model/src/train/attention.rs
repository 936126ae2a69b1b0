//! Self-attention's training pass (Megatron-Core `SelfAttention`): `linear_qkv`, the q/k norms,
//! rope (or multi-latent attention's projections, [`super::mla`]), core attention and the
//! row-parallel `linear_proj`, and its backward beside it.

use std::borrow::Cow;

use super::backward::{linear_backward, trainable};
use super::core_attention::{CoreAttnOut, KeysValues, attention_dims, attention_precision};
use super::forward::Pass;
use super::layer_acts::{LayerActs, QkNormActs};
use super::memory::Ledger;
use super::mla::{MlaActs, mla_qkv_backward, mla_qkv_forward};
use super::norm::NormLayer;
use super::stored::{Kept, Stored};
use super::tp_ops::{row_parallel_forward, row_parallel_output_grad};
use crate::Result;
use crate::module::{LayerAttention, SelfAttention, TransformerLayer, pack_qkv, split_qkv};
use ferrotron_nn::attention::core_attention_backward;
use ferrotron_tensor::Buffer;
use ferrotron_tensor::ops::add_bias_backward;

/// What attention keeps of one layer.
pub(crate) struct AttnActs {
    /// The q/k norms' inputs and statistics (`qk_layernorm`).
    pub qk_norm: Option<QkNormActs>,
    /// Multi-latent attention's latents.
    pub mla: Option<MlaActs>,
    /// Queries after rope `[rows, a, d]`.
    pub q: Stored,
    /// Keys after rope `[rows, g, d]`.
    pub k: Stored,
    /// Values `[rows, g, d]`.
    pub v: Stored,
    /// Core attention's output (`linear_proj`'s input `[rows, a·dv]`); `None` under selective
    /// recompute (recomputed in the backward).
    pub core_attn: Option<CoreAttnOut>,
}

impl AttnActs {
    /// Bytes held (core attention's output included when kept).
    pub(crate) fn bytes(&self) -> u128 {
        [&self.q, &self.k, &self.v]
            .iter()
            .map(|t| t.bytes())
            .sum::<u128>()
            + self.qk_norm.as_ref().map_or(0, |n| {
                n.q.bytes() + n.k.bytes() + n.q_stats.bytes() + n.k_stats.bytes()
            })
            + self.mla.as_ref().map_or(0, MlaActs::bytes)
            + self.core_attn.as_ref().map_or(0, CoreAttnOut::bytes)
    }
}

/// Self-attention over `input: [rows, h]` (all rows): the q/k/v projections (`linear_qkv`
/// with the q/k norms and rope, or multi-latent attention's), core attention and the
/// row-parallel `linear_proj`; returns what the backward needs and the output
/// `[local rows, h]`.
pub(super) fn attention_forward(
    layer: &TransformerLayer,
    pass: &Pass<'_>,
    input: &[f32],
    keep_core_attention: bool,
    kv: KeysValues<'_>,
) -> Result<(AttnActs, Buffer<f32>)> {
    let ([q, k, v], qk_norm, mla) = match &layer.self_attention {
        LayerAttention::SelfAttention(sa) => {
            let (qkv, qk_norm) = qkv_forward(sa, pass, input)?;
            (qkv, qk_norm, None)
        }
        LayerAttention::MultiLatent(m) => {
            let (qkv, acts) = mla_qkv_forward(m, pass, input)?;
            (qkv, None, Some(acts))
        }
    };
    let [q, k, v] = [q, k, v].map(|t| Kept::new(t, pass.narrow));
    let (ctx, lse) = match kv {
        KeysValues::Fresh => CoreAttnOut::compute(q.values(), k.values(), v.values(), pass)?,
        KeysValues::Cached { cache, layer } => {
            CoreAttnOut::compute_cached(q.values(), k.values(), v.values(), cache, layer, pass)
        }
        KeysValues::Paged {
            cache,
            layer,
            batch,
        } => CoreAttnOut::compute_paged(
            q.values(),
            k.values(),
            v.values(),
            (cache, layer, batch),
            pass,
        ),
    };
    let ctx = value_heads(ctx, pass);
    let proj = pass.linear(layer.self_attention.linear_proj());
    let out = row_parallel_forward(pass, &proj, ctx.values())?;
    let core_attn = keep_core_attention.then_some(CoreAttnOut {
        ctx: ctx.stored,
        lse,
    });
    let acts = AttnActs {
        qk_norm,
        mla,
        q: q.stored,
        k: k.stored,
        v: v.stored,
        core_attn,
    };
    Ok((acts, out))
}

/// `linear_qkv`, the q/k norms and rope: `q: [rows, a, d]`, `k, v: [rows, g, d]`.
fn qkv_forward(
    sa: &SelfAttention,
    pass: &Pass<'_>,
    input: &[f32],
) -> Result<([Buffer<f32>; 3], Option<QkNormActs>)> {
    let (c, model) = (pass.c, pass.model);
    let (a, g, d) = (c.num_attention_heads, c.num_query_groups, c.kv_channels);
    let rows = pass.positions.len();
    let dev = pass.device;
    let mut qkv = Buffer::zeros(dev, rows * c.qkv_size());
    pass.linear(sa.linear_qkv).forward(input, qkv.host_mut());
    let mut q = Buffer::zeros(dev, rows * a * d);
    let mut k = Buffer::zeros(dev, rows * g * d);
    let mut v = Buffer::zeros(dev, rows * g * d);
    split_qkv(qkv.host(), c, q.host_mut(), k.host_mut(), v.host_mut());
    drop(qkv);
    let qk_norm = match (sa.q_layernorm, sa.k_layernorm) {
        (Some(qn), Some(kn)) => {
            let full = model.config();
            let (qw, kw) = (full.num_attention_heads * d, full.num_query_groups * d);
            let qn = NormLayer::new(model, qn).spanning(pass.tp, qw);
            let kn = NormLayer::new(model, kn).spanning(pass.tp, kw);
            let (q_normed, q_stats) = qn.forward(q.host(), a * d)?;
            let (k_normed, k_stats) = kn.forward(k.host(), g * d)?;
            Some(QkNormActs {
                q: std::mem::replace(&mut q, q_normed),
                k: std::mem::replace(&mut k, k_normed),
                q_stats,
                k_stats,
            })
        }
        _ => None,
    };
    if let Some(rope) = pass.rope {
        rope.apply(q.host_mut(), pass.positions, a);
        rope.apply(k.host_mut(), pass.positions, g);
    }
    Ok(([q, k, v], qk_norm))
}

/// Core attention's output `[rows, a, d]` as `linear_proj`'s input `[rows, a, dv]`: the
/// value dims of each head (all of them but under multi-latent attention's padding).
fn value_heads(ctx: Kept, pass: &Pass<'_>) -> Kept {
    let (d, dv) = (pass.c.kv_channels, pass.c.value_head_dim());
    if d == dv {
        return ctx;
    }
    let mut out = Buffer::zeros(pass.device, ctx.values().len() / d * dv);
    for (o, head) in out
        .host_mut()
        .chunks_exact_mut(dv)
        .zip(ctx.values().chunks_exact(d))
    {
        o.copy_from_slice(&head[..dv]);
    }
    Kept::new(out, pass.narrow)
}

/// The inverse of [`value_heads`]: `[rows, a, dv]` zero-padded to `[rows, a, d]` (`x` itself
/// when nothing is padded).
fn padded_heads<'x>(x: Cow<'x, [f32]>, pass: &Pass<'_>) -> Cow<'x, [f32]> {
    let (d, dv) = (pass.c.kv_channels, pass.c.value_head_dim());
    if d == dv {
        return x;
    }
    let mut out = vec![0f32; x.len() / dv * d];
    for (o, head) in out.chunks_exact_mut(d).zip(x.chunks_exact(dv)) {
        o[..dv].copy_from_slice(head);
    }
    Cow::Owned(out)
}

/// Attention's backward from `dout` (gradient of `linear_proj`'s output, local rows) to the
/// gradient of its input `[rows, h]` (all rows, a partial sum on each tensor-parallel rank).
pub(super) fn attention_backward(
    layer: &TransformerLayer,
    la: &LayerActs,
    pass: &Pass<'_>,
    dout: &[f32],
    grads: &mut [&mut [f32]],
    ledger: &mut Ledger,
) -> Result<Buffer<f32>> {
    let dy = row_parallel_output_grad(pass.tp, dout)?;
    let dqkv = core_attention_and_proj_backward(layer, la, pass, &dy, grads, ledger)?;
    drop(dy);
    let proj = layer.self_attention.linear_proj();
    if let Some(db) = proj.bias.and_then(|b| trainable(grads, b)) {
        add_bias_backward(dout, db);
    }
    match (&layer.self_attention, &la.attn.mla) {
        (LayerAttention::SelfAttention(sa), _) => qkv_backward(sa, la, pass, dqkv, grads),
        (LayerAttention::MultiLatent(m), Some(acts)) => {
            mla_qkv_backward(m, acts, pass, la.attn_in.operand(), dqkv, grads)
        }
        (LayerAttention::MultiLatent(_), None) => {
            unreachable!("multi-latent attention keeps its latents")
        }
    }
}

/// Backward of [`qkv_forward`] from `[dq, dk, dv]` (still rotated) to the gradient of its
/// input `[rows, h]`.
fn qkv_backward(
    sa: &SelfAttention,
    la: &LayerActs,
    pass: &Pass<'_>,
    [mut dq, mut dk, dv]: [Buffer<f32>; 3],
    grads: &mut [&mut [f32]],
) -> Result<Buffer<f32>> {
    let c = pass.c;
    let (a, g, d) = (c.num_attention_heads, c.num_query_groups, c.kv_channels);
    let dev = pass.device;
    let rows = pass.positions.len();
    if let Some(rope) = pass.rope {
        rope.apply_inverse(dq.host_mut(), pass.positions, a);
        rope.apply_inverse(dk.host_mut(), pass.positions, g);
    }
    if let (Some(qk), Some(qn), Some(kn)) = (&la.attn.qk_norm, sa.q_layernorm, sa.k_layernorm) {
        let model = pass.model;
        let full = model.config();
        let (qw, kw) = (full.num_attention_heads * d, full.num_query_groups * d);
        let mut dq_in = Buffer::zeros(dev, dq.len());
        let mut dk_in = Buffer::zeros(dev, dk.len());
        let qn = NormLayer::new(model, qn).spanning(pass.tp, qw);
        let (q_in, dq_out) = (qk.q.host(), dq.host());
        qn.backward(q_in, a * d, &qk.q_stats, dq_out, dq_in.host_mut(), grads)?;
        let kn = NormLayer::new(model, kn).spanning(pass.tp, kw);
        let (k_in, dk_out) = (qk.k.host(), dk.host());
        kn.backward(k_in, g * d, &qk.k_stats, dk_out, dk_in.host_mut(), grads)?;
        (dq, dk) = (dq_in, dk_in);
    }
    let mut dqkv = Buffer::zeros(dev, rows * c.qkv_size());
    pack_qkv(dq.host(), dk.host(), dv.host(), c, dqkv.host_mut());
    drop((dq, dk, dv));
    let mut dinput = Buffer::zeros(dev, rows * c.hidden_size);
    let (input, dy, dx) = (la.attn_in.operand(), dqkv.host(), dinput.host_mut());
    linear_backward(pass, sa.linear_qkv, input, dy, dx, grads);
    Ok(dinput)
}

/// `linear_proj` (without its bias) and core attention backward: returns `[dq, dk, dv]`
/// (`[rows, a, d]`, `[rows, g, d]`, `[rows, g, d]`, still rotated) for `dres` the gradient of
/// the projection's output over all rows. Core
/// attention's output is recomputed when the layer did not keep it, and freed on return.
///
/// # Errors
/// A failed context-parallel exchange.
fn core_attention_and_proj_backward(
    layer: &TransformerLayer,
    la: &LayerActs,
    pass: &Pass<'_>,
    dres: &[f32],
    grads: &mut [&mut [f32]],
    ledger: &mut Ledger,
) -> Result<[Buffer<f32>; 3]> {
    let c = pass.c;
    let dev = pass.device;
    let (a, g, d) = (c.num_attention_heads, c.num_query_groups, c.kv_channels);
    let rows = pass.positions.len();
    let attn = &la.attn;
    let (q, k, v) = (attn.q.f32(), attn.k.f32(), attn.v.f32());
    let recomputed;
    let core = match &attn.core_attn {
        Some(kept) => kept,
        None => {
            // Rounded as the forward rounded it: the same values as a kept output.
            let (ctx, lse) = CoreAttnOut::compute(&q, &k, &v, pass)?;
            recomputed = CoreAttnOut {
                ctx: value_heads(ctx, pass).stored,
                lse,
            };
            ledger.hold(recomputed.bytes());
            &recomputed
        }
    };
    let ctx = padded_heads(core.ctx.f32(), pass);
    let mut dctx = Buffer::zeros(dev, rows * a * c.value_head_dim());
    let proj = layer.self_attention.linear_proj().without_bias();
    linear_backward(pass, proj, core.ctx.operand(), dres, dctx.host_mut(), grads);
    let dctx = padded_heads(Cow::Borrowed(dctx.host()), pass);
    let mut dq = Buffer::zeros(dev, rows * a * d);
    let mut dk = Buffer::zeros(dev, rows * g * d);
    let mut dv = Buffer::zeros(dev, rows * g * d);
    let (dims, mask) = attention_dims(pass);
    let lse = core.lse.host();
    let (dqs, dks, dvs) = (dq.host_mut(), dk.host_mut(), dv.host_mut());
    let precision = attention_precision(pass);
    match pass.cp {
        Some(cp) => {
            let (io, grads) = ([&q[..], &k, &v], [dqs, dks, dvs]);
            cp.attention_backward(io, &ctx, &dctx, lse, grads, dims, mask, precision)?;
        }
        None => core_attention_backward(
            &q, &k, &v, &ctx, &dctx, lse, dqs, dks, dvs, dims, mask, precision,
        ),
    }
    if attn.core_attn.is_none() {
        ledger.release(core.bytes());
    }
    Ok([dq, dk, dv])
}
