//! Self-attention's training pass (Megatron-Core `SelfAttention`): `linear_qkv`, the q/k norms,
//! rope, core attention and the row-parallel `linear_proj`, and its backward beside it.

use super::backward::{linear_backward, trainable};
use super::core_attention::{CoreAttnOut, KeysValues, attention_dims, attention_precision};
use super::forward::{LayerActs, Pass, QkNormActs};
use super::memory::Ledger;
use super::norm::NormLayer;
use super::stored::{Kept, Stored};
use super::tp_ops::{row_parallel_forward, row_parallel_output_grad};
use crate::Result;
use crate::module::{TransformerLayer, pack_qkv, split_qkv};
use ferrotron_nn::attention::core_attention_backward;
use ferrotron_tensor::Buffer;
use ferrotron_tensor::ops::add_bias_backward;

/// What attention keeps of one layer.
pub(super) struct AttnActs {
    pub qk_norm: Option<QkNormActs>,
    pub q: Stored,
    pub k: Stored,
    pub v: Stored,
    pub core_attn: Option<CoreAttnOut>,
}

/// Self-attention over `input: [rows, h]` (all rows): `linear_qkv`, the q/k norms, rope,
/// core attention and the row-parallel `linear_proj`; returns what the backward needs and
/// the output `[local rows, h]`.
pub(super) fn attention_forward(
    layer: &TransformerLayer,
    pass: &Pass<'_>,
    input: &[f32],
    keep_core_attention: bool,
    kv: KeysValues<'_>,
) -> Result<(AttnActs, Buffer<f32>)> {
    let (c, model) = (pass.c, pass.model);
    let (a, g, d) = (c.num_attention_heads, c.num_query_groups, c.kv_channels);
    let rows = pass.positions.len();
    let sa = &layer.self_attention;
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
    let [q, k, v] = [q, k, v].map(|t| Kept::new(t, pass.narrow));
    let (ctx, lse) = match kv {
        KeysValues::Fresh => CoreAttnOut::compute(q.values(), k.values(), v.values(), pass),
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
    let proj = pass.linear(sa.linear_proj);
    let out = row_parallel_forward(pass, &proj, ctx.values())?;
    let core_attn = keep_core_attention.then_some(CoreAttnOut {
        ctx: ctx.stored,
        lse,
    });
    let acts = AttnActs {
        qk_norm,
        q: q.stored,
        k: k.stored,
        v: v.stored,
        core_attn,
    };
    Ok((acts, out))
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
    let c = pass.c;
    let (a, g, d) = (c.num_attention_heads, c.num_query_groups, c.kv_channels);
    let dev = pass.device;
    let rows = pass.positions.len();
    let sa = &layer.self_attention;
    let dy = row_parallel_output_grad(pass.tp, dout)?;
    let [mut dq, mut dk, dv] =
        core_attention_and_proj_backward(layer, la, pass, &dy, grads, ledger);
    drop(dy);
    if let Some(db) = sa.linear_proj.bias.and_then(|b| trainable(grads, b)) {
        add_bias_backward(dout, db);
    }
    if let Some(rope) = pass.rope {
        rope.apply_inverse(dq.host_mut(), pass.positions, a);
        rope.apply_inverse(dk.host_mut(), pass.positions, g);
    }
    if let (Some(qk), Some(qn), Some(kn)) = (&la.qk_norm, sa.q_layernorm, sa.k_layernorm) {
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
fn core_attention_and_proj_backward(
    layer: &TransformerLayer,
    la: &LayerActs,
    pass: &Pass<'_>,
    dres: &[f32],
    grads: &mut [&mut [f32]],
    ledger: &mut Ledger,
) -> [Buffer<f32>; 3] {
    let c = pass.c;
    let dev = pass.device;
    let (a, g, d) = (c.num_attention_heads, c.num_query_groups, c.kv_channels);
    let rows = pass.positions.len();
    let (q, k, v) = (la.q.f32(), la.k.f32(), la.v.f32());
    let recomputed;
    let core = match &la.core_attn {
        Some(kept) => kept,
        None => {
            // Rounded as the forward rounded it: the same values as a kept output.
            let (ctx, lse) = CoreAttnOut::compute(&q, &k, &v, pass);
            recomputed = CoreAttnOut {
                ctx: ctx.stored,
                lse,
            };
            ledger.hold(recomputed.bytes());
            &recomputed
        }
    };
    let ctx = core.ctx.f32();
    let mut dctx = Buffer::zeros(dev, rows * a * d);
    let proj = layer.self_attention.linear_proj.without_bias();
    linear_backward(pass, proj, core.ctx.operand(), dres, dctx.host_mut(), grads);
    let mut dq = Buffer::zeros(dev, rows * a * d);
    let mut dk = Buffer::zeros(dev, rows * g * d);
    let mut dv = Buffer::zeros(dev, rows * g * d);
    let (dims, mask) = attention_dims(pass);
    let (dctx, lse) = (dctx.host(), core.lse.host());
    let (dqs, dks, dvs) = (dq.host_mut(), dk.host_mut(), dv.host_mut());
    let precision = attention_precision(pass);
    core_attention_backward(
        &q, &k, &v, &ctx, dctx, lse, dqs, dks, dvs, dims, mask, precision,
    );
    if la.core_attn.is_none() {
        ledger.release(core.bytes());
    }
    [dq, dk, dv]
}
