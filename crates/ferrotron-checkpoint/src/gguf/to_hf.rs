//! [`gguf_to_hf`]: a LLaMA-family GGUF file -> an HF model directory (`config.json`,
//! `model.safetensors`, `tokenizer.json`, `tokenizer_config.json`).
//!
//! Mirrors what transformers' `from_pretrained(.., gguf_file=..)` builds in memory
//! (`modeling_gguf_pytorch_utils.load_gguf_checkpoint` with `LlamaTensorProcessor`, and
//! `integrations/gguf/gguf_tokenizer_mapping.py`), written out as files, except that nothing is
//! silently dropped: a tensor or metadata the LLaMA mapping does not cover is an error.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::config::{LlamaGgufConfig, OutputDtype};
use super::reader::{GgufFile, tensor_err};
use super::tensors::{TensorPlan, plan_llama_tensors, unpermute_qk_rows};
use super::tokenizer::{HfTokenizerFiles, hf_tokenizer_from_gguf};
use crate::CheckpointError;
use crate::safetensors_writer::{TensorSpec, write_safetensors};
use crate::staging::{StagingDir, write_json};

/// Options of [`gguf_to_hf`].
#[derive(Debug, Clone, Default)]
pub struct GgufToHfOptions {
    /// Element type of `model.safetensors` (F32 by default, or BF16/F16 rounded to nearest even).
    pub dtype: OutputDtype,
    /// Replace an existing non-empty output directory (otherwise that is an error). An absent
    /// output or an empty directory is always accepted.
    pub force: bool,
    /// Write no tokenizer files (for GGUF files whose tokenizer is not byte-level BPE).
    pub skip_tokenizer: bool,
}

/// What [`gguf_to_hf`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufToHfReport {
    /// The output directory.
    pub output: PathBuf,
    /// Number of source tensors per ggml type name, e.g. `{"F32": 61, "Q4_1": 210, "Q8_0": 1}`.
    pub source_type_counts: BTreeMap<String, usize>,
    /// Number of tensors in `model.safetensors`.
    pub tensors_written: usize,
    /// Size of `model.safetensors` in bytes.
    pub safetensors_bytes: u64,
    /// Total bytes of all files written.
    pub bytes_written: u64,
    /// The `config.json` written.
    pub config: Value,
    /// Number of added tokens in `tokenizer.json`, or `None` when the tokenizer was skipped.
    pub added_tokens: Option<usize>,
    /// Names of the files written, in the output directory.
    pub files: Vec<String>,
}

/// Converts the LLaMA-family GGUF file `input` into an HF model directory at `output`.
///
/// Writes `config.json` (`LlamaForCausalLM`, see [`LlamaGgufConfig::to_hf_json`]),
/// `model.safetensors` (every tensor dequantized to f32 and stored as `opts.dtype`, HF names and
/// `[out, in]` shapes, q_proj/k_proj rows un-permuted, `lm_head.weight` only when the file has an
/// `output.weight`), and unless `opts.skip_tokenizer`, `tokenizer.json` and
/// `tokenizer_config.json` (see [`super::hf_tokenizer_from_gguf`]); the written tokenizer is
/// loaded back with `tokenizers` as a check. Everything is written into `.<name>.tmp-<pid>`
/// beside `output` and renamed into place at the end, so on any error no `output` appears (and
/// an existing one is untouched). Tensors are converted one at a time: memory peaks at about
/// one f32 tensor plus the mapped file.
///
/// # Errors
/// Anything [`GgufFile::open`], [`LlamaGgufConfig::from_gguf`],
/// [`super::plan_llama_tensors`] or [`super::hf_tokenizer_from_gguf`] reports, all checked
/// before anything is written; [`CheckpointError::OutputExists`] if `output` is a non-empty
/// directory and `opts.force` is false, or is not a directory; [`CheckpointError::Io`] for
/// write failures; [`CheckpointError::Tokenizer`] if the written tokenizer does not load.
pub fn gguf_to_hf(
    input: &Path,
    output: &Path,
    opts: &GgufToHfOptions,
) -> Result<GgufToHfReport, CheckpointError> {
    let f = GgufFile::open(input)?;
    let cfg = LlamaGgufConfig::from_gguf(&f)?;
    let plans = plan_llama_tensors(&f, &cfg)?;
    let tokenizer = if opts.skip_tokenizer {
        None
    } else {
        Some(hf_tokenizer_from_gguf(
            &f,
            Some(cfg.max_position_embeddings),
        )?)
    };
    let config = cfg.to_hf_json(opts.dtype);

    let stage = StagingDir::create(output, opts.force)?;
    let dir = stage.path().to_path_buf();
    let mut files = vec!["config.json".to_string()];
    let mut bytes_written = write_json(&dir, "config.json", &config)?;
    let safetensors_bytes = write_model_safetensors(&f, &plans, &dir, opts.dtype)?;
    files.push("model.safetensors".into());
    bytes_written += safetensors_bytes;
    if let Some(tok) = &tokenizer {
        bytes_written += write_tokenizer(&f, &dir, tok)?;
        files.push("tokenizer.json".into());
        files.push("tokenizer_config.json".into());
    }

    stage.commit()?;
    Ok(GgufToHfReport {
        output: output.to_path_buf(),
        source_type_counts: source_type_counts(&f),
        tensors_written: plans.len(),
        safetensors_bytes,
        bytes_written,
        config,
        added_tokens: tokenizer.map(|t| t.added_tokens),
        files,
    })
}

/// Writes `dir/model.safetensors` from `plans`, dequantizing (and un-permuting q/k rows) one
/// tensor at a time; returns its size in bytes.
fn write_model_safetensors(
    f: &GgufFile,
    plans: &[TensorPlan],
    dir: &Path,
    dtype: OutputDtype,
) -> Result<u64, CheckpointError> {
    let specs: Vec<TensorSpec> = plans
        .iter()
        .map(|p| TensorSpec {
            name: p.hf_name.clone(),
            shape: p.hf_shape.clone(),
        })
        .collect();
    let produce = |i: usize| -> Result<Vec<f32>, CheckpointError> {
        let p = &plans[i];
        let data = f.tensor_f32(&p.gguf_name)?;
        match p.unpermute_heads {
            None => Ok(data),
            Some(heads) => {
                let (rows, cols) = (p.hf_shape[0] as usize, p.hf_shape[1] as usize);
                unpermute_qk_rows(&data, rows, cols, heads as usize).ok_or_else(|| {
                    tensor_err(
                        f.file_name(),
                        &p.gguf_name,
                        format!(
                            "{rows} rows cannot be split into {heads} heads of two rotary halves"
                        ),
                    )
                })
            }
        }
    };
    let st_path = dir.join("model.safetensors");
    write_safetensors(&st_path, &specs, dtype, &[("format", "pt")], produce)
}

/// Writes `tokenizer.json` and `tokenizer_config.json` into `dir` and checks the former loads;
/// returns the bytes written.
fn write_tokenizer(
    f: &GgufFile,
    dir: &Path,
    tok: &HfTokenizerFiles,
) -> Result<u64, CheckpointError> {
    let bytes = tok.write(dir)?;
    tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).map_err(|e| {
        CheckpointError::Tokenizer {
            file: f.file_name().to_string(),
            detail: format!("the tokenizer.json built from the metadata does not load: {e}"),
        }
    })?;
    Ok(bytes)
}

/// Number of source tensors per ggml type name.
fn source_type_counts(f: &GgufFile) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for t in f.tensors() {
        *counts.entry(t.ggml_type.to_string()).or_insert(0) += 1;
    }
    counts
}
