//! Multi-latent attention's parameters (Megatron-Core `MLASelfAttention`,
//! `transformer/multi_latent_attention.py`; transformers' `DeepseekV2Attention`), and a
//! layer's attention as either kind ([`LayerAttention`]).

use super::attention::SelfAttention;
use super::decl::{Declarer, Init};
use super::linear::{LinearParams, LinearSpec, Parallel, block};
use super::norm::{Norm, NormSpec};
use crate::families::HfMla;
use crate::{MlaConfig, TpSplit};

/// How the queries are projected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlaQuery {
    /// `linear_q_proj: [a·(dn + dr), h]` (HF `q_proj`; no `q_lora_rank`), column-parallel.
    Direct(LinearParams),
    /// Through the query latent: `linear_q_down_proj: [q_lora_rank, h]` (HF `q_a_proj`,
    /// replicated), `q_layernorm: [q_lora_rank]` (HF `q_a_layernorm`, replicated),
    /// `linear_q_up_proj: [a·(dn + dr), q_lora_rank]` (HF `q_b_proj`, column-parallel).
    Latent {
        linear_q_down_proj: LinearParams,
        q_layernorm: Norm,
        linear_q_up_proj: LinearParams,
    },
}

/// The parameters of one layer's multi-latent attention (`dn` = `qk_head_dim`, `dr` =
/// `qk_pos_emb_head_dim`, `dv` = `v_head_dim`, `c` = `kv_lora_rank`). Each head's query rows
/// are `[nope dn | rope dr]`, each head's `linear_kv_up_proj` rows `[k_nope dn | v dv]`, so
/// tensor parallelism splits the up projections by whole heads; the down projections and the
/// latent norms are replicated (every rank computes them from all rows; their gradients are
/// partial sums over the ranks, summed by [`crate::GptModel::finalize_grads`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaSelfAttention {
    pub query: MlaQuery,
    /// `[c + dr, h]` (HF `kv_a_proj_with_mqa`): the latent `c`, then the one shared rope key.
    pub linear_kv_down_proj: LinearParams,
    /// `[c]` (HF `kv_a_layernorm`).
    pub kv_layernorm: Norm,
    /// `[a·(dn + dv), c]` (HF `kv_b_proj`).
    pub linear_kv_up_proj: LinearParams,
    /// `[h, a·dv]` (HF `o_proj`), row-parallel.
    pub linear_proj: LinearParams,
}

/// A decoder layer's attention: standard (`linear_qkv`) or multi-latent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerAttention {
    SelfAttention(SelfAttention),
    MultiLatent(MlaSelfAttention),
}

impl LayerAttention {
    /// Declares layer `layer`'s attention: MLA when the config says so.
    pub(crate) fn declare(d: &mut Declarer<'_>, layer: usize) -> LayerAttention {
        match (d.c.multi_latent_attention, d.hf.mla) {
            (Some(mla), Some(names)) => {
                LayerAttention::MultiLatent(MlaSelfAttention::declare(d, layer, mla, names))
            }
            // `HfNames::check_expresses` ties MLA configs to families with MLA names.
            _ => LayerAttention::SelfAttention(SelfAttention::declare(d, layer)),
        }
    }

    /// The attention's linear layers (`linear_qkv` or MLA's projections, then `linear_proj`).
    pub fn linears(&self) -> Vec<LinearParams> {
        match self {
            LayerAttention::SelfAttention(sa) => vec![sa.linear_qkv, sa.linear_proj],
            LayerAttention::MultiLatent(m) => {
                let mut l = match m.query {
                    MlaQuery::Direct(q) => vec![q],
                    MlaQuery::Latent {
                        linear_q_down_proj,
                        linear_q_up_proj,
                        ..
                    } => vec![linear_q_down_proj, linear_q_up_proj],
                };
                l.extend([m.linear_kv_down_proj, m.linear_kv_up_proj, m.linear_proj]);
                l
            }
        }
    }

