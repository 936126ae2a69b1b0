//! [`export_hf`]: a [`GptModel`] -> an HF model directory that transformers'
//! `AutoModelForCausalLM.from_pretrained` loads: `config.json`, `generation_config.json` (when
//! the source had one), `model.safetensors` or `model-0000i-of-0000n.safetensors` shards with
//! `model.safetensors.index.json` (transformers' `save_pretrained` layout and sharding rule),
//! and the tokenizer files of a source directory.

use std::fs;
use std::path::{Path, PathBuf};

use ferrotron_model::families::{HfConfigInputs, hf_config_json, hf_tensors};
use ferrotron_model::{GptModel, ModelError};
use ferrotron_tensor::DType;
use serde_json::{Map, Value, json};

use crate::CheckpointError;
use crate::error::display_name;
use crate::gguf::OutputDtype;
use crate::safetensors_writer::{TensorSpec, write_safetensors};
use crate::staging::{StagingDir, write_json};

/// transformers' default `max_shard_size` for `save_pretrained` (5.x: `"50GB"`, decimal).
pub const DEFAULT_MAX_SHARD_SIZE: u64 = 50_000_000_000;

/// Tokenizer files copied from [`HfExportOptions::tokenizer_dir`] when present (what
/// transformers' `save_pretrained` of a fast or slow tokenizer writes).
pub const TOKENIZER_FILES: [&str; 9] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
];

/// Options of [`export_hf`].
#[derive(Debug, Clone)]
pub struct HfExportOptions {
    /// Element type of the safetensors files (and `torch_dtype` in `config.json`); bf16/f16 are
    /// rounded to nearest even from the model's f32 values.
    pub dtype: OutputDtype,
    /// Largest shard in bytes of tensor data: above it the weights are split into
    /// `model-0000i-of-0000n.safetensors` files. A tensor larger than this gets a shard of its
    /// own. Must be > 0.
    pub max_shard_size: u64,
    /// Replace an existing non-empty output directory (otherwise that is an error). An absent
    /// output or an empty directory is always accepted.
    pub force: bool,
    /// Directory to copy the tokenizer files ([`TOKENIZER_FILES`]) from, usually the HF
    /// directory the model was loaded from; `None` writes no tokenizer.
    pub tokenizer_dir: Option<PathBuf>,
}

impl Default for HfExportOptions {
    fn default() -> Self {
        HfExportOptions {
            dtype: OutputDtype::F32,
            max_shard_size: DEFAULT_MAX_SHARD_SIZE,
            force: false,
            tokenizer_dir: None,
        }
    }
}

/// The JSON inputs of an export besides the model: what `config.json` is built from and the
/// `generation_config.json` to write, if any.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HfExportSource {
    /// Token ids and the original `config.json` (see [`HfConfigInputs`]).
    pub config: HfConfigInputs,
    /// Written verbatim as `generation_config.json` when `Some`.
    pub generation_config: Option<Value>,
}

impl HfExportSource {
    /// Reads `<dir>/config.json` (kept as the original, see [`HfConfigInputs::from_original`])
    /// and `<dir>/generation_config.json` if present.
    ///
    /// # Errors
    /// An unreadable file, invalid JSON, or a `config.json` that does not parse, naming the file.
    pub fn from_dir(dir: &Path) -> Result<HfExportSource, CheckpointError> {
        let config_path = dir.join("config.json");
        let original = read_json(&config_path)?;
        let config = HfConfigInputs::from_original(original).map_err(|e| model_err(&e))?;
        let gen_path = dir.join("generation_config.json");
        let generation_config = if gen_path.exists() {
            Some(read_json(&gen_path)?)
        } else {
            None
        };
        Ok(HfExportSource {
            config,
            generation_config,
        })
    }
}

/// What [`export_hf`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct HfExportReport {
    /// The output directory.
    pub output: PathBuf,
    /// The `config.json` written.
    pub config: Value,
    /// Number of tensors written.
    pub tensors_written: usize,
    /// Number of safetensors files (1 means `model.safetensors`, no index).
    pub shards: usize,
    /// Bytes of tensor data (the index's `total_size`).
    pub tensor_bytes: u64,
    /// Total bytes of all files written.
    pub bytes_written: u64,
    /// Names of the files written, in the output directory.
    pub files: Vec<String>,
}

