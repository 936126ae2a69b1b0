//! `[moe]`: mixture-of-experts layers with Megatron-Core's flags (`--num-experts`,
//! `--moe-*`; `megatron/training/arguments.py`, `_add_moe_args`): an MoE model built from the
//! `[model]` dimensions, or the routing and balancing-loss options of a loaded MoE model
//! (Mixtral, Qwen2-MoE, OLMoE).

use super::sections::section;
use ferrotron_model::{
    DropPolicy, ExpertCapacity, ExpertGroups, GroupScore, LoadBalancing, MoeConfig, RouterConfig,
    ScoreFunction, TokenDispatcher,
};
use serde::{Deserialize, Serialize};

/// `moe_layer_freq`: every `n`-th layer, or one 0/1 entry per layer (Megatron accepts an int
/// or a Python list expression such as `"([0]+[1]*23)"`; here a TOML list).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MoeLayerFreq {
    /// MoE on layers `l % n == 0`.
    Every(usize),
    /// `1` for an MoE layer, `0` for a dense one, one entry per layer.
    Pattern(Vec<u8>),
}

section! {
    /// `[moe]`: mixture of experts (Megatron's `--num-experts` / `--moe-*` flags).
    MoeSection, "moe" {
        /// Routed experts per MoE layer; setting it makes a model built from `[model]` an MoE
        /// model (every key below then has Megatron's default). Unset with `model.load` (the
        /// checkpoint decides). Megatron: `--num-experts`.
        num_experts: Option<usize> = None,
        /// Experts each token goes to. Default: 2 (a loaded model's own). Megatron:
        /// `--moe-router-topk`.
        moe_router_topk: Option<usize> = None,
        /// Each expert's inner width. Default: model.ffn_hidden_size. Unset with
        /// `model.load`. Megatron: `--moe-ffn-hidden-size`.
        moe_ffn_hidden_size: Option<usize> = None,
        /// Which layers are MoE: every n-th (an integer) or a 0/1 list with one entry per
        /// layer. Default: 1 (all). Unset with `model.load`. Megatron: `--moe-layer-freq`.
        moe_layer_freq: Option<MoeLayerFreq> = None,
        /// "softmax" or "sigmoid" (DeepSeek-V3). Default: "softmax". Megatron:
        /// `--moe-router-score-function`.
        moe_router_score_function: Option<String> = None,
        /// Softmax over all experts before the top-k, not renormalised (Qwen2-MoE, OLMoE,
        /// DeepSeek-V2); off: softmax over the chosen k (Mixtral). Default: false. Megatron:
        /// `--moe-router-pre-softmax`.
        moe_router_pre_softmax: Option<bool> = None,
        /// Multiplies the routing weights (DeepSeek's `routed_scaling_factor`). Default:
        /// unset (1). Megatron: `--moe-router-topk-scaling-factor`.
        moe_router_topk_scaling_factor: Option<f64> = None,
        /// Equal expert groups for group-limited routing. Default: unset (none). Megatron:
        /// `--moe-router-num-groups`.
        moe_router_num_groups: Option<usize> = None,
        /// Groups a token may route into. Required with moe_router_num_groups. Megatron:
        /// `--moe-router-group-topk`.
        moe_router_group_topk: Option<usize> = None,
        /// How a group scores: "sum" (of its best topk / group_topk experts, Megatron) or
        /// "max" (its best expert, DeepSeek-V2's `group_limited_greedy` as HF runs it).
        /// Default: "sum". Ferrotron's (Megatron has only "sum").
        moe_router_group_score: Option<String> = None,
        /// A shared expert every token goes through, of this width. Default: unset (none).
        /// Unset with `model.load`. Megatron: `--moe-shared-expert-intermediate-size`.
        moe_shared_expert_intermediate_size: Option<usize> = None,
        /// Scale the shared expert's output by `sigmoid(x·w)` (Qwen2-MoE). Default: false.
        /// Unset with `model.load`. Megatron: `--moe-shared-expert-gate` (model config).
        moe_shared_expert_gate: Option<bool> = None,
        /// "aux_loss" (per layer and micro-batch), "seq_aux_loss" (per sequence),
        /// "global_aux_loss" (with the global batch's expert counts: summed over the
        /// data-parallel ranks, averaged over the step's micro-batches) or "none".
        /// Default: "aux_loss" (a loaded model: "aux_loss" if its config.json sets
        /// `output_router_logits`, else "none"). Megatron: `--moe-router-load-balancing-type`.
        moe_router_load_balancing_type: Option<String> = None,
        /// Weight of the load-balancing loss. Default: 0.0 (a loaded model: its
        /// `router_aux_loss_coef`). Megatron: `--moe-aux-loss-coeff`.
        moe_aux_loss_coeff: Option<f64> = None,
        /// Weight of the router z-loss. Default: unset (none). Megatron: `--moe-z-loss-coeff`.
        moe_z_loss_coeff: Option<f64> = None,
        /// Each expert takes at most ceil(tokens x topk / experts x factor) tokens, the rest
        /// dropped. Default: unset (dropless). Megatron: `--moe-expert-capacity-factor`.
        moe_expert_capacity_factor: Option<f64> = None,
        /// Which tokens an expert over capacity keeps: "probs" (highest routing weights) or
        /// "position" (earliest). Default: "probs". Megatron: `--moe-token-drop-policy`.
        moe_token_drop_policy: Option<String> = None,
        /// Pad every expert's input to its capacity with weight-0 rows (fixed shapes, the
        /// same values; needs moe_expert_capacity_factor and the alltoall dispatcher).
        /// Default: false. Megatron: `--moe-pad-expert-input-to-capacity`.
        moe_pad_expert_input_to_capacity: bool = false,
        /// Aux-loss-free load balancing (DeepSeek-V3): a per-expert bias added to the sigmoid
        /// scores when choosing the experts, moved after every step toward an even load.
        /// Needs moe_router_score_function = "sigmoid"; the bias is kept in f32 whatever
        /// the weights' dtype (Megatron's fp32 buffer). Default: false.
        /// Unset with `model.load`. Megatron: `--moe-router-enable-expert-bias`.
        moe_router_enable_expert_bias: Option<bool> = None,
        /// How far the expert bias moves per step. Default: 1e-3. Megatron:
        /// `--moe-router-bias-update-rate`.
        moe_router_bias_update_rate: Option<f64> = None,
        /// How tokens reach the experts under expert parallelism: "alltoall" (each routed
        /// row to its expert's rank and back) or "allgather" (every rank gathers every
        /// token). Default: "alltoall". Megatron: `--moe-token-dispatcher-type`.
        moe_token_dispatcher_type: Option<String> = None,
    }
}