    /// Attention's output projection `[h, a·dv]`.
    pub fn linear_proj(&self) -> LinearParams {
        match self {
            LayerAttention::SelfAttention(sa) => sa.linear_proj,
            LayerAttention::MultiLatent(m) => m.linear_proj,
        }
    }
}

impl MlaSelfAttention {
    fn declare(d: &mut Declarer<'_>, layer: usize, mla: MlaConfig, hf: HfMla) -> Self {
        let (h, a) = (d.c.hidden_size, d.c.num_attention_heads);
        let mg = format!("decoder.layers.{layer}.self_attention");
        let q_rows = a * mla.query_head_dim();
        let linear = |d: &mut Declarer<'_>, name: &str, hf_name: &str, shape, parallel| {
            let init = match parallel {
                Parallel::Row => Init::ScaledNormal,
                _ => Init::Normal,
            };
            LinearParams::declare(
                d,
                LinearSpec {
                    name: format!("{mg}.{name}"),
                    layer,
                    shape,
                    parallel,
                    bias: false,
                    init,
                    hf: vec![(d.hf_layer(layer, hf_name), block(0..shape[0]))],
                },
            )
        };
        let column = Parallel::Column { parts: 1 };
        let query = match mla.q_lora_rank {
            None => MlaQuery::Direct(linear(d, "linear_q_proj", hf.q_proj, [q_rows, h], column)),
            Some(r) => {
                let down = linear(
                    d,
                    "linear_q_down_proj",
                    hf.q_a_proj,
                    [r, h],
                    Parallel::Replicated,
                );
                let norm = latent_norm(d, layer, &format!("{mg}.q_layernorm"), hf.q_a_layernorm, r);
                let up = linear(d, "linear_q_up_proj", hf.q_b_proj, [q_rows, r], column);
                MlaQuery::Latent {
                    linear_q_down_proj: down,
                    q_layernorm: norm,
                    linear_q_up_proj: up,
                }
            }
        };
        let (c, dr) = (mla.kv_lora_rank, mla.qk_pos_emb_head_dim);
        let linear_kv_down_proj = linear(
            d,
            "linear_kv_down_proj",
            hf.kv_a_proj_with_mqa,
            [c + dr, h],
            Parallel::Replicated,
        );
        let kv_layernorm = latent_norm(
            d,
            layer,
            &format!("{mg}.kv_layernorm"),
            hf.kv_a_layernorm,
            c,
        );
        let kv_rows = a * (mla.qk_head_dim + mla.v_head_dim);
        let linear_kv_up_proj = linear(d, "linear_kv_up_proj", hf.kv_b_proj, [kv_rows, c], column);
        let proj_name = d.hf.linear_proj;
        let linear_proj = linear(
            d,
            "linear_proj",
            proj_name,
            [h, a * mla.v_head_dim],
            Parallel::Row,
        );
        MlaSelfAttention {
            query,
            linear_kv_down_proj,
            kv_layernorm,
            linear_kv_up_proj,
            linear_proj,
        }
    }

    /// The replicated latent norms' parameters, for [`crate::GptModel::finalize_grads`]:
    /// every parameter whose gradient each tensor-parallel rank computes a part of.
    pub fn replicated_params(&self) -> Vec<super::ParamId> {
        let mut ids: Vec<_> = [self.linear_kv_down_proj.weight]
            .into_iter()
            .chain(self.kv_layernorm.param_ids())
            .collect();
        if let MlaQuery::Latent {
            linear_q_down_proj,
            q_layernorm,
            ..
        } = self.query
        {
            ids.push(linear_q_down_proj.weight);
            ids.extend(q_layernorm.param_ids());
        }
        ids
    }
}

/// A latent's RMSNorm `[width]`, replicated over tensor-parallel ranks.
fn latent_norm(d: &mut Declarer<'_>, layer: usize, mg: &str, hf: &str, width: usize) -> Norm {
    let hf = d.hf_layer(layer, hf);
    Norm::declare(
        d,
        NormSpec {
            mg,
            hf: &hf,
            layer: Some(layer),
            width,
            split: TpSplit::Replicated,
        },
    )
}
