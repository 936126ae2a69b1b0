use crate::config::field_error;
use crate::{ModelError, ModelFamily, Result, TransformerConfig};
use ferrotron_tensor::ops::RopeScaling;
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

/// Maps an HF config (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM) to a
/// [`TransformerConfig`], following transformers' `configuration_{llama,mistral,qwen2}.py`
/// defaults. Reads RoPE settings from `rope_parameters` (transformers >= 5) or from top-level
/// `rope_theta` + `rope_scaling` (older files). Values we cannot honor (another activation, an
/// unknown `rope_type`, Qwen2 sliding windows) are errors naming the field.
pub fn parse_hf_config(value: &Value) -> Result<HfModelInfo> {
    let obj = value
        .as_object()
        .ok_or_else(|| field_error("<root>", "expected a JSON object"))?;
    let family = family_of(obj)?;
    let hidden_size = req_usize(obj, "hidden_size")?;
    let num_attention_heads = req_usize(obj, "num_attention_heads")?;
    if num_attention_heads == 0 {
        return Err(field_error("num_attention_heads", "must be > 0"));
    }
    let num_query_groups = opt_usize(obj, "num_key_value_heads")?.unwrap_or(num_attention_heads);
    let kv_channels = opt_usize(obj, "head_dim")?.unwrap_or(hidden_size / num_attention_heads);
    let act = opt_str(obj, "hidden_act")?.unwrap_or("silu");
    if act != "silu" {
        return Err(field_error(
            "hidden_act",
            format!("`{act}` is not supported (only silu)"),
        ));
    }
    let (rotary_base, rope_scaling) = rope_settings(obj)?;
    let attention_bias = opt_bool(obj, "attention_bias")?.unwrap_or(false);
    let (add_qkv_bias, add_proj_bias) = match family {
        ModelFamily::Qwen2 => (true, false),
        _ => (attention_bias, attention_bias),
    };
    let sliding_window = sliding_window(obj, family)?;
    let config = TransformerConfig {
        family,
        num_layers: req_usize(obj, "num_hidden_layers")?,
        hidden_size,
        ffn_hidden_size: req_usize(obj, "intermediate_size")?,
        num_attention_heads,
        num_query_groups,
        kv_channels,
        vocab_size: req_usize(obj, "vocab_size")?,
        max_position_embeddings: opt_usize(obj, "max_position_embeddings")?.unwrap_or(2048),
        rotary_base,
        rope_scaling,
        layernorm_epsilon: opt_f64(obj, "rms_norm_eps")?.unwrap_or(1e-6) as f32,
        add_qkv_bias,
        add_proj_bias,
        add_mlp_bias: opt_bool(obj, "mlp_bias")?.unwrap_or(false),
        untie_embeddings_and_output_weights: !opt_bool(obj, "tie_word_embeddings")?
            .unwrap_or(false),
        sliding_window,
        recompute_granularity: None,
    };
    config.validate()?;
    Ok(HfModelInfo {
        config,
        bos_token_id: opt_usize(obj, "bos_token_id")?.map(|v| v as u32),
        eos_token_ids: token_ids(obj, "eos_token_id")?,
    })
}

fn family_of(obj: &Map<String, Value>) -> Result<ModelFamily> {
    let arch = obj
        .get("architectures")
        .and_then(|a| a.as_array())
        .and_then(|a| a.first())
        .and_then(|a| a.as_str());
    let from_model_type = || match opt_str(obj, "model_type").ok().flatten() {
        Some("llama") => Some(ModelFamily::Llama),
        Some("mistral") => Some(ModelFamily::Mistral),
        Some("qwen2") => Some(ModelFamily::Qwen2),
        _ => None,
    };
    match arch {
        Some("LlamaForCausalLM") => Ok(ModelFamily::Llama),
        Some("MistralForCausalLM") => Ok(ModelFamily::Mistral),
        Some("Qwen2ForCausalLM") => Ok(ModelFamily::Qwen2),
        Some(other) => Err(field_error(
            "architectures",
            format!(
                "`{other}` is not supported (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)"
            ),
        )),
        None => from_model_type().ok_or_else(|| {
            field_error(
                "architectures",
                "missing, and `model_type` is not llama, mistral or qwen2",
            )
        }),
    }
}

fn rope_settings(obj: &Map<String, Value>) -> Result<(f32, RopeScaling)> {
    let (params, prefix) = match obj.get("rope_parameters") {
        Some(Value::Object(p)) => (Some(p), "rope_parameters"),
        Some(Value::Null) | None => match obj.get("rope_scaling") {
            Some(Value::Object(p)) => (Some(p), "rope_scaling"),
            Some(Value::Null) | None => (None, "rope_scaling"),
            Some(_) => return Err(field_error("rope_scaling", "expected an object or null")),
        },
        Some(_) => return Err(field_error("rope_parameters", "expected an object")),
    };
    let theta = match params.and_then(|p| p.get("rope_theta")) {
        Some(v) => v
            .as_f64()
            .ok_or_else(|| field_error("rope_parameters.rope_theta", "expected a number"))?,
        None => opt_f64(obj, "rope_theta")?.unwrap_or(10000.0),
    };
    let Some(p) = params else {
        return Ok((theta as f32, RopeScaling::None));
    };
    let field = |name: &str| format!("{prefix}.{name}");
    let kind = p
        .get("rope_type")
        .or_else(|| p.get("type"))
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    let num = |name: &str| -> Result<f32> {
        p.get(name)
            .and_then(|v| v.as_f64())
            .map(|v| v as f32)
            .ok_or_else(|| field_error(&field(name), "missing or not a number"))
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: num("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")? as usize,
        },
        other => {
            return Err(field_error(
                &field("rope_type"),
                format!("`{other}` is not supported (default, linear, llama3)"),
            ));
        }
    };
    Ok((theta as f32, scaling))
}

fn sliding_window(obj: &Map<String, Value>, family: ModelFamily) -> Result<Option<usize>> {
    match family {
        ModelFamily::Mistral => opt_usize(obj, "sliding_window"),
        ModelFamily::Qwen2 => {
            if opt_bool(obj, "use_sliding_window")?.unwrap_or(false) {
                return Err(field_error(
                    "use_sliding_window",
                    "Qwen2 sliding-window layers are not supported",
                ));
            }
            Ok(None)
        }
        ModelFamily::Llama => Ok(None),
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

fn req_usize(obj: &Map<String, Value>, key: &str) -> Result<usize> {
    opt_usize(obj, key)?
        .ok_or_else(|| field_error(key, "missing (expected a non-negative integer)"))
}

fn opt_usize(obj: &Map<String, Value>, key: &str) -> Result<Option<usize>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|x| Some(x as usize))
            .ok_or_else(|| field_error(key, format!("expected a non-negative integer, got {v}"))),
    }
}

fn opt_f64(obj: &Map<String, Value>, key: &str) -> Result<Option<f64>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| field_error(key, format!("expected a number, got {v}"))),
    }
}

fn opt_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| field_error(key, format!("expected true or false, got {v}"))),
    }
}

fn opt_str<'a>(obj: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>> {
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
        v["hidden_act"] = json!("gelu");
        assert!(
            parse_hf_config(&v)
                .unwrap_err()
                .to_string()
                .contains("hidden_act")
        );
        let mut v = base();
        v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
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
}
