//! [`MoeConfig`]: a model's mixture-of-experts settings, with Megatron-Core's names
//! (`TransformerConfig.num_moe_experts`, `moe_*`; `megatron/core/transformer/moe/`). The
//! routing rule itself is [`RouterConfig`] (`ferrotron_nn::moe`), which runs it.

use super::field_error;
use crate::Result;
pub use ferrotron_nn::moe::{DropPolicy, ExpertGroups, GroupScore, RouterConfig, ScoreFunction};

/// Megatron's `moe_router_load_balancing_type`: the auxiliary loss that spreads tokens over
/// the experts (`megatron/core/transformer/moe/router.py`, `moe_utils.py`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadBalancing {
    /// `aux_loss` (Switch Transformer, Fedus et al. 2021): per layer and micro-batch,
    /// `coeff · E / (k · T²) · Σ_i (Σ_t p_ti) · c_i` over the micro-batch's `T` tokens, `p` the
    /// router's scores over all experts and `c_i` the tokens whose plain top-k holds expert
    /// `i` (`switch_load_balancing_loss_func`).
    AuxLoss,
    /// `seq_aux_loss` (DeepSeek-V2's `seq_aux`): the same per sequence (`T` = its length),
    /// averaged over the micro-batch's sequences (`sequence_load_balancing_loss_func`).
    SeqAuxLoss,
    /// `global_aux_loss` (Qiu et al. 2025, global-batch balancing): `aux_loss` with `c` the
    /// global batch's counts (summed over the data-parallel ranks, averaged over the step's
    /// micro-batches so far) and `T` the micro-batch's tokens times the data-parallel size
    /// (`_apply_global_aux_loss`; see `global_aux.rs`).
    GlobalAuxLoss,
    /// `none`: no balancing loss (HF's models at inference, aux-loss-free routing).
    None,
}

impl LoadBalancing {
    /// Megatron's spelling (`aux_loss`, `seq_aux_loss`, `none`).
    pub fn name(self) -> &'static str {
        match self {
            LoadBalancing::AuxLoss => "aux_loss",
            LoadBalancing::SeqAuxLoss => "seq_aux_loss",
            LoadBalancing::GlobalAuxLoss => "global_aux_loss",
            LoadBalancing::None => "none",
        }
    }

    /// Parses Megatron's spelling; `None` for any other (`sinkhorn` is not supported).
    pub fn from_name(name: &str) -> Option<LoadBalancing> {
        [
            LoadBalancing::AuxLoss,
            LoadBalancing::SeqAuxLoss,
            LoadBalancing::GlobalAuxLoss,
            LoadBalancing::None,
        ]
        .into_iter()
        .find(|l| l.name() == name)
    }
}

/// Token dropping over an expert's capacity (Megatron's `moe_expert_capacity_factor`,
/// `moe_token_drop_policy`; [`ferrotron_nn::moe::Routing::drop_over_capacity`]). Without it
/// the layer is dropless (Megatron's default, and every HF model).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExpertCapacity {
    /// `moe_expert_capacity_factor`: each expert takes at most `ceil(T·k/E · factor)` tokens.
    pub factor: f32,
    /// `moe_token_drop_policy`: which tokens an expert over capacity keeps.
    pub drop_policy: DropPolicy,
    /// `moe_pad_expert_input_to_capacity`: every expert computes `min(capacity, T)` rows,
    /// padded with weight-0 rows ([`ferrotron_nn::moe::Routing::pad_to_capacity`]): the same
    /// values, fixed shapes (the `alltoall` dispatcher's exchange too).
    pub pad_to_capacity: bool,
}

/// How an expert-parallel rank's tokens reach the experts (Megatron's
/// `moe_token_dispatcher_type`); without expert parallelism both are the same computation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TokenDispatcher {
    /// `alltoall`: each routed row goes to the rank holding its expert and back
    /// ([`ferrotron_nn::moe::ep_experts_forward`]).
    #[default]
    AllToAll,
    /// `allgather`: every rank gathers every rank's tokens, runs its experts on those routed
    /// to them, and a reduce-scatter sums the results
    /// ([`ferrotron_nn::moe::ag_experts_forward`]).
    AllGather,
}

