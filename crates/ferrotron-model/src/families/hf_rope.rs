//! RoPE settings between HF `config.json` and [`TransformerConfig`]: transformers 5's
//! `rope_parameters` (`modeling_rope_utils.py`: default, linear, llama3 and yarn) read and
//! written, the 4.x `rope_theta` + `rope_scaling` read and written beside them.

use super::hf_export::finite_f32;
use crate::config::field_error;
use crate::{ModelError, Result, TransformerConfig};
use ferrotron_tensor::ops::{RopeScaling, YarnScaling};
use serde_json::{Map, Value, json};

use super::hf_config::opt_f64;

/// The rope base and scaling of an HF config: `rope_parameters` (transformers >= 5) or the
/// top-level `rope_theta` + `rope_scaling` (older files).
///
/// # Errors
/// A `rope_type` other than default, linear, llama3 or yarn, or a missing or mistyped
/// number, naming the key.
pub(super) fn rope_settings(obj: &Map<String, Value>) -> Result<(f32, RopeScaling)> {
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
        "yarn" => {
            let opt = |name: &str| -> Result<Option<f32>> {
                match p.get(name) {
                    None | Some(Value::Null) => Ok(None),
                    Some(v) => v
                        .as_f64()
                        .map(|v| Some(v as f32))
                        .ok_or_else(|| field_error(&field(name), "expected a number or null")),
                }
            };
            let truncate = match p.get("truncate") {
                None | Some(Value::Null) => true,
                Some(v) => v
                    .as_bool()
                    .ok_or_else(|| field_error(&field("truncate"), "expected a boolean"))?,
            };
            // transformers: `beta_fast or 32`, `beta_slow or 1` (0 falls back too).
            let beta = |name: &str, default: f32| {
                Ok::<f32, ModelError>(opt(name)?.filter(|b| *b != 0.0).unwrap_or(default))
            };
            RopeScaling::Yarn(YarnScaling {
                factor: num("factor")?,
                original_max_position_embeddings: num("original_max_position_embeddings")? as usize,
                beta_fast: beta("beta_fast", 32.0)?,
                beta_slow: beta("beta_slow", 1.0)?,
                mscale: opt("mscale")?,
                mscale_all_dim: opt("mscale_all_dim")?,
                attention_factor: opt("attention_factor")?,
                truncate,
            })
        }
        other => {
            return Err(field_error(
                &field("rope_type"),
                format!("`{other}` is not supported (default, linear, llama3, yarn)"),
            ));
        }
    };
    Ok((theta as f32, scaling))
}

/// transformers 5.x `rope_parameters` (`modeling_rope_utils.RopeParameters`).
pub(super) fn rope_json(c: &TransformerConfig) -> Result<Value> {
    let theta = finite_f32("rotary_base", c.rotary_base)?;
    let f = |name: &str, x: f32| finite_f32(&format!("rope_scaling.{name}"), x);
    Ok(match c.rope_scaling {
        RopeScaling::None => json!({"rope_type": "default", "rope_theta": theta}),
        RopeScaling::Linear { factor } => {
            json!({"rope_type": "linear", "rope_theta": theta, "factor": f("factor", factor)?})
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => json!({
            "rope_type": "llama3",
            "rope_theta": theta,
            "factor": f("factor", factor)?,
            "low_freq_factor": f("low_freq_factor", low_freq_factor)?,
            "high_freq_factor": f("high_freq_factor", high_freq_factor)?,
            "original_max_position_embeddings": original_max_position_embeddings,
        }),
        RopeScaling::Yarn(y) => {
            let mut rope = json!({
                "rope_type": "yarn",
                "rope_theta": theta,
                "factor": f("factor", y.factor)?,
                "original_max_position_embeddings": y.original_max_position_embeddings,
                "beta_fast": f("beta_fast", y.beta_fast)?,
                "beta_slow": f("beta_slow", y.beta_slow)?,
            });
            let optional = [
                ("mscale", y.mscale),
                ("mscale_all_dim", y.mscale_all_dim),
                ("attention_factor", y.attention_factor),
            ];
            for (name, v) in optional {
                if let Some(v) = v {
                    rope[name] = f(name, v)?;
                }
            }
            if !y.truncate {
                rope["truncate"] = json!(false);
            }
            rope
        }
    })
}

/// transformers 4.x `rope_scaling`: `null` for default rope, else the parameters without theta.
pub(super) fn legacy_rope_scaling(rope: &Value) -> Value {
    if rope["rope_type"] == "default" {
        return Value::Null;
    }
    let mut r = rope.clone();
    if let Some(o) = r.as_object_mut() {
        o.remove("rope_theta");
    }
    r
}
