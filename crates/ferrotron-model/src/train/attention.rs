//! Self-attention's training pass (Megatron-Core `SelfAttention`): `linear_qkv`, the q/k norms,
//! rope, core attention and the row-parallel `linear_proj`, and its backward beside it.

use super::backward::linear_backward;
use super::core_attention::{CoreAttnOut, KeysValues, attention_dims};
use super::forward::{LayerActs, Pass, QkNormActs};
use super::memory::Ledger;
use super::norm::NormLayer;
use super::stored::{Kept, Stored};
use super::tp_ops::{row_parallel_forward, row_parallel_output_grad};
use crate::Result;
use crate::module::{TransformerLayer, pack_qkv, split_qkv};
use ferrotron_nn::attention::core_attention_backward;
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
) -> Result<(AttnActs, Vec<f32>)> {
    let (c, model) = (pass.c, pass.model);
    let (a, g, d) = (c.num_attention_heads, c.num_query_groups, c.kv_channels);
    let rows = pass.positions.len();
    let sa = &layer.self_attention;
    let mut qkv = vec![0f32; rows * c.qkv_size()];
    model.linear(sa.linear_qkv).forward(input, &mut qkv);
    let mut q = vec![0f32; rows * a * d];
    let mut k = vec![0f32; rows * g * d];
    let mut v = vec![0f32; rows * g * d];
    split_qkv(&qkv, c, &mut q, &mut k, &mut v);
    drop(qkv);
    let qk_norm = match (sa.q_layernorm, sa.k_layernorm) {
        (Some(qn), Some(kn)) => {
            let full = model.config();
            let (qw, kw) = (full.num_attention_heads * d, full.num_query_groups * d);
            let qn = NormLayer::new(model, qn).spanning(pass.tp, qw);
            let kn = NormLayer::new(model, kn).spanning(pass.tp, kw);
            let (q_normed, q_stats) = qn.forward(&q, a * d)?;
            let (k_normed, k_stats) = kn.forward(&k, g * d)?;
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
        rope.apply(&mut q, pass.positions, a);
        rope.apply(&mut k, pass.positions, g);
    }
    let [q, k, v] = [q, k, v].map(|t| Kept::new(t, pass.narrow));
    let (ctx, lse) = match kv {
        KeysValues::Fresh => CoreAttnOut::compute(q.values(), k.values(), v.values(), pass),
        KeysValues::Cached { cache, layer } => {
            CoreAttnOut::compute_cached(q.values(), k.values(), v.values(), cache, layer, pass)
        }
    };
    let proj = model.linear(sa.linear_proj);
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
) -> Result<Vec<f32>> {
    let c = pass.c;
    let (a, g, d) = (c.num_attention_heads, c.num_query_groups, c.kv_channels);
    let rows = pass.positions.len();
    let sa = &layer.self_attention;
    let dy = row_parallel_output_grad(pass.tp, dout)?;
    let [mut dq, mut dk, dv] =
        core_attention_and_proj_backward(layer, la, pass, &dy, grads, ledger);
    drop(dy);
    if let Some(b) = sa.linear_proj.bias {
        add_bias_backward(dout, grads[b.index()]);
    }
    if let Some(rope) = pass.rope {
        rope.apply_inverse(&mut dq, pass.positions, a);
        rope.apply_inverse(&mut dk, pass.positions, g);
    }
    if let (Some(qk), Some(qn), Some(kn)) = (&la.qk_norm, sa.q_layernorm, sa.k_layernorm) {
        let model = pass.model;
        let full = model.config();
        let (qw, kw) = (full.num_attention_heads * d, full.num_query_groups * d);
        let mut dq_in = vec![0f32; dq.len()];
        let mut dk_in = vec![0f32; dk.len()];
        let qn = NormLayer::new(model, qn).spanning(pass.tp, qw);
        qn.backward(&qk.q, a * d, &qk.q_stats, &dq, &mut dq_in, grads)?;
        let kn = NormLayer::new(model, kn).spanning(pass.tp, kw);
        kn.backward(&qk.k, g * d, &qk.k_stats, &dk, &mut dk_in, grads)?;
        (dq, dk) = (dq_in, dk_in);
    }
    let mut dqkv = vec![0f32; rows * c.qkv_size()];
    pack_qkv(&dq, &dk, &dv, c, &mut dqkv);
    drop((dq, dk, dv));
    let mut dinput = vec![0f32; rows * c.hidden_size];
    linear_backward(
        pass.model,
        sa.linear_qkv,
        &la.attn_in.f32(),
        &dqkv,
        &mut dinput,
        grads,
    );
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
) -> [Vec<f32>; 3] {
    let c = pass.c;
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
    let mut dctx = vec![0f32; rows * a * d];
    linear_backward(
        pass.model,
        layer.self_attention.linear_proj.without_bias(),
        &ctx,
        dres,
        &mut dctx,
        grads,
    );
    let mut dq = vec![0f32; rows * a * d];
    let mut dk = vec![0f32; rows * g * d];
    let mut dv = vec![0f32; rows * g * d];
    let (dims, mask) = attention_dims(pass);
    core_attention_backward(
        &q, &k, &v, &ctx, &dctx, &core.lse, &mut dq, &mut dk, &mut dv, dims, mask,
    );
    if la.core_attn.is_none() {
        ledger.release(core.bytes());
    }
    [dq, dk, dv]
}