/// Writes `model` as an HF model directory at `output`.
///
/// `config.json` comes from [`hf_config_json`] with `source.config` and `opts.dtype`; the
/// tensors from [`hf_tensors`] (q/k/v and gate/up unpacked from Megatron's fused layouts), each
/// computed, converted and written one at a time (memory: one tensor). Shards follow
/// huggingface_hub's `split_torch_state_dict_into_shards` in tensor order: a shard is closed
/// when the next tensor would take it past `opts.max_shard_size`. Everything is written into
/// `.<name>.tmp-<pid>` beside `output` and renamed into place at the end, so on any error no
/// `output` appears and an existing one is untouched.
///
/// # Errors
/// [`CheckpointError::Metadata`] (file `config.json`) for a config the family cannot express or
/// `max_shard_size` 0; [`CheckpointError::Format`] (file `model`) for a model parameter of the
/// wrong shape, naming it;
/// [`CheckpointError::OutputExists`] if `output` is a non-empty directory and `opts.force` is
/// false, or is not a directory; [`CheckpointError::Io`] for read/write failures, including a
/// `tokenizer_dir` holding none of [`TOKENIZER_FILES`].
pub fn export_hf(
    model: &GptModel,
    source: &HfExportSource,
    output: &Path,
    opts: &HfExportOptions,
) -> Result<HfExportReport, CheckpointError> {
    check_shard_size(opts)?;
    let config = hf_config_json(model.config(), &source.config, torch_dtype(opts.dtype))
        .map_err(|e| model_err(&e))?;
    let tensors = hf_tensors(model).map_err(|e| model_err(&e))?;
    let specs: Vec<(String, Vec<usize>)> = tensors
        .iter()
        .map(|t| (t.name.clone(), t.shape.clone()))
        .collect();
    let out = HfDirContents {
        config: &config,
        generation_config: source.generation_config.as_ref(),
        tensors: &specs,
    };
    write_hf_dir(&out, |j| Ok(tensors[j].values()), output, opts)
}

/// Rejects a zero `max_shard_size`.
pub(crate) fn check_shard_size(opts: &HfExportOptions) -> Result<(), CheckpointError> {
    if opts.max_shard_size == 0 {
        return Err(CheckpointError::Metadata {
            file: "export options".into(),
            key: "max_shard_size".into(),
            detail: "must be > 0 bytes".into(),
        });
    }
    Ok(())
}

/// What an HF directory holds besides the tensor values.
pub(crate) struct HfDirContents<'a> {
    /// `config.json`.
    pub config: &'a Value,
    /// `generation_config.json`, written when `Some`.
    pub generation_config: Option<&'a Value>,
    /// Every tensor's HF name and shape, in file order.
    pub tensors: &'a [(String, Vec<usize>)],
}

/// Writes an HF model directory at `output` (staged, renamed at the end): `config.json`,
/// `generation_config.json`, the tensors (`produce(j)` gives tensor `j`'s f32 values, called
/// once each in order, so memory is one tensor) in `model.safetensors` or shards with an
/// index, and the tokenizer files of `opts.tokenizer_dir`.
pub(crate) fn write_hf_dir(
    contents: &HfDirContents<'_>,
    produce: impl FnMut(usize) -> Result<Vec<f32>, CheckpointError>,
    output: &Path,
    opts: &HfExportOptions,
) -> Result<HfExportReport, CheckpointError> {
    let tensors = contents.tensors;
    let tokenizer_files = match &opts.tokenizer_dir {
        Some(dir) => tokenizer_files_in(dir)?,
        None => vec![],
    };

    let stage = StagingDir::create(output, opts.force)?;
    let dir = stage.path().to_path_buf();
    let mut files = vec!["config.json".to_string()];
    let mut bytes_written = write_json(&dir, "config.json", contents.config)?;
    if let Some(gen_config) = contents.generation_config {
        bytes_written += write_json(&dir, "generation_config.json", gen_config)?;
        files.push("generation_config.json".into());
    }

    let weights = write_weights(tensors, produce, &dir, opts, &mut files)?;
    bytes_written += weights.bytes_written;
    for src in &tokenizer_files {
        let name = display_name(src);
        let dst = dir.join(&name);
        bytes_written += fs::copy(src, &dst).map_err(|e| CheckpointError::io(src, e))?;
        files.push(name);
    }

    stage.commit()?;
    Ok(HfExportReport {
        output: output.to_path_buf(),
        config: contents.config.clone(),
        tensors_written: tensors.len(),
        shards: weights.shards,
        tensor_bytes: weights.tensor_bytes,
        bytes_written,
        files,
    })
}

/// What [`write_weights`] wrote.
struct WrittenWeights {
    /// Number of safetensors files.
    shards: usize,
    /// Bytes of tensor data (at the output dtype).
    tensor_bytes: u64,
    /// Bytes of all files written (shards and index).
    bytes_written: u64,
}

