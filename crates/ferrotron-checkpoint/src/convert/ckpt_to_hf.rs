//! A distributed checkpoint (any layout, converted or saved by training) -> an HF model
//! directory (Pai-Megatron-Patch `mcore2hf`): every HF tensor is read as the row boxes of its
//! Megatron parameter (`q_proj` from each query group's rows of `linear_qkv`, `gate_proj` /
//! `up_proj` from `linear_fc1`), assembled from whichever shards hold them, and written one
//! at a time.

use std::path::Path;

use ferrotron_model::families::{HfConfigInputs, hf_config_json, param_mapping, parse_hf_config};

use super::{MODEL_PREFIX, TOKENIZER_SUBDIR, stored_hf_config};
use crate::CheckpointError;
use crate::dist::{CheckpointReader, METADATA_FILE, locate_checkpoint};
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
    let dir = locate_checkpoint(ckpt)?.ok_or_else(|| {
        err(
            ckpt,
            format!(
                "no {METADATA_FILE} and no latest_checkpointed_iteration.txt: not a checkpoint"
            ),
        )
    })?;
    let reader = CheckpointReader::open(&dir)?;
    let content = &reader.metadata().content;
    let meta_path = dir.join(METADATA_FILE);
    let hf_config = stored_hf_config(content).ok_or_else(|| {
        err(
            &meta_path,
            "content holds no hf_config (the model's config.json), so the HF config cannot be written",
        )
    })?;
    let config = parse_hf_config(hf_config)
        .map_err(|e| err(&meta_path, format!("hf_config: {e}")))?
        .config;
    let mapping = param_mapping(&config, config.vocab_size).map_err(|e| model_err(&e))?;
    let expected: Vec<(String, Vec<usize>)> = mapping
        .iter()
        .map(|m| (format!("{MODEL_PREFIX}{}", m.name), m.shape.clone()))
        .collect();
    reader.check_tensors(MODEL_PREFIX, &expected)?;
    let inputs = HfConfigInputs::from_original(hf_config.clone()).map_err(|e| model_err(&e))?;
    let config_json =
        hf_config_json(&config, &inputs, torch_dtype(opts.dtype)).map_err(|e| model_err(&e))?;
    let generation_config = content
        .get("generation_config")
        .or_else(|| {
            content
                .get("extra")
                .and_then(|e| e.get("generation_config"))
        })
        .filter(|v| !v.is_null());
    // (HF name, shape) in order, and for each the Megatron key, its shape and row ranges.
    let mut tensors = Vec::new();
    let mut sources = Vec::new();
    for m in &mapping {
        for part in &m.hf {
            tensors.push((part.name.clone(), part.shape.clone()));
            sources.push((m, part.rows.clone()));
        }
    }
    let produce = |j: usize| -> Result<Vec<f32>, CheckpointError> {
        let (m, rows) = &sources[j];
        let key = format!("{MODEL_PREFIX}{}", m.name);
        let read_rows = |r: &std::ops::Range<usize>| {
            let mut offset = vec![0; m.shape.len()];
            let mut shape = m.shape.clone();
            offset[0] = r.start;
            shape[0] = r.len();
            reader.read_box(&key, &offset, &shape)
        };
        if let [r] = rows.as_slice() {
            return read_rows(r);
        }
        let mut values = Vec::with_capacity(tensors[j].1.iter().product());
        for r in rows {
            values.extend(read_rows(r)?);
        }
        Ok(values)
    };
    let mut opts = opts.clone();
    if opts.tokenizer_dir.is_none() && dir.join(TOKENIZER_SUBDIR).is_dir() {
        opts.tokenizer_dir = Some(dir.join(TOKENIZER_SUBDIR));
    }
    let contents = HfDirContents {
        config: &config_json,
        generation_config,
        tensors: &tensors,
    };
    write_hf_dir(&contents, produce, output, &opts)
}
