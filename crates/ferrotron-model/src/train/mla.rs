//! Multi-latent attention's projections (Megatron-Core `MLASelfAttention.get_query_key_value_tensors`,
//! transformers' `DeepseekV2Attention.forward`): from the attention input to the per-head
//! queries, keys and values core attention runs on, and the backward of that. Core attention
//! and `linear_proj` are the standard attention's ([`super::attention`]).
//!
//! Core attention runs at one head dim `D` = [`crate::MlaConfig::attention_head_dim`] over
//! `a` heads (this rank's): `Q = s·[q_nope | rope(q_pe) | 0]`, `K = [k_nope | rope(k_pe) | 0]`
//! (the one `k_pe` head copied to every head), `V = [v | 0]`, `s` YaRN's softmax `mscale²`
//! (1 without it). Zero columns add nothing to a score, and the padded output columns are
//! zero (dropped before `linear_proj`).
//!
//! Under tensor parallelism the up projections hold whole heads; the down projections and
//! latent norms run in full on every rank. Their backward is linear in the latents' gradient,
//! which each rank has only for its heads: each rank back-propagates its part, so their
//! weight gradients and the input gradient are partial sums over the ranks (the input's
//! reduced like every column-parallel input's, the weights' by `finalize_grads`).

use super::backward::linear_backward;
use super::forward::Pass;
use super::norm::{NormLayer, NormStats};
use super::stored::{Kept, Stored};
use crate::module::{LinearParams, MlaQuery, MlaSelfAttention, Norm};
use crate::{MlaConfig, Result};
use ferrotron_tensor::Buffer;
use ferrotron_tensor::gemm_bf16::Operand;
use ferrotron_tensor::ops::RopeScaling;

/// transformers' `DeepseekV2RMSNorm` default epsilon, which its latent norms use whatever
/// the config's `rms_norm_eps`.
const LATENT_NORM_EPS: f32 = 1e-6;

/// A latent before and after its RMSNorm: `x: [rows, width]` f32 (the norm's input) with its
/// statistics, and the normed rows (the up projection's input, kept as the pass keeps
/// activations).
pub(crate) struct LatentActs {
    pub x: Buffer<f32>,
    pub stats: NormStats,
    pub normed: Stored,
}

impl LatentActs {
    fn bytes(&self) -> u128 {
        self.x.bytes() + self.stats.bytes() + self.normed.bytes()
    }
}

/// What multi-latent attention keeps besides q/k/v: the query latent (`q_lora_rank`) and
/// the key/value latent `c`.
pub(crate) struct MlaActs {
    pub q_latent: Option<LatentActs>,
    pub kv_latent: LatentActs,
}

impl MlaActs {
    /// Bytes held.
    pub(crate) fn bytes(&self) -> u128 {
        self.kv_latent.bytes() + self.q_latent.as_ref().map_or(0, LatentActs::bytes)
    }
}

/// The per-head dims: `(dn, dr, dv, D)`.
fn dims(m: &MlaConfig, d: usize) -> (usize, usize, usize, usize) {
    (m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim, d)
}

/// The softmax scale's factor beyond `1/√D` folded into the queries: YaRN's `mscale²` over
/// `√D / √(dn + dr)` (1 for unpadded heads without YaRN).
fn query_scale(pass: &Pass<'_>, m: &MlaConfig) -> f32 {
    let mscale = match &pass.c.rope_scaling {
        RopeScaling::Yarn(y) => y.softmax_mscale(),
        _ => 1.0,
    };
    let padded = (pass.c.kv_channels as f32 / m.query_head_dim() as f32).sqrt();
    mscale * padded
}

fn latent_norm<'m>(pass: &Pass<'m>, norm: Norm) -> NormLayer<'m> {
    NormLayer::new(pass.model, norm).with_eps(LATENT_NORM_EPS)
}

/// `up(norm(x))` of a latent `x: [rows, width]`: the kept activations and the up
/// projection's output `[rows, out]` ([`latent_backward`] is its backward).
fn latent_forward(
    pass: &Pass<'_>,
    (norm, up): (Norm, LinearParams),
    x: Buffer<f32>,
    width: usize,
    out: usize,
) -> Result<(LatentActs, Buffer<f32>)> {
    let (normed, stats) = latent_norm(pass, norm).forward(x.host(), width)?;
    let normed = Kept::new(normed, pass.narrow);
    let mut y = Buffer::zeros(pass.device, x.len() / width * out);
    pass.linear(up).forward(normed.values(), y.host_mut());
    let normed = normed.stored;
    Ok((LatentActs { x, stats, normed }, y))
}

