//! DeepSeek-V2's config keys (transformers 5.23 `configuration_deepseek_v2.py`, class
//! defaults for absent keys): multi-latent attention into an [`MlaConfig`], the experts into a
//! [`MoeConfig`], and back.
//!
//! transformers' in-tree `DeepseekV2TopkRouter` (what the fixtures match): f32 logits ->
//! softmax over the experts -> top-k (`greedy`), or top-k within the `topk_group` best of
//! `n_group` groups scored by their **max** expert (`group_limited_greedy`) -> times
//! `routed_scaling_factor`, never renormalised: Megatron's `moe_router_pre_softmax` with
//! [`GroupScore::Max`] and `moe_router_topk_scaling_factor`. It ignores `norm_topk_prob`
//! (DeepSeek's remote code would renormalise and skip the scale; so do we not) and
//! `moe_layer_freq` (the MoE layers are those from `first_k_dense_replace` on), and returns
//! no balancing loss: `aux_loss_alpha` is kept as the coefficient a training config's
//! `seq_aux_loss` (DeepSeek's `seq_aux`) would use.

use super::hf_config::{opt_bool, opt_f64, opt_str, opt_usize, req_usize};
use super::hf_export::finite_f32;
use crate::config::field_error;
use crate::{
    ExpertGroups, GroupScore, LoadBalancing, MlaConfig, MoeConfig, Result, RouterConfig,
    ScoreFunction, TransformerConfig,
};
use serde_json::{Map, Value, json};

/// The multi-latent attention and MoE settings of a DeepSeek-V2 `config.json` with
/// `num_layers` layers and `num_heads` query heads.
///
/// # Errors
/// A key of the wrong type; `num_key_value_heads` other than the heads; a `topk_method`
/// other than `greedy` / `group_limited_greedy`; groups missing for the latter; a
/// `moe_layer_freq` other than 1 (transformers ignores it; DeepSeek's remote code does not).
/// `first_k_dense_replace` at or past the layers is an all-dense model (no MoE settings).
pub(super) fn parse_deepseek(
    obj: &Map<String, Value>,
    num_layers: usize,
    num_heads: usize,
) -> Result<(MlaConfig, Option<MoeConfig>)> {
    if opt_usize(obj, "num_key_value_heads")?.is_some_and(|g| g != num_heads) {
        return Err(field_error(
            "num_key_value_heads",
            "multi-latent attention has one key/value head per query head",
        ));
    }
    let mla = MlaConfig {
        q_lora_rank: match obj.get("q_lora_rank") {
            Some(Value::Null) => None,
            _ => Some(opt_usize(obj, "q_lora_rank")?.unwrap_or(1536)),
        },
        kv_lora_rank: opt_usize(obj, "kv_lora_rank")?.unwrap_or(512),
        qk_head_dim: opt_usize(obj, "qk_nope_head_dim")?.unwrap_or(128),
        qk_pos_emb_head_dim: opt_usize(obj, "qk_rope_head_dim")?.unwrap_or(64),
        v_head_dim: opt_usize(obj, "v_head_dim")?.unwrap_or(128),
    };
    if opt_usize(obj, "moe_layer_freq")?.is_some_and(|f| f != 1) {
        return Err(field_error(
            "moe_layer_freq",
            "only 1 is supported (transformers' DeepseekV2 ignores it)",
        ));
    }
    let num_experts = opt_usize(obj, "n_routed_experts")?.unwrap_or(64);
    let expert_ffn = opt_usize(obj, "moe_intermediate_size")?.unwrap_or(1407);
    let groups = match opt_str(obj, "topk_method")?.unwrap_or("greedy") {
        "greedy" => None,
        "group_limited_greedy" => Some(ExpertGroups {
            num_groups: req_usize(obj, "n_group")?,
            group_topk: req_usize(obj, "topk_group")?,
            score: GroupScore::Max,
        }),
        other => {
            return Err(field_error(
                "topk_method",
                format!("`{other}` is not supported (greedy, group_limited_greedy)"),
            ));
        }
    };
    let scale = opt_f64(obj, "routed_scaling_factor")?.unwrap_or(1.0) as f32;
    let shared = opt_usize(obj, "n_shared_experts")?.unwrap_or(2);
    let first_dense = opt_usize(obj, "first_k_dense_replace")?.unwrap_or(0);
    if first_dense >= num_layers {
        // Every layer dense: no MoE settings to keep.
        return Ok((mla, None));
    }
    let moe = MoeConfig {
        router: RouterConfig {
            num_experts,
            topk: req_usize(obj, "num_experts_per_tok")?,
            score_function: ScoreFunction::Softmax,
            pre_softmax: true,
            groups,
            scaling_factor: (scale != 1.0).then_some(scale),
        },
        moe_ffn_hidden_size: expert_ffn,
        layer_pattern: (0..num_layers).map(|l| l >= first_dense).collect(),
        shared_expert_intermediate_size: (shared > 0).then_some(expert_ffn * shared),
        shared_expert_gate: false,
        load_balancing_type: match opt_bool(obj, "output_router_logits")? {
            // transformers' DeepseekV2 computes no balancing loss; a training run that sets
            // `output_router_logits` asks for DeepSeek's own.
            Some(true) => LoadBalancing::SeqAuxLoss,
            _ => LoadBalancing::None,
        },
        aux_loss_coeff: opt_f64(obj, "aux_loss_alpha")?.unwrap_or(0.001) as f32,
        z_loss_coeff: None,
        capacity: None,
        token_dispatcher: Default::default(),
        expert_bias_update_rate: None,
    };
    Ok((mla, Some(moe)))
}

