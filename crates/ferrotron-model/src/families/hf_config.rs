use super::hf_rope::rope_settings;
use super::schema::{Biases, KvHeads, activation_from_hf};
use crate::config::{ActivationFunc, OutputHead, field_error};
use crate::{ModelError, ModelFamily, Result, TransformerConfig};
use serde_json::{Map, Value};
use std::path::Path;

/// A parsed HF `config.json`: the model config plus the special token ids generation needs.
#[derive(Clone, Debug, PartialEq)]
pub struct HfModelInfo {
    pub config: TransformerConfig,
    /// `bos_token_id`, if set.
    pub bos_token_id: Option<u32>,
    /// `eos_token_id` (HF allows an int or a list).
    pub eos_token_ids: Vec<u32>,
}

/// Reads and parses `<dir>/config.json`; errors name the file and the field.
pub fn read_hf_config(dir: &Path) -> Result<HfModelInfo> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::ConfigFile {
        path: path.clone(),
        message: format!("cannot read: {e}"),
    })?;
    let value: Value = serde_json::from_str(&text).map_err(|e| ModelError::ConfigFile {
        path: path.clone(),
        message: format!("invalid JSON: {e}"),
    })?;
    parse_hf_config(&value).map_err(|e| ModelError::ConfigFile {
        path,
        message: e.to_string(),
    })
}

/// Maps an HF config of any supported family to a [`TransformerConfig`], following
/// transformers' `configuration_<family>.py` defaults through the family's
/// schema (`families/schema.rs`: its key names and the switches it fixes).
/// Reads RoPE settings from `rope_parameters` (transformers >= 5) or from top-level
/// `rope_theta` + `rope_scaling` (older files). Values we cannot honor (an unknown activation
/// or `rope_type`, Qwen2 sliding windows, Falcon's ALiBi or new decoder architecture, OLMo's
/// `clip_qkv`, Phi-3's partial rotary factor) are errors naming the field.
pub fn parse_hf_config(value: &Value) -> Result<HfModelInfo> {
    let obj = value
        .as_object()
        .ok_or_else(|| field_error("<root>", "expected a JSON object"))?;
    let (family, output_head) = family_of(obj)?;
    let schema = family.config_schema();
    check_family_fields(obj, family)?;
    let hidden_size = req_usize(obj, "hidden_size")?;
    let num_attention_heads = req_usize(obj, schema.num_heads)?;
    if num_attention_heads == 0 {
        return Err(field_error(schema.num_heads, "must be > 0"));
    }
    let num_query_groups = match schema.kv_heads {
        KvHeads::Key => opt_usize(obj, "num_key_value_heads")?.unwrap_or(num_attention_heads),
        KvHeads::MultiQuery if opt_bool(obj, "multi_query")?.unwrap_or(true) => 1,
        KvHeads::MultiQuery | KvHeads::PerHead => num_attention_heads,
    };
    let head_dim = if schema.head_dim {
        opt_usize(obj, "head_dim")?
    } else {
        None
    };
    let ffn_hidden_size = match schema.ffn {
        Some(key) if key == "intermediate_size" => req_usize(obj, key)?,
        Some(key) => opt_usize(obj, key)?.unwrap_or(4 * hidden_size),
        None => 4 * hidden_size,
    };
    let activation_func = activation(obj, schema.activation)?;
    let (rotary_base, rope_scaling) = rope_settings(obj)?;
    let (add_qkv_bias, add_proj_bias, add_mlp_bias) = biases(obj, schema.biases)?;
    let (eps_key, eps_default) = schema.eps;
    let layernorm_epsilon = match eps_key {
        Some(key) => opt_f64(obj, key)?.unwrap_or(eps_default),
        None => eps_default,
    } as f32;
    let mut config = TransformerConfig {
        family,
        num_layers: req_usize(obj, schema.num_layers)?,
        hidden_size,
        ffn_hidden_size,
        num_attention_heads,
        num_query_groups,
        kv_channels: head_dim.unwrap_or(hidden_size / num_attention_heads),
        vocab_size: req_usize(obj, "vocab_size")?,
        max_position_embeddings: opt_usize(obj, "max_position_embeddings")?.unwrap_or(2048),
        rotary_base,
        rope_scaling,
        rotary_interleaved: false,
        layernorm_epsilon,
        normalization: schema.switches.normalization,
        apply_layernorm_1p: false,
        qk_layernorm: false,
        post_sublayer_norm: false,
        parallel_attention_mlp: false,
        embedding_layernorm: false,
        scale_embeddings: false,
        gated_linear_unit: true,
        activation_func,
        position_embedding_type: schema.switches.position_embedding_type,
        add_qkv_bias,
        add_proj_bias,
        add_mlp_bias,
        untie_embeddings_and_output_weights: !opt_bool(obj, "tie_word_embeddings")?
            .unwrap_or(schema.tie_default),
        sliding_window: sliding_window(obj, family, schema.sliding_window)?,
        recompute_granularity: None,
        lora: None,
        output_head,
        moe: None,
        multi_latent_attention: None,
    };
    if family == ModelFamily::DeepseekV2 {
        let (mla, moe) =
            super::hf_deepseek::parse_deepseek(obj, config.num_layers, num_attention_heads)?;
        config.kv_channels = mla.attention_head_dim();
        config.rotary_interleaved = true;
        config.multi_latent_attention = Some(mla);
        config.moe = moe;
    } else {
        config.moe = super::hf_moe::parse_moe(obj, family, config.num_layers)?;
    }
    schema.switches.apply(&mut config);
    config.validate()?;
    Ok(HfModelInfo {
        config,
        bos_token_id: opt_usize(obj, "bos_token_id")?.map(|v| v as u32),
        eos_token_ids: token_ids(obj, "eos_token_id")?,
    })
}

