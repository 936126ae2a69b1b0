//! [`CheckpointWeights`]: a distributed checkpoint seen through HF tensor names, so the HF
//! loader builds a [`GptModel`] from it (`model.load` of a checkpoint) and the HF writer
//! streams it out (`ckpt_to_hf`): each HF tensor is the row boxes of its Megatron parameter,
//! read from whichever shards hold them.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use ferrotron_model::families::{
    HfModelInfo, ParamDecl, WeightSource, gpt_model_from_hf, param_mapping, parse_hf_config,
};
use ferrotron_model::{GptModel, ModelError, TransformerConfig};
use ferrotron_tensor::{DType, Tensor};
use serde_json::Value;

use super::{MODEL_PREFIX, TOKENIZER_SUBDIR, stored_hf_config};
use crate::CheckpointError;
use crate::dist::{CheckpointReader, METADATA_FILE, locate_checkpoint};

/// Where an HF tensor lives in the checkpoint.
struct Source {
    key: String,
    param_shape: Vec<usize>,
    rows: Vec<Range<usize>>,
    hf_shape: Vec<usize>,
}

/// A checkpoint's model weights by HF name (see the module docs).
pub struct CheckpointWeights {
    reader: CheckpointReader,
    info: HfModelInfo,
    hf_config: Value,
    /// HF names in `save_pretrained` order.
    order: Vec<String>,
    /// Not yet taken, by HF name.
    sources: BTreeMap<String, Source>,
    dtype: DType,
}

fn err(path: &Path, detail: impl Into<String>) -> CheckpointError {
    CheckpointError::Format {
        file: path.display().to_string(),
        detail: detail.into(),
    }
}

impl CheckpointWeights {
    /// Opens the checkpoint `path` (an iteration directory, or a save directory whose tracker
    /// names one); tensors are converted to `dtype` when taken.
    ///
    /// # Errors
    /// No checkpoint there, no HF config in its metadata, or model tensors missing, extra or
    /// misshapen against that config (all listed).
    pub fn open(path: &Path, dtype: DType) -> Result<CheckpointWeights, CheckpointError> {
        let dir = locate_checkpoint(path)?.ok_or_else(|| {
            err(
                path,
                format!(
                    "no {METADATA_FILE} and no latest_checkpointed_iteration.txt: not a checkpoint"
                ),
            )
        })?;
        let reader = CheckpointReader::open(&dir)?;
        let meta_path = dir.join(METADATA_FILE);
        let hf_config = stored_hf_config(&reader.metadata().content)
            .ok_or_else(|| {
                err(
                    &meta_path,
                    "content holds no hf_config (the model's config.json), so the model's shape is unknown",
                )
            })?
            .clone();
        let info =
            parse_hf_config(&hf_config).map_err(|e| err(&meta_path, format!("hf_config: {e}")))?;
        let c = &info.config;
        let mapping = param_mapping(c, c.vocab_size).map_err(|e| err(&meta_path, e.to_string()))?;
        let expected: Vec<(String, Vec<usize>)> = mapping
            .iter()
            .map(|m| (format!("{MODEL_PREFIX}{}", m.name), m.shape.clone()))
            .collect();
        reader.check_tensors(MODEL_PREFIX, &expected)?;
        let mut order = Vec::new();
        let mut sources = BTreeMap::new();
        for ParamDecl {
            name, shape, hf, ..
        } in mapping
        {
            for part in hf {
                order.push(part.name.clone());
                let source = Source {
                    key: format!("{MODEL_PREFIX}{name}"),
                    param_shape: shape.clone(),
                    rows: part.rows,
                    hf_shape: part.shape,
                };
                sources.insert(part.name, source);
            }
        }
        Ok(CheckpointWeights {
            reader,
            info,
            hf_config,
            order,
            sources,
            dtype,
        })
    }

    /// The model's config and token ids (from the stored `config.json`).
    pub fn info(&self) -> &HfModelInfo {
        &self.info
    }

    /// The stored HF `config.json`.
    pub fn hf_config(&self) -> &Value {
        &self.hf_config
    }

    /// The stored `generation_config.json`, if any.
    pub fn generation_config(&self) -> Option<&Value> {
        let content = &self.reader.metadata().content;
        content
            .get("generation_config")
            .or_else(|| {
                content
                    .get("extra")
                    .and_then(|e| e.get("generation_config"))
            })
            .filter(|v| !v.is_null())
    }

    /// The iteration directory.
    pub fn dir(&self) -> &Path {
        self.reader.dir()
    }

    /// The checkpoint's `tokenizer/` directory, when it has one.
    pub fn tokenizer_dir(&self) -> Option<PathBuf> {
        Some(self.dir().join(TOKENIZER_SUBDIR)).filter(|d| d.is_dir())
    }

    /// Every HF tensor's name and shape, in `save_pretrained` order.
    pub fn hf_tensors(&self) -> Vec<(String, Vec<usize>)> {
        self.order
            .iter()
            .filter_map(|n| self.sources.get(n).map(|s| (n.clone(), s.hf_shape.clone())))
            .collect()
    }

    /// The checkpoint's metadata.
    pub fn metadata(&self) -> &crate::dist::CheckpointMetadata {
        self.reader.metadata()
    }

    /// Where HF tensor `name` lives: the checkpoint key and the rows of that tensor it is
    /// made of (`None` when unknown or taken).
    pub fn source(&self, name: &str) -> Option<(&str, &[Range<usize>])> {
        self.sources
            .get(name)
            .map(|s| (s.key.as_str(), s.rows.as_slice()))
    }

    /// The values (f32, row-major) of HF tensor `name`, or `None` when unknown or taken.
    ///
    /// # Errors
    /// A damaged shard.
    pub fn read_hf(&self, name: &str) -> Result<Option<Vec<f32>>, CheckpointError> {
        let Some(s) = self.sources.get(name) else {
            return Ok(None);
        };
        let read_rows = |r: &Range<usize>| {
            let mut offset = vec![0; s.param_shape.len()];
            let mut shape = s.param_shape.clone();
            offset[0] = r.start;
            shape[0] = r.len();
            self.reader.read_box(&s.key, &offset, &shape)
        };
        if let [r] = s.rows.as_slice() {
            return read_rows(r).map(Some);
        }
        let mut values = Vec::with_capacity(s.hf_shape.iter().product());
        for r in &s.rows {
            values.extend(read_rows(r)?);
        }
        Ok(Some(values))
    }

    /// Builds the whole model (weights stored as the `dtype` given to
    /// [`open`](Self::open)) with its config.
    ///
    /// # Errors
    /// A damaged shard or a model the config rejects.
    pub fn load_model(mut self) -> Result<(GptModel, HfModelInfo), ModelError> {
        let config: TransformerConfig = self.info.config.clone();
        let model = gpt_model_from_hf(config, &mut self)?;
        Ok((model, self.info))
    }
}

impl WeightSource for CheckpointWeights {
    fn take(&mut self, name: &str) -> ferrotron_model::Result<Option<Tensor>> {
        let Some(values) = self.read_hf(name).map_err(|e| ModelError::ConfigFile {
            path: self.dir().to_path_buf(),
            message: e.to_string(),
        })?
        else {
            return Ok(None);
        };
        let shape = self.sources.remove(name).expect("read above").hf_shape;
        let t = Tensor::from_f32(&shape, values)?;
        Ok(Some(if self.dtype == DType::F32 {
            t
        } else {
            t.to_dtype(self.dtype)
        }))
    }

    fn remaining(&self) -> Vec<String> {
        self.sources.keys().cloned().collect()
    }
}