/// What `[moe]` asks of the run.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MoeSettings {
    /// The MoE layers of a model built from `[model]` (`num_experts` set).
    pub build: Option<MoeConfig>,
    /// Options applied to a loaded MoE model ([`MoeSettings::apply`]).
    pub options: MoeOptions,
}

/// The routing and loss options `[moe]` sets (`None`: keep the model's).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MoeOptions {
    pub topk: Option<usize>,
    pub score_function: Option<ScoreFunction>,
    pub pre_softmax: Option<bool>,
    pub scaling_factor: Option<f32>,
    pub groups: Option<ExpertGroups>,
    pub load_balancing_type: Option<LoadBalancing>,
    pub aux_loss_coeff: Option<f32>,
    pub z_loss_coeff: Option<f32>,
    pub capacity: Option<ExpertCapacity>,
    pub token_dispatcher: Option<TokenDispatcher>,
}

impl MoeOptions {
    /// Whether any option is set.
    pub fn any(&self) -> bool {
        *self != MoeOptions::default()
    }

    /// Writes the set options into `m`.
    pub fn apply(&self, m: &mut MoeConfig) {
        let r = &mut m.router;
        r.topk = self.topk.unwrap_or(r.topk);
        r.score_function = self.score_function.unwrap_or(r.score_function);
        r.pre_softmax = self.pre_softmax.unwrap_or(r.pre_softmax);
        r.scaling_factor = self.scaling_factor.or(r.scaling_factor);
        r.groups = self.groups.or(r.groups);
        m.load_balancing_type = self.load_balancing_type.unwrap_or(m.load_balancing_type);
        m.aux_loss_coeff = self.aux_loss_coeff.unwrap_or(m.aux_loss_coeff);
        m.z_loss_coeff = self.z_loss_coeff.or(m.z_loss_coeff);
        m.capacity = self.capacity.or(m.capacity);
        m.token_dispatcher = self.token_dispatcher.unwrap_or(m.token_dispatcher);
    }
}

