//! Self-attention's parameters (Megatron-Core `SelfAttention`): the fused `linear_qkv` and
//! `linear_proj`. Core attention itself has none (`ferrotron_nn::attention`).

use super::decl::{Declarer, Init};
use super::linear::{LinearParams, LinearSpec, Parallel, block};
use super::norm::{Norm, NormSpec};
use crate::families::HfQkv;
use crate::{TpSplit, TransformerConfig};

/// The parameters of one layer's self-attention.
///
/// `linear_qkv: [g·(a/g + 2)·d, h]` packs, per query group, its `a/g` query heads, then its
/// key head, then its value head (Megatron's layout, so tensor parallelism splits whole
/// groups; HF's `q_proj` / `k_proj` / `v_proj` rows interleaved per group);
/// `linear_proj: [h, a·d]` (HF `o_proj`). Under `qk_layernorm`, `q_layernorm: [a·d]` and
/// `k_layernorm: [g·d]` (OLMo2's `q_norm` / `k_norm`, split with their heads).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SelfAttention {
    pub linear_qkv: LinearParams,
    pub q_layernorm: Option<Norm>,
    pub k_layernorm: Option<Norm>,
    pub linear_proj: LinearParams,
}

impl SelfAttention {
    /// Declares layer `layer`'s attention parameters.
    pub(crate) fn declare(d: &mut Declarer<'_>, layer: usize) -> SelfAttention {
        let c = d.c;
        let (h, a, g, dh) = (
            c.hidden_size,
            c.num_attention_heads,
            c.num_query_groups,
            c.kv_channels,
        );
        let mg = format!("decoder.layers.{layer}.self_attention");
        let q_rows = (a / g) * dh;
        let stride = q_rows + 2 * dh;
        let groups = |offset: usize, len: usize| {
            (0..g)
                .map(|gi| gi * stride + offset..gi * stride + offset + len)
                .collect::<Vec<_>>()
        };
        let linear_qkv = LinearParams::declare(
            d,
            LinearSpec {
                name: format!("{mg}.linear_qkv"),
                layer,
                shape: [c.qkv_size(), h],
                parallel: Parallel::Column { parts: 1 },
                bias: c.add_qkv_bias,
                init: Init::Normal,
                hf: match d.hf.qkv {
                    HfQkv::Separate { q, k, v } => vec![
                        (d.hf_layer(layer, q), groups(0, q_rows)),
                        (d.hf_layer(layer, k), groups(q_rows, dh)),
                        (d.hf_layer(layer, v), groups(q_rows + dh, dh)),
                    ],
                    HfQkv::Stacked(qkv) => {
                        let mut rows = groups(0, q_rows);
                        rows.extend(groups(q_rows, dh));
                        rows.extend(groups(q_rows + dh, dh));
                        vec![(d.hf_layer(layer, qkv), rows)]
                    }
                    HfQkv::Grouped(qkv) => vec![(d.hf_layer(layer, qkv), block(0..c.qkv_size()))],
                },
            },
        );
        let [q_layernorm, k_layernorm] = match (c.qk_layernorm, d.hf.qk_layernorm) {
            (true, Some(hf)) => [
                ("q_layernorm", hf[0], a * dh),
                ("k_layernorm", hf[1], g * dh),
            ]
            .map(|(name, hf, width)| {
                let (mg, hf) = (format!("{mg}.{name}"), d.hf_layer(layer, hf));
                let spec = NormSpec {
                    mg: &mg,
                    hf: &hf,
                    layer: Some(layer),
                    width,
                    split: TpSplit::Rows { parts: 1 },
                };
                Some(Norm::declare(d, spec))
            }),
            _ => [None, None],
        };
        let linear_proj = LinearParams::declare(
            d,
            LinearSpec {
                name: format!("{mg}.linear_proj"),
                layer,
                shape: [h, a * dh],
                parallel: Parallel::Row,
                bias: c.add_proj_bias,
                init: Init::ScaledNormal,
                hf: vec![(d.hf_layer(layer, d.hf.linear_proj), block(0..h))],
            },
        );
        SelfAttention {
            linear_qkv,
            q_layernorm,
            k_layernorm,
            linear_proj,
        }
    }
}

/// Unpacks `qkv: [rows, g, a/g + 2, d]` into `q: [rows, a, d]`, `k, v: [rows, g, d]`.
pub(crate) fn split_qkv(
    qkv: &[f32],
    c: &TransformerConfig,
    q: &mut [f32],
    k: &mut [f32],
    v: &mut [f32],
) {
    let (g, hpg, d) = (c.num_query_groups, c.heads_per_group(), c.kv_channels);
    let group = (hpg + 2) * d;
    for (r, row) in qkv.chunks_exact(g * group).enumerate() {
        for (gi, grp) in row.chunks_exact(group).enumerate() {
            q[(r * g + gi) * hpg * d..][..hpg * d].copy_from_slice(&grp[..hpg * d]);
            k[(r * g + gi) * d..][..d].copy_from_slice(&grp[hpg * d..(hpg + 1) * d]);
            v[(r * g + gi) * d..][..d].copy_from_slice(&grp[(hpg + 1) * d..]);
        }
    }
}

/// The inverse of [`split_qkv`]: packs `dq: [rows, a, d]`, `dk, dv: [rows, g, d]` into
/// `dqkv: [rows, g, a/g + 2, d]` (**overwritten**).
pub(crate) fn pack_qkv(
    dq: &[f32],
    dk: &[f32],
    dv: &[f32],
    c: &TransformerConfig,
    dqkv: &mut [f32],
) {
    let (g, hpg, d) = (c.num_query_groups, c.heads_per_group(), c.kv_channels);
    let group = (hpg + 2) * d;
    for (r, row) in dqkv.chunks_exact_mut(g * group).enumerate() {
        for (gi, grp) in row.chunks_exact_mut(group).enumerate() {
            grp[..hpg * d].copy_from_slice(&dq[(r * g + gi) * hpg * d..][..hpg * d]);
            grp[hpg * d..(hpg + 1) * d].copy_from_slice(&dk[(r * g + gi) * d..][..d]);
            grp[(hpg + 1) * d..].copy_from_slice(&dv[(r * g + gi) * d..][..d]);
        }
    }
}
