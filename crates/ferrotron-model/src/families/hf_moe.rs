//! The MoE keys of the HF families with experts, read into a [`MoeConfig`] and written back
//! (transformers 5.23's `configuration_{mixtral,qwen2_moe,olmoe}.py`, class defaults for
//! absent keys). HF routes dropless, in f32, softmax over the experts then top-k:
//! renormalised over the k (Mixtral; `norm_topk_prob`), which is Megatron's default softmax
//! routing (softmax over the top-k logits), or not (`norm_topk_prob: false`), Megatron's
//! `moe_router_pre_softmax`.

use super::hf_config::{opt_bool, opt_f64, opt_usize};
use crate::config::field_error;
use crate::{
    LoadBalancing, ModelFamily, MoeConfig, Result, RouterConfig, ScoreFunction, TransformerConfig,
};
use serde_json::{Map, Value, json};

/// How a family's config spells its MoE settings.
struct MoeKeys {
    /// Key of the expert count and its class default.
    num_experts: (&'static str, usize),
    /// `num_experts_per_tok`'s class default.
    topk: usize,
    /// Key of the routed experts' width, and its class default (`None`: required).
    expert_ffn: (&'static str, Option<usize>),
    /// `router_aux_loss_coef`'s class default.
    aux_loss_coef: f64,
    /// `norm_topk_prob`'s default; `None`: the family has no such key and renormalises.
    norm_topk_prob: Option<bool>,
    /// The shared expert's width key and default (Qwen2-MoE).
    shared_expert: Option<(&'static str, usize)>,
}

fn keys(family: ModelFamily) -> Option<MoeKeys> {
    match family {
        ModelFamily::Mixtral => Some(MoeKeys {
            num_experts: ("num_local_experts", 8),
            topk: 2,
            expert_ffn: ("intermediate_size", None),
            aux_loss_coef: 0.001,
            norm_topk_prob: None,
            shared_expert: None,
        }),
        ModelFamily::Qwen2Moe => Some(MoeKeys {
            num_experts: ("num_experts", 60),
            topk: 4,
            expert_ffn: ("moe_intermediate_size", Some(1408)),
            aux_loss_coef: 0.001,
            norm_topk_prob: Some(false),
            shared_expert: Some(("shared_expert_intermediate_size", 5632)),
        }),
        ModelFamily::Olmoe => Some(MoeKeys {
            num_experts: ("num_experts", 64),
            topk: 8,
            expert_ffn: ("intermediate_size", None),
            aux_loss_coef: 0.01,
            norm_topk_prob: Some(false),
            shared_expert: None,
        }),
        _ => None,
    }
}

/// The MoE settings of an HF config of `family` with `num_layers` layers (`None` for a
/// family without experts). HF trains with a balancing loss only under
/// `output_router_logits` (false in the released configs): then it is Megatron's `aux_loss`
/// per layer with `router_aux_loss_coef` (HF's own sums all layers at once, which Megatron
/// does not), otherwise none (the coefficient is kept for export and for a training config
/// that turns the loss on).
///
/// # Errors
/// A key of the wrong type; router jitter (Mixtral's `router_jitter_noise`) or OLMoE's
/// `clip_qkv`, which are not supported; a Qwen2-MoE `mlp_only_layers` entry past the layers.
pub(super) fn parse_moe(
    obj: &Map<String, Value>,
    family: ModelFamily,
    num_layers: usize,
) -> Result<Option<MoeConfig>> {
    let Some(k) = keys(family) else {
        return Ok(None);
    };
    if opt_f64(obj, "router_jitter_noise")?.is_some_and(|j| j != 0.0) {
        return Err(field_error(
            "router_jitter_noise",
            "router jitter is not supported (0 only)",
        ));
    }
    if !matches!(obj.get("clip_qkv"), None | Some(Value::Null)) {
        return Err(field_error("clip_qkv", "q/k/v clipping is not supported"));
    }
    let num_experts = opt_usize(obj, k.num_experts.0)?.unwrap_or(k.num_experts.1);
    let topk = opt_usize(obj, "num_experts_per_tok")?.unwrap_or(k.topk);
    let moe_ffn_hidden_size = match k.expert_ffn {
        (key, Some(default)) => opt_usize(obj, key)?.unwrap_or(default),
        (key, None) => super::hf_config::req_usize(obj, key)?,
    };
    let renormalise = match k.norm_topk_prob {
        Some(default) => opt_bool(obj, "norm_topk_prob")?.unwrap_or(default),
        None => true,
    };
    let shared_expert_intermediate_size = match k.shared_expert {
        Some((key, default)) => Some(opt_usize(obj, key)?.unwrap_or(default)),
        None => None,
    };
    let aux = opt_f64(obj, "router_aux_loss_coef")?.unwrap_or(k.aux_loss_coef);
    let load_balancing_type = if opt_bool(obj, "output_router_logits")?.unwrap_or(false) {
        LoadBalancing::AuxLoss
    } else {
        LoadBalancing::None
    };
    Ok(Some(MoeConfig {
        router: RouterConfig {
            num_experts,
            topk,
            score_function: ScoreFunction::Softmax,
            pre_softmax: !renormalise,
            groups: None,
            scaling_factor: None,
        },
        moe_ffn_hidden_size,
        layer_pattern: layer_pattern(obj, family, num_layers)?,
        shared_expert_intermediate_size,
        shared_expert_gate: family == ModelFamily::Qwen2Moe,
        load_balancing_type,
        aux_loss_coeff: aux as f32,
        z_loss_coeff: None,
        capacity: None,
        token_dispatcher: Default::default(),
        expert_bias_update_rate: None,
    }))
}

/// Which layers are MoE: every one, or Qwen2-MoE's rule
/// `l ∉ mlp_only_layers and (l + 1) % decoder_sparse_step == 0`.
fn layer_pattern(
    obj: &Map<String, Value>,
    family: ModelFamily,
    num_layers: usize,
) -> Result<Vec<bool>> {
    if family != ModelFamily::Qwen2Moe {
        return Ok(vec![true; num_layers]);
    }
    let step = opt_usize(obj, "decoder_sparse_step")?.unwrap_or(1);
    let dense: Vec<usize> = match obj.get("mlp_only_layers") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_u64().map(|l| l as usize).filter(|&l| l < num_layers))
            .collect::<Option<_>>()
            .ok_or_else(|| {
                field_error(
                    "mlp_only_layers",
                    format!("expected layer indices below {num_layers}"),
                )
            })?,
        Some(v) => {
            return Err(field_error(
                "mlp_only_layers",
                format!("expected a list of layer indices, got {v}"),
            ));
        }
    };
    if step == 0 {
        return Err(field_error("decoder_sparse_step", "must be > 0"));
    }
    Ok((0..num_layers)
        .map(|l| !dense.contains(&l) && (l + 1) % step == 0)
        .collect())
}

/// Writes `c`'s MoE keys for its family (nothing for a family without experts).
///
/// # Errors
/// Settings the family's HF modeling code cannot run, naming the field: a routing rule
/// other than its softmax top-k (sigmoid scores, groups, a scaling factor; for Mixtral,
/// `pre_softmax`), a shared expert it does not have, a dense layer in a family whose layers
/// are all MoE. Capacity and the balancing losses are training settings: HF routes dropless
/// and keeps only `router_aux_loss_coef`.
pub(super) fn insert_moe_fields(obj: &mut Map<String, Value>, c: &TransformerConfig) -> Result<()> {
    let (Some(k), Some(moe)) = (keys(c.family), &c.moe) else {
        return Ok(());
    };
    check_expressible(c.family, &k, moe)?;
    let r = &moe.router;
    obj.insert(k.num_experts.0.into(), json!(r.num_experts));
    obj.insert("num_experts_per_tok".into(), json!(r.topk));
    obj.insert(k.expert_ffn.0.into(), json!(moe.moe_ffn_hidden_size));
    if k.norm_topk_prob.is_some() {
        obj.insert("norm_topk_prob".into(), json!(!r.pre_softmax));
    }
    if let (Some((key, _)), Some(width)) = (k.shared_expert, moe.shared_expert_intermediate_size) {
        obj.insert(key.into(), json!(width));
    }
    let coef = super::hf_export::finite_f32("moe_aux_loss_coeff", moe.aux_loss_coeff)?;
    obj.insert("router_aux_loss_coef".into(), coef);
    let balanced = moe.load_balancing_type != LoadBalancing::None;
    obj.insert("output_router_logits".into(), json!(balanced));
    if c.family == ModelFamily::Qwen2Moe {
        let dense: Vec<usize> = (0..c.num_layers)
            .filter(|&l| !moe.is_moe_layer(l))
            .collect();
        obj.insert("decoder_sparse_step".into(), json!(1));
        obj.insert("mlp_only_layers".into(), json!(dense));
    }
    Ok(())
}

fn check_expressible(family: ModelFamily, k: &MoeKeys, moe: &MoeConfig) -> Result<()> {
    let arch = family.hf_architecture();
    let bad = |field: &str, why: &str| Err(field_error(field, format!("{arch}: {why}")));
    let r = &moe.router;
    if r.score_function != ScoreFunction::Softmax || r.groups.is_some() {
        return bad("moe_router_score_function", "routes by softmax top-k only");
    }
    if r.scaling_factor.is_some_and(|s| s != 1.0) {
        return bad("moe_router_topk_scaling_factor", "has no scaling factor");
    }
    if k.norm_topk_prob.is_none() && r.pre_softmax {
        return bad(
            "moe_router_pre_softmax",
            "renormalises the top-k probabilities",
        );
    }
    if k.shared_expert.is_some() != moe.shared_expert_intermediate_size.is_some() {
        return bad(
            "moe_shared_expert_intermediate_size",
            "a shared expert is part of the family's MoE layers exactly when it has the key",
        );
    }
    if (family == ModelFamily::Qwen2Moe) != moe.shared_expert_gate {
        return bad("moe_shared_expert_gate", "the shared expert gate is fixed");
    }
    if family != ModelFamily::Qwen2Moe && moe.layer_pattern.contains(&false) {
        return bad("moe_layer_freq", "every layer is an MoE layer");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::parse_hf_config;
    use crate::LoadBalancing;
    use serde_json::{Value, json};

    fn qwen2_moe(extra: Value) -> Value {
        let mut v = json!({"architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 100, "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 24});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    }

    #[test]
    fn qwen2_moe_layers_routing_and_shared_expert() {
        let v = qwen2_moe(json!({"decoder_sparse_step": 2, "mlp_only_layers": [3]}));
        let moe = parse_hf_config(&v).unwrap().config.moe.unwrap();
        // (l + 1) % 2 == 0 -> layers 1 and 3; 3 is dense.
        assert_eq!(moe.layer_pattern, vec![false, true, false, false]);
        assert!(moe.router.pre_softmax, "norm_topk_prob defaults to false");
        assert_eq!(moe.shared_expert_intermediate_size, Some(24));
        assert!(moe.shared_expert_gate);
        assert_eq!(moe.load_balancing_type, LoadBalancing::None);
        let v = qwen2_moe(json!({"norm_topk_prob": true, "output_router_logits": true}));
        let moe = parse_hf_config(&v).unwrap().config.moe.unwrap();
        assert!(!moe.router.pre_softmax);
        assert_eq!(moe.load_balancing_type, LoadBalancing::AuxLoss);
        assert_eq!(moe.aux_loss_coeff, 0.001);
    }

    #[test]
    fn unsupported_moe_values_name_the_key() {
        let err = |extra: Value| parse_hf_config(&qwen2_moe(extra)).unwrap_err().to_string();
        assert!(err(json!({"mlp_only_layers": [4]})).contains("mlp_only_layers"));
        assert!(err(json!({"num_experts_per_tok": 9})).contains("moe_router_topk"));
        assert!(err(json!({"decoder_sparse_step": 0})).contains("decoder_sparse_step"));
        let mut v = qwen2_moe(json!({}));
        v["architectures"] = json!(["MixtralForCausalLM"]);
        v["num_local_experts"] = json!(4);
        v["router_jitter_noise"] = json!(0.1);
        let e = parse_hf_config(&v).unwrap_err().to_string();
        assert!(e.contains("router_jitter_noise"), "{e}");
        v["architectures"] = json!(["OlmoeForCausalLM"]);
        v["router_jitter_noise"] = Value::Null;
        v["clip_qkv"] = json!(8.0);
        let e = parse_hf_config(&v).unwrap_err().to_string();
        assert!(e.contains("clip_qkv"), "{e}");
    }
}
