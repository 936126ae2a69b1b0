//! Loading what generation and scoring need from an HF model directory.

use anyhow::{Context, Result};
use clap::ValueEnum;
use ferrotron_data::Tokenizer;
use ferrotron_data::chat::{ChatError, ChatTemplate};
use ferrotron_model::GptModel;
use ferrotron_model::families::{HfModelInfo, load_hf_model};
use ferrotron_tensor::DType;
use std::path::Path;

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
    pub fn load(dir: &Path, dtype: WeightDtype) -> Result<LoadedModel> {
        let dtype = match dtype {
            WeightDtype::F32 => DType::F32,
            WeightDtype::Bf16 => DType::BF16,
        };
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

    /// Token ids that end generation: `eos_token_id` of config.json and generation_config.json,
    /// plus the tokenizer's EOS token (e.g. `<|im_end|>` for ChatML models). An unreadable or
    /// malformed generation_config.json is an error naming it.
    pub fn stop_token_ids(&self, dir: &Path) -> Result<Vec<u32>> {
        let mut ids = self.info.eos_token_ids.clone();
        let gen_path = dir.join("generation_config.json");
        if gen_path.exists() {
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