/// Writes `tensors` into `dir` as `model.safetensors`, or as shards of at most
/// `opts.max_shard_size` bytes with `model.safetensors.index.json`, adding the file names to
/// `files`.
fn write_weights(
    tensors: &[(String, Vec<usize>)],
    mut produce: impl FnMut(usize) -> Result<Vec<f32>, CheckpointError>,
    dir: &Path,
    opts: &HfExportOptions,
    files: &mut Vec<String>,
) -> Result<WrittenWeights, CheckpointError> {
    let elem = opts.dtype.size();
    let numel = |t: &(String, Vec<usize>)| t.1.iter().product::<usize>();
    let bytes_of = |t: &(String, Vec<usize>)| numel(t) as u64 * elem;
    let shards = shard_ranges(tensors, opts.max_shard_size, bytes_of);
    let n = shards.len();
    let mut bytes_written = 0u64;
    let mut weight_map = Map::new();
    for (i, range) in shards.iter().enumerate() {
        let name = if n == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{n:05}.safetensors", i + 1)
        };
        let part = &tensors[range.clone()];
        let specs: Vec<TensorSpec> = part
            .iter()
            .map(|(name, shape)| TensorSpec {
                name: name.clone(),
                shape: shape.iter().map(|&d| d as u64).collect(),
            })
            .collect();
        let first = range.start;
        bytes_written += write_safetensors(
            &dir.join(&name),
            &specs,
            opts.dtype,
            &[("format", "pt")],
            |j| produce(first + j),
        )?;
        for (tensor, _) in part {
            weight_map.insert(tensor.clone(), json!(name));
        }
        files.push(name);
    }
    let tensor_bytes: u64 = tensors.iter().map(bytes_of).sum();
    if n > 1 {
        let total_parameters: usize = tensors.iter().map(numel).sum();
        let index = json!({
            "metadata": {"total_parameters": total_parameters, "total_size": tensor_bytes},
            "weight_map": weight_map,
        });
        bytes_written += write_json(dir, "model.safetensors.index.json", &index)?;
        files.push("model.safetensors.index.json".into());
    }
    Ok(WrittenWeights {
        shards: n,
        tensor_bytes,
        bytes_written,
    })
}

/// Splits `items` into consecutive runs of at most `max` bytes each (an item larger than `max`
/// alone), as huggingface_hub's `split_state_dict_into_shards_factory` but keeping order.
fn shard_ranges<T>(items: &[T], max: u64, size: impl Fn(&T) -> u64) -> Vec<std::ops::Range<usize>> {
    let mut shards = Vec::new();
    let (mut start, mut current) = (0, 0u64);
    for (i, item) in items.iter().enumerate() {
        let s = size(item);
        if i > start && current.saturating_add(s) > max {
            shards.push(start..i);
            (start, current) = (i, 0);
        }
        current = current.saturating_add(s);
    }
    if start < items.len() || shards.is_empty() {
        shards.push(start..items.len());
    }
    shards
}

/// The [`TOKENIZER_FILES`] present in `dir` (none when `dir` is not a directory).
pub fn tokenizer_files(dir: &Path) -> Vec<PathBuf> {
    TOKENIZER_FILES
        .iter()
        .map(|f| dir.join(f))
        .filter(|p| p.is_file())
        .collect()
}

/// The tokenizer files present in `dir`; an error when there are none.
fn tokenizer_files_in(dir: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let found = tokenizer_files(dir);
    if found.is_empty() {
        return Err(CheckpointError::io(
            dir,
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!(
                    "tokenizer_dir holds none of the tokenizer files ({})",
                    TOKENIZER_FILES.join(", ")
                ),
            ),
        ));
    }
    Ok(found)
}

pub(crate) fn torch_dtype(d: OutputDtype) -> DType {
    match d {
        OutputDtype::F32 => DType::F32,
        OutputDtype::BF16 => DType::BF16,
        OutputDtype::F16 => DType::F16,
    }
}

/// Maps a model-side error onto this crate's error kinds: config fields to
/// [`CheckpointError::Metadata`] of `config.json`; anything else (a config file that does not
/// parse, a parameter of the wrong shape, named in the message) to [`CheckpointError::Format`].
/// The weights' dtype of an HF `config.json` (`dtype` or `torch_dtype`; f32 when absent).
pub(crate) fn input_dtype(config: Option<&Value>) -> OutputDtype {
    let name = config.and_then(|c| c.get("dtype").or_else(|| c.get("torch_dtype")));
    match name.and_then(Value::as_str) {
        Some("bfloat16") => OutputDtype::BF16,
        Some("float16") => OutputDtype::F16,
        _ => OutputDtype::F32,
    }
}

pub(crate) fn model_err(e: &ModelError) -> CheckpointError {
    match e {
        ModelError::ConfigField { field, message } => CheckpointError::Metadata {
            file: "config.json".into(),
            key: field.clone(),
            detail: message.clone(),
        },
        ModelError::ConfigFile { path, message } => CheckpointError::Format {
            file: display_name(path),
            detail: message.clone(),
        },
        other => CheckpointError::Format {
            file: "model".into(),
            detail: other.to_string(),
        },
    }
}

pub(crate) fn read_json(path: &Path) -> Result<Value, CheckpointError> {
    let text = fs::read_to_string(path).map_err(|e| CheckpointError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| CheckpointError::Format {
        file: display_name(path),
        detail: format!("invalid JSON: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::shard_ranges;

    #[test]
    fn shards_close_before_overflow_and_big_items_stand_alone() {
        let sizes = [4u64, 4, 4, 10, 1, 1];
        let got = shard_ranges(&sizes, 8, |&s| s);
        assert_eq!(got, vec![0..2, 2..3, 3..4, 4..6]);
        assert_eq!(shard_ranges(&sizes, 100, |&s| s), vec![0..6]);
        assert_eq!(shard_ranges::<u64>(&[], 8, |&s| s), vec![0..0]);
    }
}