/// The activation from `key` (or the family's fixed one).
fn activation(
    obj: &Map<String, Value>,
    (key, default): (Option<&str>, &str),
) -> Result<ActivationFunc> {
    let name = match key {
        Some(key) => opt_str(obj, key)?.unwrap_or(default),
        None => default,
    };
    activation_from_hf(name).ok_or_else(|| {
        field_error(
            key.unwrap_or("hidden_act"),
            format!("`{name}` is not supported (silu, gelu, gelu_pytorch_tanh, gelu_new)"),
        )
    })
}

/// `(add_qkv_bias, add_proj_bias, add_mlp_bias)` as the family's config turns them on.
fn biases(obj: &Map<String, Value>, biases: Biases) -> Result<(bool, bool, bool)> {
    let flag = |key: &str| Ok::<bool, ModelError>(opt_bool(obj, key)?.unwrap_or(false));
    Ok(match biases {
        Biases::AttentionAndMlp => {
            let attention = flag("attention_bias")?;
            (attention, attention, flag("mlp_bias")?)
        }
        Biases::Attention => {
            let attention = flag("attention_bias")?;
            (attention, attention, false)
        }
        Biases::Qkv => (true, false, false),
        Biases::QkvFlag(key) => (opt_bool(obj, key)?.unwrap_or(true), false, false),
        Biases::AllLinears(key) => {
            let all = flag(key)?;
            (all, all, all)
        }
        Biases::Always => (true, true, true),
        Biases::Never => (false, false, false),
    })
}

/// Family fields whose other values this skeleton does not express.
fn check_family_fields(obj: &Map<String, Value>, family: ModelFamily) -> Result<()> {
    let unsupported = |field: &str, why: &str| Err(field_error(field, why.to_string()));
    match family {
        ModelFamily::Falcon => {
            if opt_bool(obj, "alibi")?.unwrap_or(false) {
                return unsupported("alibi", "Falcon with ALiBi is not supported (rotary only)");
            }
            if opt_bool(obj, "new_decoder_architecture")?.unwrap_or(false) {
                return unsupported(
                    "new_decoder_architecture",
                    "Falcon's new decoder architecture (40B/180B) is not supported",
                );
            }
            if !opt_bool(obj, "parallel_attn")?.unwrap_or(true) {
                return unsupported("parallel_attn", "only parallel attention is supported");
            }
        }
        ModelFamily::Olmo if !matches!(obj.get("clip_qkv"), None | Some(Value::Null)) => {
            return unsupported("clip_qkv", "OLMo's q/k/v clipping is not supported");
        }
        ModelFamily::Phi3 if partial_rotary_factor(obj)?.is_some_and(|f| f != 1.0) => {
            return unsupported("partial_rotary_factor", "only 1.0 is supported");
        }
        _ => {}
    }
    Ok(())
}

