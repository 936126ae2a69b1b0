//! HuggingFace PEFT LoRA adapter directories (`adapter_config.json` +
//! `adapter_model.safetensors`, as `PeftModel.save_pretrained` writes them): read one onto a
//! base model ([`PeftAdapter::apply_to`]) and write a model's adapters as one
//! ([`write_peft_adapter`]) that `peft.PeftModel.from_pretrained` loads.
//!
//! The tensor mapping (fused `linear_qkv` / `linear_fc1` adapters to per-projection ones) is
//! the model crate's ([`ferrotron_model::lora`]).

use std::collections::HashMap;
use std::path::Path;

use ferrotron_model::GptModel;
use ferrotron_model::lora::{LoraWeights, PeftTensor, peft_module_names};
use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};
use serde_json::{Value, json};

use crate::CheckpointError;
use crate::error::display_name;
use crate::gguf::OutputDtype;
use crate::hf_export::model_err;
use crate::safetensors_writer::{TensorSpec, write_safetensors};
use crate::staging::{StagingDir, write_json};

/// The adapter's config file.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// The adapter's weights file.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

/// A PEFT LoRA adapter read from its directory.
#[derive(Clone, Debug)]
pub struct PeftAdapter {
    /// `r`.
    pub rank: usize,
    /// `lora_alpha` (the adapters' outputs are scaled by `alpha / r`).
    pub alpha: f32,
    /// `base_model_name_or_path`, when given.
    pub base_model: Option<String>,
    /// The tensors of `adapter_model.safetensors` by name, widened to f32.
    pub tensors: HashMap<String, PeftTensor>,
}

/// `adapter_config.json`'s field `key`, or an error naming it.
fn field<'v>(config: &'v Value, key: &str, file: &str) -> Result<&'v Value, CheckpointError> {
    config.get(key).ok_or_else(|| CheckpointError::Metadata {
        file: file.into(),
        key: key.into(),
        detail: "missing".into(),
    })
}

impl PeftAdapter {
    /// Reads the adapter directory `dir`.
    ///
    /// # Errors
    /// A missing or malformed file; a config that is not plain LoRA (`peft_type` other than
    /// `LORA`, DoRA, rsLoRA, trained biases, `fan_in_fan_out`, per-module ranks or alphas); a
    /// tensor that is not a 2-D f32/bf16/f16 matrix. Each names the file and
    /// the key or tensor.
    pub fn read(dir: &Path) -> Result<PeftAdapter, CheckpointError> {
        let config_path = dir.join(ADAPTER_CONFIG);
        let text = std::fs::read_to_string(&config_path)
            .map_err(|e| CheckpointError::io(&config_path, e))?;
        let file = ADAPTER_CONFIG;
        let config: Value = serde_json::from_str(&text).map_err(|e| CheckpointError::Format {
            file: file.into(),
            detail: format!("not JSON: {e}"),
        })?;
        let bad = |key: &str, detail: String| CheckpointError::Metadata {
            file: file.into(),
            key: key.into(),
            detail,
        };
        let peft_type = field(&config, "peft_type", file)?;
        if peft_type != "LORA" {
            return Err(bad(
                "peft_type",
                format!("{peft_type}: only LORA adapters are read"),
            ));
        }
        let rank = field(&config, "r", file)?
            .as_u64()
            .filter(|&r| r > 0)
            .ok_or_else(|| bad("r", "must be an integer > 0".into()))? as usize;
        let alpha = field(&config, "lora_alpha", file)?
            .as_f64()
            .ok_or_else(|| bad("lora_alpha", "must be a number".into()))?
            as f32;
        let unsupported = [
            ("use_dora", json!(true)),
            ("use_rslora", json!(true)),
            ("fan_in_fan_out", json!(true)),
        ];
        for (key, value) in unsupported {
            if config.get(key) == Some(&value) {
                return Err(bad(key, "is true: only plain LoRA is supported".into()));
            }
        }
        if let Some(bias) = config.get("bias").filter(|b| *b != "none") {
            return Err(bad(
                "bias",
                format!("{bias}: only adapters without biases (\"none\")"),
            ));
        }
        for key in ["rank_pattern", "alpha_pattern"] {
            if config
                .get(key)
                .and_then(Value::as_object)
                .is_some_and(|m| !m.is_empty())
            {
                return Err(bad(
                    key,
                    "per-module ranks or alphas are not supported".into(),
                ));
            }
        }
        let base_model = config
            .get("base_model_name_or_path")
            .and_then(Value::as_str)
            .map(str::to_string);
        let tensors = read_tensors(&dir.join(ADAPTER_WEIGHTS))?;
        Ok(PeftAdapter {
            rank,
            alpha,
            base_model,
            tensors,
        })
    }

    /// `base` (a whole model without adapters) with this adapter: LoRA on exactly the
    /// linear layers the adapter has tensors for, set to its values.
    ///
    /// # Errors
    /// A fused layer with only some projections adapted, a tensor missing or of the wrong
    /// shape, projections of one fused layer with different `lora_A`, or a tensor the model
    /// has no place for (e.g. an adapter on `lm_head`), each named.
    pub fn apply_to(&self, base: GptModel) -> Result<GptModel, CheckpointError> {
        self.apply_to_with_dropout(base, 0.0)
    }

    /// [`PeftAdapter::apply_to`] for training on: the adapters' input dropout `dropout`
    /// (the run's `lora.dropout`; the adapter's own `lora_dropout` is not read).
    ///
    /// # Errors
    /// As [`PeftAdapter::apply_to`], or a dropout outside `[0, 1)`.
    pub fn apply_to_with_dropout(
        &self,
        base: GptModel,
        dropout: f32,
    ) -> Result<GptModel, CheckpointError> {
        let lora = ferrotron_model::LoraConfig {
            dropout,
            ..self.lora_config(&base)?
        };
        let init = ferrotron_model::InitConfig {
            params_dtype: base.dtype(),
            ..Default::default()
        };
        let mut model = base.with_lora(lora, &init).map_err(|e| model_err(&e))?;
        self.map_tensors(|get| model.load_peft_tensors(get))?;
        Ok(model)
    }