/// The mixture-of-experts layers of a model (Megatron's `MoELayer`): a router `[E, h]`, `E`
/// routed SwiGLU experts of width `moe_ffn_hidden_size` run as a grouped GEMM, optionally a
/// shared expert every token goes through (Qwen2-MoE's `shared_expert`, DeepSeek's
/// `shared_experts`), on the layers [`MoeConfig::layer_pattern`] marks; the other layers keep
/// the dense MLP of width `ffn_hidden_size`.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// The routing rule: `num_experts` is Megatron's `num_moe_experts`, `topk`
    /// `moe_router_topk`, and the `moe_router_*` options.
    pub router: RouterConfig,
    /// `moe_ffn_hidden_size`: each routed expert's inner size (per half of its gated
    /// `linear_fc1`).
    pub moe_ffn_hidden_size: usize,
    /// Megatron's `moe_layer_freq` as one entry per layer: `true` for an MoE layer (HF's
    /// `decoder_sparse_step` / `mlp_only_layers`, DeepSeek's `first_k_dense_replace` /
    /// `moe_layer_freq` map onto it).
    pub layer_pattern: Vec<bool>,
    /// `moe_shared_expert_intermediate_size`: the shared expert's inner size, if the layers
    /// have one.
    pub shared_expert_intermediate_size: Option<usize>,
    /// `moe_shared_expert_gate`: the shared expert's output is scaled by
    /// `sigmoid(x · w)`, `w: [1, h]` (Qwen2-MoE's `shared_expert_gate`).
    pub shared_expert_gate: bool,
    /// `moe_router_load_balancing_type`.
    pub load_balancing_type: LoadBalancing,
    /// `moe_aux_loss_coeff` (HF's `router_aux_loss_coef`).
    pub aux_loss_coeff: f32,
    /// `moe_z_loss_coeff` (ST-MoE's router z-loss, Zoph et al. 2022); `None` for none.
    pub z_loss_coeff: Option<f32>,
    /// Token dropping; `None` is dropless.
    pub capacity: Option<ExpertCapacity>,
    /// `moe_token_dispatcher_type` (expert parallelism only).
    pub token_dispatcher: TokenDispatcher,
    /// Megatron's `moe_router_enable_expert_bias` with its `moe_router_bias_update_rate`
    /// (aux-loss-free load balancing, Wang et al. 2024, DeepSeek-V3): each MoE layer keeps an
    /// `[E]` bias added to the sigmoid scores for choosing the experts (not to the weights);
    /// after every step it moves by `rate · sign(mean − count)` per expert, the counts of the
    /// step's routed tokens summed over the data-parallel ranks. `None`: no bias.
    pub expert_bias_update_rate: Option<f32>,
}

impl MoeConfig {
    /// Routed experts `E`.
    pub fn num_experts(&self) -> usize {
        self.router.num_experts
    }

    /// Whether global layer `layer` is an MoE layer.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.layer_pattern.get(layer).copied().unwrap_or(false)
    }

    /// Megatron's `moe_layer_freq` given as an integer `n` over `num_layers` layers: every
    /// `n`-th layer, starting with the first (`[l % n == 0 for l in range(num_layers)]`).
    pub fn pattern_every(n: usize, num_layers: usize) -> Vec<bool> {
        (0..num_layers).map(|l| n > 0 && l % n == 0).collect()
    }

    /// Checks the settings against each other and the model's `num_layers`.
    ///
    /// # Errors
    /// A [`crate::ModelError::ConfigField`] naming the option: a bad routing rule, an expert
    /// size of 0, a layer pattern of the wrong length or without MoE layers, a negative or
    /// non-finite loss coefficient, a capacity factor that is not positive.
    pub fn validate(&self, num_layers: usize) -> Result<()> {
        self.router.validate().map_err(|e| match e {
            ferrotron_nn::NnError::BadInput { field, reason } => field_error(&field, reason),
            other => field_error("moe_router", other.to_string()),
        })?;
        if self.moe_ffn_hidden_size == 0 {
            return Err(field_error("moe_ffn_hidden_size", "must be > 0"));
        }
        if self.shared_expert_intermediate_size == Some(0) {
            return Err(field_error(
                "moe_shared_expert_intermediate_size",
                "must be > 0 (leave it unset for no shared expert)",
            ));
        }
        if self.shared_expert_gate && self.shared_expert_intermediate_size.is_none() {
            return Err(field_error(
                "moe_shared_expert_gate",
                "needs a shared expert (moe_shared_expert_intermediate_size)",
            ));
        }
        if self.layer_pattern.len() != num_layers || !self.layer_pattern.contains(&true) {
            return Err(field_error(
                "moe_layer_freq",
                format!(
                    "needs one entry per layer ({num_layers}) with at least one MoE layer, \
                     got {:?}",
                    self.layer_pattern
                ),
            ));
        }
        let coeffs = [
            ("moe_aux_loss_coeff", Some(self.aux_loss_coeff)),
            ("moe_z_loss_coeff", self.z_loss_coeff),
        ];
        for (field, c) in coeffs {
            if let Some(c) = c.filter(|c| !(c.is_finite() && *c >= 0.0)) {
                return Err(field_error(field, format!("{c} must be finite and >= 0")));
            }
        }
        if let Some(rate) = self.expert_bias_update_rate {
            if !(rate.is_finite() && rate > 0.0) {
                return Err(field_error(
                    "moe_router_bias_update_rate",
                    format!("{rate} must be > 0"),
                ));
            }
            if self.router.score_function != ScoreFunction::Sigmoid {
                return Err(field_error(
                    "moe_router_enable_expert_bias",
                    "the expert bias needs the sigmoid score function (Megatron's rule)",
                ));
            }
        }
        if let Some(c) = self.capacity
            && !(c.factor.is_finite() && c.factor > 0.0)
        {
            return Err(field_error(
                "moe_expert_capacity_factor",
                format!("{} must be > 0", c.factor),
            ));
        }
        if self.capacity.is_some_and(|c| c.pad_to_capacity)
            && self.token_dispatcher == TokenDispatcher::AllGather
        {
            return Err(field_error(
                "moe_pad_expert_input_to_capacity",
                "pads the alltoall dispatcher's rows: needs moe_token_dispatcher_type \"alltoall\"",
            ));
        }
        Ok(())
    }
}