/// `partial_rotary_factor`, top level or in `rope_parameters` (transformers 5).
fn partial_rotary_factor(obj: &Map<String, Value>) -> Result<Option<f64>> {
    match obj.get("rope_parameters") {
        Some(Value::Object(p)) if p.contains_key("partial_rotary_factor") => {
            opt_f64(p, "partial_rotary_factor")
        }
        _ => opt_f64(obj, "partial_rotary_factor"),
    }
}

/// The family and head of `architectures[0]`: `XForCausalLM` (a language model) or
/// `XForSequenceClassification` (a reward model's score head); by `model_type` without it.
fn family_of(obj: &Map<String, Value>) -> Result<(ModelFamily, OutputHead)> {
    let arch = obj
        .get("architectures")
        .and_then(|a| a.as_array())
        .and_then(|a| a.first())
        .and_then(|a| a.as_str());
    let known = || ModelFamily::ALL.map(|f| f.hf_architecture()).join(", ");
    match arch {
        Some(name) => ModelFamily::ALL
            .into_iter()
            .flat_map(|f| [OutputHead::LanguageModel, OutputHead::Score].map(|h| (f, h)))
            .find(|&(f, h)| f.hf_architecture_with(h) == name)
            .ok_or_else(|| {
                field_error(
                    "architectures",
                    format!(
                        "`{name}` is not supported ({}, or their ...ForSequenceClassification)",
                        known()
                    ),
                )
            }),
        None => {
            let model_type = opt_str(obj, "model_type").ok().flatten();
            ModelFamily::ALL
                .into_iter()
                .find(|f| Some(f.model_type()) == model_type)
                .map(|f| (f, OutputHead::LanguageModel))
                .ok_or_else(|| {
                    field_error(
                        "architectures",
                        format!("missing, and `model_type` names none of {}", known()),
                    )
                })
        }
    }
}

fn sliding_window(
    obj: &Map<String, Value>,
    family: ModelFamily,
    reads_window: bool,
) -> Result<Option<usize>> {
    let qwen2 = matches!(family, ModelFamily::Qwen2 | ModelFamily::Qwen2Moe);
    if qwen2 && opt_bool(obj, "use_sliding_window")?.unwrap_or(false) {
        return Err(field_error(
            "use_sliding_window",
            "Qwen2 sliding-window layers are not supported",
        ));
    }
    if reads_window {
        opt_usize(obj, "sliding_window")
    } else {
        Ok(None)
    }
}

fn token_ids(obj: &Map<String, Value>, key: &str) -> Result<Vec<u32>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_u64()
                    .map(|x| x as u32)
                    .ok_or_else(|| field_error(key, "expected integers"))
            })
            .collect(),
        Some(v) => v
            .as_u64()
            .map(|x| vec![x as u32])
            .ok_or_else(|| field_error(key, "expected an integer or a list of integers")),
    }
}

pub(super) fn req_usize(obj: &Map<String, Value>, key: &str) -> Result<usize> {
    opt_usize(obj, key)?
        .ok_or_else(|| field_error(key, "missing (expected a non-negative integer)"))
}

pub(super) fn opt_usize(obj: &Map<String, Value>, key: &str) -> Result<Option<usize>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|x| Some(x as usize))
            .ok_or_else(|| field_error(key, format!("expected a non-negative integer, got {v}"))),
    }
}