/// Writes `c`'s multi-latent attention and MoE keys as DeepSeek-V2's config spells them.
///
/// # Errors
/// What the family cannot express, naming the field: no MLA, a routing rule
/// other than pre-softmax top-k (optionally max-grouped and scaled), a shared expert whose
/// width is not a multiple of the experts', a gated shared expert, dense layers anywhere but
/// first.
pub(super) fn insert_deepseek_fields(
    obj: &mut Map<String, Value>,
    c: &TransformerConfig,
) -> Result<()> {
    let arch = c.family.hf_architecture();
    let bad = |field: &str, why: &str| Err(field_error(field, format!("{arch}: {why}")));
    let Some(mla) = &c.multi_latent_attention else {
        return bad(
            "multi_latent_attention",
            "every layer has multi-latent attention",
        );
    };
    let first_dense = match &c.moe {
        Some(moe) => moe.layer_pattern.iter().take_while(|m| !**m).count(),
        None => c.num_layers,
    };
    let fields = json!({
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_head_dim,
        "qk_rope_head_dim": mla.qk_pos_emb_head_dim,
        "v_head_dim": mla.v_head_dim,
        "qk_head_dim": mla.query_head_dim(),
        "head_dim": mla.qk_pos_emb_head_dim,
        "first_k_dense_replace": first_dense,
    });
    if let Value::Object(fields) = fields {
        obj.extend(fields);
    }
    match &c.moe {
        Some(moe) => insert_moe(obj, moe, first_dense, arch),
        None => Ok(()),
    }
}