/// `input: [rows, h]` (all rows) → `q, k, v: [rows, a, D]` after rope (and the query scale),
/// and the latents for the backward.
pub(super) fn mla_qkv_forward(
    m: &MlaSelfAttention,
    pass: &Pass<'_>,
    input: &[f32],
) -> Result<([Buffer<f32>; 3], MlaActs)> {
    let c = pass.c;
    let mla = c
        .multi_latent_attention
        .expect("an MLA layer has an MLA config");
    let (a, rows, dev) = (c.num_attention_heads, pass.positions.len(), pass.device);
    let (dn, dr, dv, d) = dims(&mla, c.kv_channels);
    let project = |p, x: &[f32], out: usize| {
        let mut y = Buffer::zeros(dev, rows * out);
        pass.linear(p).forward(x, y.host_mut());
        y
    };
    let (q_heads, q_latent) = match m.query {
        MlaQuery::Direct(q) => (project(q, input, a * (dn + dr)), None),
        MlaQuery::Latent {
            linear_q_down_proj,
            q_layernorm,
            linear_q_up_proj,
        } => {
            let r = mla.q_lora_rank.expect("a query latent has a rank");
            let latent = project(linear_q_down_proj, input, r);
            let norm_up = (q_layernorm, linear_q_up_proj);
            let (latent, q) = latent_forward(pass, norm_up, latent, r, a * (dn + dr))?;
            (q, Some(latent))
        }
    };
    let width = mla.kv_lora_rank;
    let kv_a = project(m.linear_kv_down_proj, input, width + dr);
    let mut latent = Buffer::zeros(dev, rows * width);
    let mut k_pe = Buffer::zeros(dev, rows * dr);
    for ((row, l), p) in kv_a
        .host()
        .chunks_exact(width + dr)
        .zip(latent.host_mut().chunks_exact_mut(width))
        .zip(k_pe.host_mut().chunks_exact_mut(dr))
    {
        l.copy_from_slice(&row[..width]);
        p.copy_from_slice(&row[width..]);
    }
    drop(kv_a);
    let norm_up = (m.kv_layernorm, m.linear_kv_up_proj);
    let (kv_latent, kv) = latent_forward(pass, norm_up, latent, width, a * (dn + dv))?;
    let rope = pass.rope.expect("multi-latent attention uses rope");
    let mut q_pe = Buffer::zeros(dev, rows * a * dr);
    for (pe, head) in q_pe
        .host_mut()
        .chunks_exact_mut(dr)
        .zip(q_heads.host().chunks_exact(dn + dr))
    {
        pe.copy_from_slice(&head[dn..]);
    }
    rope.apply(q_pe.host_mut(), pass.positions, a);
    rope.apply(k_pe.host_mut(), pass.positions, 1);
    let scale = query_scale(pass, &mla);
    let mut q = Buffer::zeros(dev, rows * a * d);
    let mut k = Buffer::zeros(dev, rows * a * d);
    let mut v = Buffer::zeros(dev, rows * a * d);
    for (i, ((qh, kh), vh)) in q
        .host_mut()
        .chunks_exact_mut(d)
        .zip(k.host_mut().chunks_exact_mut(d))
        .zip(v.host_mut().chunks_exact_mut(d))
        .enumerate()
    {
        let (q_src, pe) = (
            &q_heads.host()[i * (dn + dr)..][..dn],
            &q_pe.host()[i * dr..][..dr],
        );
        let kv_src = &kv.host()[i * (dn + dv)..][..dn + dv];
        qh[..dn]
            .iter_mut()
            .zip(q_src)
            .for_each(|(o, x)| *o = x * scale);
        qh[dn..dn + dr]
            .iter_mut()
            .zip(pe)
            .for_each(|(o, x)| *o = x * scale);
        kh[..dn].copy_from_slice(&kv_src[..dn]);
        kh[dn..dn + dr].copy_from_slice(&k_pe.host()[(i / a) * dr..][..dr]);
        vh[..dv].copy_from_slice(&kv_src[dn..]);
    }
    Ok((
        [q, k, v],
        MlaActs {
            q_latent,
            kv_latent,
        },
    ))
}