pub(super) fn opt_f64(obj: &Map<String, Value>, key: &str) -> Result<Option<f64>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| field_error(key, format!("expected a number, got {v}"))),
    }
}

pub(super) fn opt_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| field_error(key, format!("expected true or false, got {v}"))),
    }
}

pub(super) fn opt_str<'a>(obj: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_str()
            .map(Some)
            .ok_or_else(|| field_error(key, format!("expected a string, got {v}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_tensor::ops::RopeScaling;
    use serde_json::json;

    fn base() -> Value {
        json!({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "vocab_size": 100, "rms_norm_eps": 1e-5, "tie_word_embeddings": true,
               "rope_theta": 500000.0, "eos_token_id": [7, 8]})
    }

    #[test]
    fn legacy_rope_fields_and_derived_head_dim() {
        let info = parse_hf_config(&base()).unwrap();
        assert_eq!(info.config.kv_channels, 16);
        assert_eq!(info.config.rotary_base, 500000.0);
        assert!(!info.config.untie_embeddings_and_output_weights);
        assert_eq!(info.eos_token_ids, vec![7, 8]);
    }

    #[test]
    fn rope_parameters_llama3() {
        let mut v = base();
        v["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
        let c = parse_hf_config(&v).unwrap().config;
        assert_eq!(c.rotary_base, 1e4);
        assert!(matches!(
            c.rope_scaling,
            RopeScaling::Llama3 {
                original_max_position_embeddings: 64,
                ..
            }
        ));
    }

    #[test]
    fn unsupported_values_name_the_field() {
        let mut v = base();
        v["hidden_act"] = json!("relu");
        assert!(
            parse_hf_config(&v)
                .unwrap_err()
                .to_string()
                .contains("hidden_act")
        );
        let mut v = base();
        v["rope_scaling"] = json!({"rope_type": "longrope", "factor": 4.0});
        assert!(
            parse_hf_config(&v)
                .unwrap_err()
                .to_string()
                .contains("rope_scaling.rope_type")
        );
        let mut v = base();
        v["architectures"] = json!(["GPT2LMHeadModel"]);
        assert!(
            parse_hf_config(&v)
                .unwrap_err()
                .to_string()
                .contains("architectures")
        );
        let mut v = base();
        v["num_key_value_heads"] = json!(3);
        assert!(
            parse_hf_config(&v)
                .unwrap_err()
                .to_string()
                .contains("num_query_groups")
        );
        let mut v = base();
        v.as_object_mut().unwrap().remove("hidden_size");
        assert!(
            parse_hf_config(&v)
                .unwrap_err()
                .to_string()
                .contains("hidden_size")
        );
    }

    #[test]
    fn family_values_we_cannot_express_name_the_field() {
        let family = |arch: &str, extra: Value| {
            let mut v = base();
            v["architectures"] = json!([arch]);
            for (k, x) in extra.as_object().unwrap() {
                v[k] = x.clone();
            }
            parse_hf_config(&v).map(|i| i.config)
        };
        let err = |arch: &str, extra: Value| family(arch, extra).unwrap_err().to_string();
        assert!(err("FalconForCausalLM", json!({"alibi": true})).contains("alibi"));
        let e = err(
            "FalconForCausalLM",
            json!({"new_decoder_architecture": true}),
        );
        assert!(e.contains("new_decoder_architecture"), "{e}");
        assert!(err("OlmoForCausalLM", json!({"clip_qkv": 8.0})).contains("clip_qkv"));
        let e = err(
            "Phi3ForCausalLM",
            json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                       "partial_rotary_factor": 0.5}}),
        );
        assert!(e.contains("partial_rotary_factor"), "{e}");
        // Falcon's head layout comes from `multi_query`, not `num_kv_heads`.
        let c = family("FalconForCausalLM", json!({"multi_query": true})).unwrap();
        assert_eq!(c.num_query_groups, 1);
        let c = family("FalconForCausalLM", json!({"multi_query": false})).unwrap();
        assert_eq!(c.num_query_groups, c.num_attention_heads);
    }
}
