//! Loading what generation, scoring and serving need from an HF model directory or a GGUF
//! file (whose quantized weights stay quantized).

use anyhow::{Context, Result};
use clap::ValueEnum;
use ferrotron_checkpoint::gguf::load_gguf_model;
use ferrotron_data::Tokenizer;
use ferrotron_data::chat::{ChatError, ChatTemplate};
use ferrotron_model::GptModel;
use ferrotron_model::families::{HfModelInfo, load_hf_model};
use ferrotron_tensor::DType;
use std::path::Path;

/// Whether `path` names a GGUF file (by its `.gguf` extension) rather than a model directory.
pub fn is_gguf(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        && !path.is_dir()
}

/// Storage type of the weights in memory. bf16 weights multiply as bf16 x bf16 -> f32 (the
/// activations rounded to bf16) in the GEMMs of prompts and the GEMVs of decode alike.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum WeightDtype {
    /// 32-bit floats: exact, twice the memory traffic of bf16.
    F32,
    /// bfloat16: half the bytes per weight; faster memory-bound decoding.
    Bf16,
}

/// A model, its tokenizer and its generation-relevant metadata.
pub struct LoadedModel {
    pub model: GptModel,
    pub info: HfModelInfo,
    pub tokenizer: Tokenizer,
    /// `tokenizer_config.json`'s chat template and special tokens, when it has a template.
    pub chat_template: Option<ChatTemplate>,
}

impl LoadedModel {
    /// Loads the HF model directory or `.gguf` file `path`; `dtype` stores the weights that
    /// are not quantized.
    pub fn load(path: &Path, dtype: WeightDtype) -> Result<LoadedModel> {
        let dtype = match dtype {
            WeightDtype::F32 => DType::F32,
            WeightDtype::Bf16 => DType::BF16,
        };
        if is_gguf(path) {
            return Self::load_gguf(path, dtype);
        }
        let dir = path;
        let (model, info) = load_hf_model(dir, dtype)
            .with_context(|| format!("loading model from {}", dir.display()))?;
        let tokenizer = Tokenizer::from_dir(dir)?;
        let tc = dir.join("tokenizer_config.json");
        // A config without a chat template (a base model) is fine; a broken one is an error.
        let chat_template = if tc.exists() {
            match ChatTemplate::from_tokenizer_config(&tc) {
                Ok(t) => Some(t),
                Err(ChatError::Config {
                    field: "chat_template",
                    problem,
                    ..
                }) if problem.starts_with("is missing") => None,
                Err(e) => return Err(e.into()),
            }
        } else {
            None
        };
        Ok(LoadedModel {
            model,
            info,
            tokenizer,
            chat_template,
        })
    }

    /// A GGUF file: the model with its quantized weights kept in their blocks, the tokenizer
    /// and chat template its metadata describes.
    fn load_gguf(path: &Path, dtype: DType) -> Result<LoadedModel> {
        let loaded = load_gguf_model(path, dtype)
            .with_context(|| format!("loading model from {}", path.display()))?;
        let tokenizer_json = serde_json::to_string(&loaded.tokenizer.tokenizer_json)?;
        let tokenizer = Tokenizer::from_json(&tokenizer_json, path)?;
        let config = &loaded.tokenizer.tokenizer_config;
        let chat_template = match config.get("chat_template") {
            None | Some(serde_json::Value::Null) => None,
            Some(_) => Some(ChatTemplate::from_tokenizer_config_json(config, path)?),
        };
        Ok(LoadedModel {
            model: loaded.model,
            info: loaded.info,
            tokenizer,
            chat_template,
        })
    }

    /// Token ids that end generation: `eos_token_id` of config.json (a GGUF file's
    /// `tokenizer.ggml.eos_token_id`) and of generation_config.json in a model directory, plus
    /// the tokenizer's EOS token (e.g. `<|im_end|>` for ChatML models). An unreadable or
    /// malformed generation_config.json is an error naming it.
    pub fn stop_token_ids(&self, path: &Path) -> Result<Vec<u32>> {
        let mut ids = self.info.eos_token_ids.clone();
        let gen_path = path.join("generation_config.json");
        if path.is_dir() && gen_path.exists() {
            let text = std::fs::read_to_string(&gen_path)
                .with_context(|| format!("{}: cannot read", gen_path.display()))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{}: invalid JSON", gen_path.display()))?;
            let bad = || {
                format!(
                    "{}: eos_token_id must be an integer or a list of integers",
                    gen_path.display()
                )
            };
            match v.get("eos_token_id") {
                None | Some(serde_json::Value::Null) => {}
                Some(serde_json::Value::Array(a)) => {
                    for x in a {
                        ids.push(x.as_u64().with_context(bad)? as u32);
                    }
                }
                Some(x) => ids.push(x.as_u64().with_context(bad)? as u32),
            }
        }
        if let Some(eos) = self.chat_template.as_ref().and_then(|t| t.eos_token()) {
            ids.extend(self.tokenizer.token_to_id(eos));
        }
        ids.sort_unstable();
        ids.dedup();
        Ok(ids)
    }
}
