//! HuggingFace model families: `config.json` -> [`crate::TransformerConfig`] and HF weight
//! names -> the Megatron-layout parameters of [`crate::GptModel`], and back
//! ([`hf_config_json`], [`hf_tensors`]) for exporting.

mod hf_config;
mod hf_deepseek;
mod hf_export;
mod hf_moe;
mod hf_rope;
mod hf_safetensors;
mod hf_weights;
mod mapping;
mod names;
mod schema;

pub use crate::module::{HfPart, ParamDecl};
pub use hf_config::{HfModelInfo, parse_hf_config, read_hf_config};
pub use hf_export::{HfConfigInputs, HfTensor, hf_config_json, hf_tensors};
pub use hf_safetensors::{HfSafetensors, load_hf_model, release_pages};
pub use hf_weights::{WeightSource, gpt_model_from_hf};
pub use mapping::param_mapping;
pub use names::{HfFc1, HfMla, HfMoe, HfNames, HfQkv};
