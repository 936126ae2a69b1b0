//! A distributed checkpoint (any layout, converted or saved by training) -> an HF model
//! directory (Pai-Megatron-Patch `mcore2hf`): every HF tensor is read as the row boxes of its
//! Megatron parameter (`q_proj` from each query group's rows of `linear_qkv`, `gate_proj` /
//! `up_proj` from `linear_fc1`), assembled from whichever shards hold them, and written one
//! at a time.

use std::path::Path;

use ferrotron_model::families::{HfConfigInputs, hf_config_json};

use super::CheckpointWeights;
use crate::CheckpointError;
use crate::hf_export::{
    HfDirContents, HfExportOptions, HfExportReport, check_shard_size, model_err, torch_dtype,
    write_hf_dir,
};

fn err(path: &Path, detail: impl Into<String>) -> CheckpointError {
    CheckpointError::Format {
        file: path.display().to_string(),
        detail: detail.into(),
    }
}

/// Writes the model of checkpoint `ckpt` (an iteration directory, or a `save` directory
/// whose tracker names one) as the HF directory `output`: `config.json` (the stored HF
/// config with `torch_dtype` set to `opts.dtype`), `generation_config.json` when stored,
/// safetensors sharded by `opts.max_shard_size` with an index, and the tokenizer files of
/// `opts.tokenizer_dir` or else of the checkpoint's `tokenizer/` directory. Vocabulary
/// padding is never stored, so there is none to strip. Staged and renamed at the end.
/// Memory: one HF tensor plus the pages of the shards being read.
///
/// # Errors
/// No checkpoint at `ckpt`; a checkpoint without an HF config in its metadata; model
/// tensors missing, extra or misshapen against that config (all listed); an existing
/// non-empty `output` without `opts.force`; I/O failures.
pub fn ckpt_to_hf(
    ckpt: &Path,
    output: &Path,
    opts: &HfExportOptions,
) -> Result<HfExportReport, CheckpointError> {
    check_shard_size(opts)?;
    let weights = CheckpointWeights::open(ckpt, ferrotron_tensor::DType::F32)?;
    let inputs =
        HfConfigInputs::from_original(weights.hf_config().clone()).map_err(|e| model_err(&e))?;
    let config_json = hf_config_json(&weights.info().config, &inputs, torch_dtype(opts.dtype))
        .map_err(|e| model_err(&e))?;
    let tensors = weights.hf_tensors();
    let produce = |j: usize| -> Result<Vec<f32>, CheckpointError> {
        let name = &tensors[j].0;
        weights
            .read_hf(name)?
            .ok_or_else(|| err(weights.dir(), format!("no tensor {name}")))
    };
    let mut opts = opts.clone();
    if opts.tokenizer_dir.is_none() {
        opts.tokenizer_dir = weights.tokenizer_dir();
    }
    let contents = HfDirContents {
        config: &config_json,
        generation_config: weights.generation_config(),
        tensors: &tensors,
    };
    write_hf_dir(&contents, produce, output, &opts)
}