    /// The adapter's matrices for serving beside others over `base` (a whole model without
    /// adapters, left as it is): any projections, each with its own `lora_A` as PEFT trains
    /// them ([`GptModel::lora_weights_from_peft`]).
    ///
    /// # Errors
    /// A tensor missing or of the wrong shape, or one the model has no place for (each
    /// named), or an adapter that adapts nothing.
    pub fn served_weights(&self, base: &GptModel) -> Result<LoraWeights, CheckpointError> {
        self.map_tensors(|get| base.lora_weights_from_peft(self.rank, self.alpha, get))
    }

    /// The [`ferrotron_model::LoraConfig`] that adapts exactly the modules this adapter has
    /// tensors for, in `base`.
    fn lora_config(&self, base: &GptModel) -> Result<ferrotron_model::LoraConfig, CheckpointError> {
        let adapted = |module: &str| {
            ["lora_A", "lora_B"].iter().any(|m| {
                self.tensors
                    .contains_key(&format!("base_model.model.{module}.{m}.weight"))
            })
        };
        base.peft_lora_config(self.rank, self.alpha, adapted)
            .map_err(|e| model_err(&e))
    }

    /// Runs `map` over a lookup of the adapter's tensors, then checks that it used them all.
    ///
    /// # Errors
    /// `map`'s error (naming the file), or a tensor the model has no place for.
    fn map_tensors<T>(
        &self,
        map: impl FnOnce(&mut dyn FnMut(&str) -> Option<PeftTensor>) -> ferrotron_model::Result<T>,
    ) -> Result<T, CheckpointError> {
        let file = ADAPTER_WEIGHTS;
        let mut used = std::collections::HashSet::new();
        let out = map(&mut |name: &str| {
            used.insert(name.to_string());
            self.tensors.get(name).cloned()
        })
        .map_err(|e| CheckpointError::Format {
            file: file.into(),
            detail: e.to_string(),
        })?;
        let mut unused: Vec<&String> = self.tensors.keys().filter(|k| !used.contains(*k)).collect();
        unused.sort();
        if let Some(name) = unused.first() {
            return Err(CheckpointError::Tensor {
                file: file.into(),
                tensor: (*name).clone(),
                detail: "the model has no LoRA adapter for it (only linear layers of the decoder \
                         layers take one)"
                    .into(),
            });
        }
        Ok(out)
    }
}

/// Every tensor of the safetensors file `path`, widened to f32.
fn read_tensors(path: &Path) -> Result<HashMap<String, PeftTensor>, CheckpointError> {
    let file = display_name(path);
    let bytes = std::fs::read(path).map_err(|e| CheckpointError::io(path, e))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| CheckpointError::Format {
        file: file.clone(),
        detail: format!("not a safetensors file: {e}"),
    })?;
    let mut out = HashMap::new();
    for (name, view) in st.tensors() {
        let bad = |detail: String| CheckpointError::Tensor {
            file: file.clone(),
            tensor: name.clone(),
            detail,
        };
        let shape = view.shape();
        if shape.len() != 2 {
            return Err(bad(format!("shape {shape:?}: a LoRA matrix is 2-D")));
        }
        let data = view.data();
        let values: Vec<f32> = match view.dtype() {
            Dtype::F32 => data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::BF16 => data
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::F16 => data
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => return Err(bad(format!("dtype {other:?}: expected F32, BF16 or F16"))),
        };
        let tensor = PeftTensor {
            name: name.clone(),
            shape: [shape[0], shape[1]],
            values,
        };
        out.insert(name, tensor);
    }
    Ok(out)
}

/// Writes `model`'s adapters (a whole model with LoRA) as a PEFT adapter directory `dir`
/// (staged, then renamed into place; an existing non-empty `dir` needs `force`):
/// `adapter_config.json` (`r`, `lora_alpha`, `target_modules` as full HF module names,
/// `base_model_name_or_path` = `base_model`, task `CAUSAL_LM`) and
/// `adapter_model.safetensors` (f32). Returns the weights file's size in bytes.
///
/// # Errors
/// A shard or stage, a model without adapters, or an I/O failure (the output is left as
/// it was).
pub fn write_peft_adapter(
    model: &GptModel,
    dir: &Path,
    base_model: &str,
    force: bool,
) -> Result<u64, CheckpointError> {
    let lora = model
        .config()
        .lora
        .clone()
        .ok_or_else(|| CheckpointError::Format {
            file: dir.display().to_string(),
            detail: "the model has no LoRA adapters to write".into(),
        })?;
    let tensors = model.peft_tensors().map_err(|e| model_err(&e))?;
    let staging = StagingDir::create(dir, force)?;
    let config = json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": peft_module_names(model),
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "use_dora": false,
        "use_rslora": false,
        "modules_to_save": null,
    });
    write_json(staging.path(), ADAPTER_CONFIG, &config)?;
    let specs: Vec<TensorSpec> = tensors
        .iter()
        .map(|t| TensorSpec {
            name: t.name.clone(),
            shape: t.shape.iter().map(|&d| d as u64).collect(),
        })
        .collect();
    let path = staging.path().join(ADAPTER_WEIGHTS);
    let metadata = [("format", "pt")];
    let size = write_safetensors(&path, &specs, OutputDtype::F32, &metadata, |i| {
        Ok(tensors[i].values.clone())
    })?;
    staging.commit()?;
    Ok(size)
}
