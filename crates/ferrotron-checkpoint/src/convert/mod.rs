//! Conversion between HF model directories and distributed checkpoints
//! (Pai-Megatron-Patch's `hf2mcore` / `mcore2hf`), both streaming tensor by tensor:
//!
//! - [`hf_to_ckpt`] (with [`plan_hf_to_ckpt`] for a dry run): an HF directory -> a
//!   checkpoint laid out for any tensor x pipeline-parallel size, exactly as a training run
//!   under that layout saves it;
//! - [`ckpt_to_hf`]: any checkpoint (converted or saved by training, any layout) -> an HF
//!   directory transformers loads;
//! - [`reshard_ckpt`] (with [`plan_reshard`]): any checkpoint -> its weights laid out for
//!   another tensor x pipeline-parallel size.
//!
//! HF -> checkpoint -> HF is bit-exact at any layout (f32 storage, or bf16 from bf16).

mod assemble;
mod ckpt_to_hf;
mod hf_to_ckpt;
mod reshard;
mod weights;

pub use ckpt_to_hf::ckpt_to_hf;
pub use hf_to_ckpt::{
    HfToCkptOptions, HfToCkptPlan, PlannedParam, PlannedShard, hf_to_ckpt, plan_hf_to_ckpt,
};
pub use reshard::{plan_reshard, reshard_ckpt};
pub use weights::CheckpointWeights;

use serde_json::Value;
use std::path::PathBuf;

/// Key prefix of model weights in a checkpoint (`model.<Megatron name>`).
pub const MODEL_PREFIX: &str = "model.";

/// Directory inside an iteration directory holding the tokenizer files.
pub const TOKENIZER_SUBDIR: &str = "tokenizer";

/// File of tensor-parallel rank `tp` of pipeline stage `pp`'s model shards.
pub fn model_file(tp: usize, pp: usize) -> String {
    format!("model_tp{tp:02}_pp{pp:03}.safetensors")
}

/// File of the model shard of tensor-parallel rank `tp`, stage `pp`, expert-parallel rank
/// `ep`: [`model_file`] for `ep` 0 (which also holds every non-expert parameter), else
/// `model_tp{tp}_pp{pp}_ep{ep}.safetensors` with that rank's experts.
pub fn expert_model_file(tp: usize, pp: usize, ep: usize) -> String {
    match ep {
        0 => model_file(tp, pp),
        e => format!("model_tp{tp:02}_pp{pp:03}_ep{e}.safetensors"),
    }
}

/// File of the optimizer shard of tensor-parallel rank `tp`, stage `pp`, data-parallel
/// rank `dp`.
pub fn optim_file(tp: usize, pp: usize, dp: usize) -> String {
    format!("optim_tp{tp:02}_pp{pp:03}_dp{dp:03}.safetensors")
}

/// The HF `config.json` a checkpoint's metadata `content` holds: `hf_config` (converted)
/// or `extra.hf_config` (saved by `ferrotron train`).
pub fn stored_hf_config(content: &Value) -> Option<&Value> {
    content
        .get("hf_config")
        .or_else(|| content.get("extra").and_then(|e| e.get("hf_config")))
        .filter(|v| v.is_object())
}

/// What a conversion wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct ConvertReport {
    /// The output directory.
    pub output: PathBuf,
    /// Parameters converted.
    pub tensors: usize,
    /// Shard files written (in the iteration directory).
    pub files: Vec<String>,
    /// Bytes written.
    pub bytes_written: u64,
    /// Wall time in seconds.
    pub seconds: f64,
}