/// DeepSeek-V2's MoE keys of `moe` (its first `first_dense` layers dense) into `obj`.
fn insert_moe(
    obj: &mut Map<String, Value>,
    moe: &MoeConfig,
    first_dense: usize,
    arch: &str,
) -> Result<()> {
    let bad = |field: &str, why: &str| Err(field_error(field, format!("{arch}: {why}")));
    let r = &moe.router;
    let max_groups = r.groups.is_none_or(|g| g.score == GroupScore::Max);
    if r.score_function != ScoreFunction::Softmax || !r.pre_softmax || !max_groups {
        return bad(
            "moe_router_pre_softmax",
            "routes by softmax then top-k (groups scored by their max expert)",
        );
    }
    let f = moe.moe_ffn_hidden_size;
    let shared = match moe.shared_expert_intermediate_size {
        None => 0,
        Some(w) if w % f == 0 => w / f,
        Some(_) => {
            return bad(
                "moe_shared_expert_intermediate_size",
                "the shared experts' width is n_shared_experts x moe_intermediate_size",
            );
        }
    };
    if moe.shared_expert_gate {
        return bad("moe_shared_expert_gate", "the shared experts are ungated");
    }
    if moe.layer_pattern[first_dense..].contains(&false) {
        return bad(
            "moe_layer_freq",
            "dense layers come first (first_k_dense_replace)",
        );
    }
    let (method, n_group, topk_group) = match r.groups {
        Some(g) => (
            "group_limited_greedy",
            json!(g.num_groups),
            json!(g.group_topk),
        ),
        None => ("greedy", Value::Null, Value::Null),
    };
    let scale = r.scaling_factor.unwrap_or(1.0);
    let fields = json!({
        "n_routed_experts": r.num_experts,
        "num_experts_per_tok": r.topk,
        "moe_intermediate_size": f,
        "n_shared_experts": shared,
        "topk_method": method,
        "n_group": n_group,
        "topk_group": topk_group,
        "routed_scaling_factor": finite_f32("moe_router_topk_scaling_factor", scale)?,
        "norm_topk_prob": false,
        "aux_loss_alpha": finite_f32("moe_aux_loss_coeff", moe.aux_loss_coeff)?,
        "output_router_logits": moe.load_balancing_type != LoadBalancing::None,
    });
    if let Value::Object(fields) = fields {
        obj.extend(fields);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::{HfConfigInputs, hf_config_json, parse_hf_config};
    use crate::GroupScore;
    use ferrotron_tensor::DType;
    use serde_json::{Value, json};

    fn deepseek(extra: Value) -> Value {
        let mut v = json!({"architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
            "vocab_size": 100, "q_lora_rank": null, "kv_lora_rank": 8,
            "qk_nope_head_dim": 6, "qk_rope_head_dim": 4, "v_head_dim": 12,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
            "n_shared_experts": 1, "first_k_dense_replace": 1});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    }

    #[test]
    fn routing_dense_layers_and_padded_heads() {
        let v = deepseek(json!({"topk_method": "group_limited_greedy", "n_group": 4,
            "topk_group": 2, "routed_scaling_factor": 16.0}));
        let c = parse_hf_config(&v).unwrap().config;
        let mla = c.multi_latent_attention.unwrap();
        assert_eq!((mla.q_lora_rank, mla.query_head_dim()), (None, 10));
        // Values wider than q/k: core attention runs at 12, q/k padded.
        assert_eq!(c.kv_channels, 12);
        assert!(c.rotary_interleaved);
        let moe = c.moe.as_ref().unwrap();
        assert_eq!(moe.layer_pattern, vec![false, true, true]);
        assert_eq!(moe.shared_expert_intermediate_size, Some(16));
        assert!(moe.router.pre_softmax && !moe.shared_expert_gate);
        let groups = moe.router.groups.unwrap();
        assert_eq!((groups.num_groups, groups.group_topk), (4, 2));
        assert_eq!(groups.score, GroupScore::Max);
        assert_eq!(moe.router.scaling_factor, Some(16.0));
        let inputs = HfConfigInputs::default();
        let written = hf_config_json(&c, &inputs, DType::F32).unwrap();
        assert_eq!(parse_hf_config(&written).unwrap().config, c);
    }

    /// `first_k_dense_replace` at the layer count: a dense MLA model, written back as one.
    #[test]
    fn all_dense_layers_are_a_dense_model() {
        let c = parse_hf_config(&deepseek(json!({"first_k_dense_replace": 3})))
            .unwrap()
            .config;
        assert!(c.moe.is_none() && c.multi_latent_attention.is_some());
        let written = hf_config_json(&c, &HfConfigInputs::default(), DType::F32).unwrap();
        assert_eq!(written["first_k_dense_replace"], json!(3));
        assert_eq!(parse_hf_config(&written).unwrap().config, c);
    }

    #[test]
    fn unsupported_values_name_the_key() {
        let err = |extra: Value| parse_hf_config(&deepseek(extra)).unwrap_err().to_string();
        assert!(err(json!({"topk_method": "noaux_tc"})).contains("topk_method"));
        assert!(err(json!({"topk_method": "group_limited_greedy"})).contains("n_group"));
        assert!(err(json!({"moe_layer_freq": 2})).contains("moe_layer_freq"));
        assert!(err(json!({"num_key_value_heads": 2})).contains("num_key_value_heads"));
        assert!(err(json!({"qk_rope_head_dim": 3})).contains("qk_pos_emb_head_dim"));
        assert!(err(json!({"num_experts_per_tok": 9})).contains("moe_router_topk"));
        let yarn = json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}});
        assert!(err(yarn).contains("rope_parameters.factor"));
    }
}