/// The structural keys, which a loaded model's checkpoint decides.
fn structural(s: &MoeSection) -> Vec<&'static str> {
    [
        ("moe.num_experts", s.num_experts.is_some()),
        ("moe.moe_ffn_hidden_size", s.moe_ffn_hidden_size.is_some()),
        ("moe.moe_layer_freq", s.moe_layer_freq.is_some()),
        (
            "moe.moe_shared_expert_intermediate_size",
            s.moe_shared_expert_intermediate_size.is_some(),
        ),
        (
            "moe.moe_shared_expert_gate",
            s.moe_shared_expert_gate.is_some(),
        ),
        (
            "moe.moe_router_enable_expert_bias",
            s.moe_router_enable_expert_bias.is_some(),
        ),
        (
            "moe.moe_router_bias_update_rate",
            s.moe_router_bias_update_rate.is_some(),
        ),
    ]
    .into_iter()
    .filter_map(|(k, set)| set.then_some(k))
    .collect()
}

/// Validates `[moe]` (problems pushed to `p`, each naming its key): `loaded` says the model
/// comes from `model.load`; `dims` are `(num_layers, ffn_hidden_size)` of a model built from
/// `[model]`.
pub(super) fn moe_settings(
    s: &MoeSection,
    loaded: bool,
    dims: Option<(usize, usize)>,
    p: &mut Vec<String>,
) -> MoeSettings {
    let options = options(s, p);
    if loaded {
        for key in structural(s) {
            p.push(format!(
                "{key} must be unset with model.load (the checkpoint decides)"
            ));
        }
        return MoeSettings {
            build: None,
            options,
        };
    }
    let (Some(num_experts), Some((num_layers, ffn))) = (s.num_experts, dims) else {
        if options.any() || !structural(s).is_empty() {
            p.push("[moe] keys need moe.num_experts (or a loaded MoE model)".into());
        }
        return MoeSettings::default();
    };
    let layer_pattern = match &s.moe_layer_freq {
        None => MoeConfig::pattern_every(1, num_layers),
        Some(MoeLayerFreq::Every(n)) => MoeConfig::pattern_every(*n, num_layers),
        Some(MoeLayerFreq::Pattern(v)) => v.iter().map(|&x| x != 0).collect(),
    };
    let mut moe = MoeConfig {
        router: RouterConfig {
            num_experts,
            topk: 2,
            score_function: ScoreFunction::Softmax,
            pre_softmax: false,
            groups: None,
            scaling_factor: None,
        },
        moe_ffn_hidden_size: s.moe_ffn_hidden_size.unwrap_or(ffn),
        layer_pattern,
        shared_expert_intermediate_size: s.moe_shared_expert_intermediate_size,
        shared_expert_gate: s.moe_shared_expert_gate.unwrap_or(false),
        load_balancing_type: LoadBalancing::AuxLoss,
        aux_loss_coeff: 0.0,
        z_loss_coeff: None,
        capacity: None,
        token_dispatcher: Default::default(),
        expert_bias_update_rate: s
            .moe_router_enable_expert_bias
            .unwrap_or(false)
            .then(|| s.moe_router_bias_update_rate.unwrap_or(1e-3) as f32),
    };
    if s.moe_router_bias_update_rate.is_some() && moe.expert_bias_update_rate.is_none() {
        p.push("moe.moe_router_bias_update_rate needs moe.moe_router_enable_expert_bias".into());
    }
    options.apply(&mut moe);
    if let Err(e) = moe.validate(num_layers) {
        p.push(format!("[moe]: {e}"));
    }
    MoeSettings {
        build: Some(moe),
        options: MoeOptions::default(),
    }
}