/// Backward of [`mla_qkv_forward`] from `dq, dk, dv: [rows, a, D]` (gradients of the
/// rotated, scaled, padded heads) to the gradient of its input `[rows, h]` (all rows; a
/// partial sum on each tensor-parallel rank), accumulating the projections' and latent
/// norms' gradients into `grads`.
pub(super) fn mla_qkv_backward(
    m: &MlaSelfAttention,
    acts: &MlaActs,
    pass: &Pass<'_>,
    input: Operand<'_>,
    [dq, dk, dv]: [Buffer<f32>; 3],
    grads: &mut [&mut [f32]],
) -> Result<Buffer<f32>> {
    let c = pass.c;
    let mla = c
        .multi_latent_attention
        .expect("an MLA layer has an MLA config");
    let (a, rows, dev, h) = (
        c.num_attention_heads,
        pass.positions.len(),
        pass.device,
        c.hidden_size,
    );
    let (dn, dr, dvh, d) = dims(&mla, c.kv_channels);
    let rope = pass.rope.expect("multi-latent attention uses rope");
    let scale = query_scale(pass, &mla);
    // Unpad: d(q_nope | q_pe) per head, d(k_nope | v) per head, d(k_pe) summed over heads.
    let mut dq_heads = Buffer::zeros(dev, rows * a * (dn + dr));
    let mut dq_pe = Buffer::zeros(dev, rows * a * dr);
    let mut dkv = Buffer::zeros(dev, rows * a * (dn + dvh));
    let mut dk_pe = Buffer::zeros(dev, rows * dr);
    for (i, ((qh, kh), vh)) in dq
        .host()
        .chunks_exact(d)
        .zip(dk.host().chunks_exact(d))
        .zip(dv.host().chunks_exact(d))
        .enumerate()
    {
        let q_out = &mut dq_heads.host_mut()[i * (dn + dr)..][..dn];
        q_out
            .iter_mut()
            .zip(&qh[..dn])
            .for_each(|(o, g)| *o = g * scale);
        let pe_out = &mut dq_pe.host_mut()[i * dr..][..dr];
        pe_out
            .iter_mut()
            .zip(&qh[dn..dn + dr])
            .for_each(|(o, g)| *o = g * scale);
        let kv_out = &mut dkv.host_mut()[i * (dn + dvh)..][..dn + dvh];
        kv_out[..dn].copy_from_slice(&kh[..dn]);
        kv_out[dn..].copy_from_slice(&vh[..dvh]);
        let shared = &mut dk_pe.host_mut()[(i / a) * dr..][..dr];
        shared
            .iter_mut()
            .zip(&kh[dn..dn + dr])
            .for_each(|(o, g)| *o += g);
    }
    drop((dq, dk, dv));
    rope.apply_inverse(dq_pe.host_mut(), pass.positions, a);
    rope.apply_inverse(dk_pe.host_mut(), pass.positions, 1);
    for (head, pe) in dq_heads
        .host_mut()
        .chunks_exact_mut(dn + dr)
        .zip(dq_pe.host().chunks_exact(dr))
    {
        head[dn..].copy_from_slice(pe);
    }
    drop(dq_pe);
    // Keys and values: up projection, latent norm, then the down projection's rows
    // `[c | k_pe]`.
    let width = mla.kv_lora_rank;
    let dlatent = latent_backward(
        pass,
        m.kv_layernorm,
        m.linear_kv_up_proj,
        &acts.kv_latent,
        width,
        dkv.host(),
        grads,
    )?;
    drop(dkv);
    let mut dkv_a = Buffer::zeros(dev, rows * (width + dr));
    for ((row, l), p) in dkv_a
        .host_mut()
        .chunks_exact_mut(width + dr)
        .zip(dlatent.host().chunks_exact(width))
        .zip(dk_pe.host().chunks_exact(dr))
    {
        row[..width].copy_from_slice(l);
        row[width..].copy_from_slice(p);
    }
    let mut dinput = Buffer::zeros(dev, rows * h);
    linear_backward(
        pass,
        m.linear_kv_down_proj,
        input,
        dkv_a.host(),
        dinput.host_mut(),
        grads,
    );
    drop(dkv_a);
    let mut dinput_q = Buffer::zeros(dev, rows * h);
    match (m.query, &acts.q_latent) {
        (MlaQuery::Direct(q), _) => {
            linear_backward(pass, q, input, dq_heads.host(), dinput_q.host_mut(), grads);
        }
        (
            MlaQuery::Latent {
                linear_q_down_proj,
                q_layernorm,
                linear_q_up_proj,
            },
            Some(latent),
        ) => {
            let r = mla.q_lora_rank.expect("a query latent has a rank");
            let dl = latent_backward(
                pass,
                q_layernorm,
                linear_q_up_proj,
                latent,
                r,
                dq_heads.host(),
                grads,
            )?;
            linear_backward(
                pass,
                linear_q_down_proj,
                input,
                dl.host(),
                dinput_q.host_mut(),
                grads,
            );
        }
        (MlaQuery::Latent { .. }, None) => unreachable!("a query latent keeps its activations"),
    }
    ferrotron_tensor::ops::add_inplace(dinput.host_mut(), dinput_q.host());
    Ok(dinput)
}

/// Backward through `up(norm(x))` from the up projection's output gradient `dy` to the
/// latent's gradient `[rows, width]`.
fn latent_backward(
    pass: &Pass<'_>,
    norm: Norm,
    up: LinearParams,
    acts: &LatentActs,
    width: usize,
    dy: &[f32],
    grads: &mut [&mut [f32]],
) -> Result<Buffer<f32>> {
    let rows = acts.x.len() / width;
    let mut dnormed = Buffer::zeros(pass.device, rows * width);
    linear_backward(
        pass,
        up,
        acts.normed.operand(),
        dy,
        dnormed.host_mut(),
        grads,
    );
    let mut dx = Buffer::zeros(pass.device, rows * width);
    let norm = latent_norm(pass, norm);
    norm.backward(
        acts.x.host(),
        width,
        &acts.stats,
        dnormed.host(),
        dx.host_mut(),
        grads,
    )?;
    Ok(dx)
}