/// `moe_router_load_balancing_type`'s values.
const LOAD_BALANCING: [&str; 4] = ["aux_loss", "seq_aux_loss", "global_aux_loss", "none"];

/// The routing and loss options, each bad value a problem naming its key.
fn options(s: &MoeSection, p: &mut Vec<String>) -> MoeOptions {
    let mut pick = |key: &str, v: &Option<String>, names: &[&str]| -> Option<usize> {
        let v = v.as_deref()?;
        let i = names.iter().position(|n| *n == v);
        if i.is_none() {
            p.push(format!("moe.{key} = \"{v}\": expected one of {names:?}"));
        }
        i
    };
    let score_function = pick(
        "moe_router_score_function",
        &s.moe_router_score_function,
        &["softmax", "sigmoid"],
    )
    .map(|i| [ScoreFunction::Softmax, ScoreFunction::Sigmoid][i]);
    let group_score = pick(
        "moe_router_group_score",
        &s.moe_router_group_score,
        &["sum", "max"],
    )
    .map(|i| [GroupScore::SumOfTop, GroupScore::Max][i]);
    let load_balancing_type = pick(
        "moe_router_load_balancing_type",
        &s.moe_router_load_balancing_type,
        &LOAD_BALANCING,
    )
    .and_then(|i| LoadBalancing::from_name(LOAD_BALANCING[i]));
    let drop_policy = pick(
        "moe_token_drop_policy",
        &s.moe_token_drop_policy,
        &["probs", "position"],
    )
    .map(|i| [DropPolicy::Probs, DropPolicy::Position][i]);
    let token_dispatcher = pick(
        "moe_token_dispatcher_type",
        &s.moe_token_dispatcher_type,
        &["alltoall", "allgather"],
    )
    .map(|i| [TokenDispatcher::AllToAll, TokenDispatcher::AllGather][i]);
    let groups = match (s.moe_router_num_groups, s.moe_router_group_topk) {
        (Some(num_groups), Some(group_topk)) => Some(ExpertGroups {
            num_groups,
            group_topk,
            score: group_score.unwrap_or(GroupScore::SumOfTop),
        }),
        (None, None) => None,
        _ => {
            p.push("moe.moe_router_num_groups and moe.moe_router_group_topk go together".into());
            None
        }
    };
    if drop_policy.is_some() && s.moe_expert_capacity_factor.is_none() {
        p.push("moe.moe_token_drop_policy needs moe.moe_expert_capacity_factor".into());
    }
    if s.moe_pad_expert_input_to_capacity && s.moe_expert_capacity_factor.is_none() {
        p.push("moe.moe_pad_expert_input_to_capacity needs moe.moe_expert_capacity_factor".into());
    }
    MoeOptions {
        topk: s.moe_router_topk,
        score_function,
        pre_softmax: s.moe_router_pre_softmax,
        scaling_factor: s.moe_router_topk_scaling_factor.map(|f| f as f32),
        groups,
        load_balancing_type,
        aux_loss_coeff: s.moe_aux_loss_coeff.map(|c| c as f32),
        z_loss_coeff: s.moe_z_loss_coeff.map(|c| c as f32),
        capacity: s.moe_expert_capacity_factor.map(|f| ExpertCapacity {
            factor: f as f32,
            drop_policy: drop_policy.unwrap_or(DropPolicy::Probs),
            pad_to_capacity: s.moe_pad_expert_input_to_capacity,
        }),
        token_dispatcher,
    }
}
