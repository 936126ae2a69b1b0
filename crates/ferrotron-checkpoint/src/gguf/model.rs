//! [`load_gguf_model`]: a LLaMA-family GGUF file as a [`GptModel`] whose quantized weights stay
//! in their ggml blocks — llama.cpp's way of serving a GGUF, on our model code.
//!
//! The tensors map onto HF names as [`super::gguf_to_hf`] maps them (q/k rows un-permuted, by
//! reordering whole rows of blocks), then onto Megatron's fused `linear_qkv` / `linear_fc1`
//! by the same packing as an HF checkpoint ([`gpt_model_from_hf`]): a fused weight whose parts
//! differ in format (Q4_K_M's Q6_K value rows beside Q4_K query rows) keeps each part's
//! format. F32/F16/BF16 tensors (norms, sometimes the embedding, every weight of an unquantized
//! file) are converted to the requested dtype.

use std::collections::BTreeMap;
use std::path::Path;

use ferrotron_model::families::{HfModelInfo, WeightSource, gpt_model_from_hf, parse_hf_config};
use ferrotron_model::{GptModel, ParamValue};
use ferrotron_tensor::quant::QuantMatrix;
use ferrotron_tensor::{DType, Tensor};

use super::config::{LlamaGgufConfig, OutputDtype};
use super::reader::{GgufFile, tensor_err};
use super::tensors::{TensorPlan, plan_llama_tensors, qk_gguf_rows, unpermute_qk_rows};
use super::tokenizer::{HfTokenizerFiles, hf_tokenizer_from_gguf};
use crate::CheckpointError;

/// A GGUF file loaded for inference.
pub struct GgufModel {
    /// The model, quantized weights kept quantized.
    pub model: GptModel,
    /// The HF config the file's metadata describes (as `gguf_to_hf` writes it).
    pub info: HfModelInfo,
    /// `tokenizer.json` and `tokenizer_config.json` (with the chat template) built from the
    /// metadata, as transformers builds them.
    pub tokenizer: HfTokenizerFiles,
    /// Number of tensors per ggml type name, e.g. `{"F32": 61, "Q8_0": 211}`.
    pub type_counts: BTreeMap<String, usize>,
}

/// Loads the LLaMA-family GGUF file `path` for inference (see the module doc), its
/// unquantized tensors stored as `dtype`.
///
/// # Errors
/// What [`GgufFile::open`], [`LlamaGgufConfig::from_gguf`], [`plan_llama_tensors`] and
/// [`hf_tokenizer_from_gguf`] report; [`CheckpointError::Format`] naming the file when the
/// model cannot be built from its tensors.
pub fn load_gguf_model(path: &Path, dtype: DType) -> Result<GgufModel, CheckpointError> {
    let f = GgufFile::open(path)?;
    let cfg = LlamaGgufConfig::from_gguf(&f)?;
    let plans = plan_llama_tensors(&f, &cfg)?;
    let format_err = |detail: String| CheckpointError::Format {
        file: f.file_name().to_string(),
        detail,
    };
    let info = parse_hf_config(&cfg.to_hf_json(OutputDtype::F32))
        .map_err(|e| format_err(format!("the model's metadata: {e}")))?;
    let tokenizer = hf_tokenizer_from_gguf(&f, Some(cfg.max_position_embeddings))?;
    let mut type_counts = BTreeMap::new();
    for t in f.tensors() {
        *type_counts.entry(t.ggml_type.to_string()).or_insert(0) += 1;
    }
    let mut src = GgufWeights {
        file: &f,
        dtype,
        plans: plans.into_iter().map(|p| (p.hf_name.clone(), p)).collect(),
    };
    let model = gpt_model_from_hf(info.config.clone(), &mut src)
        .map_err(|e| format_err(format!("building the model: {e}")))?;
    Ok(GgufModel {
        model,
        info,
        tokenizer,
        type_counts,
    })
}

/// The tensors of a GGUF file by HF name, not taken yet.
struct GgufWeights<'f> {
    file: &'f GgufFile,
    /// Storage dtype of the unquantized tensors.
    dtype: DType,
    plans: BTreeMap<String, TensorPlan>,
}

impl GgufWeights<'_> {
    fn err(&self, p: &TensorPlan, detail: String) -> ferrotron_model::ModelError {
        let e = tensor_err(self.file.file_name(), &p.gguf_name, detail);
        ferrotron_model::ModelError::Input(e.to_string())
    }

    /// The HF tensor `p` dequantized to f32 and stored as `self.dtype`, q/k rows un-permuted.
    fn dense(&self, p: &TensorPlan) -> ferrotron_model::Result<Tensor> {
        let data = self
            .file
            .tensor_f32(&p.gguf_name)
            .map_err(|e| ferrotron_model::ModelError::Input(e.to_string()))?;
        let shape: Vec<usize> = p.hf_shape.iter().map(|&d| d as usize).collect();
        let data = match p.unpermute_heads {
            None => data,
            Some(heads) => unpermute_qk_rows(&data, shape[0], shape[1], heads as usize)
                .ok_or_else(|| self.err(p, "rows do not split into rotary halves".into()))?,
        };
        Ok(Tensor::from_f32(&shape, data)?.to_dtype(self.dtype))
    }

    /// The HF tensor `p` in its blocks, q/k rows un-permuted.
    fn quantized(
        &self,
        p: &TensorPlan,
        ty: ferrotron_tensor::quant::QuantType,
    ) -> ferrotron_model::Result<QuantMatrix> {
        let bytes = self
            .file
            .tensor_data(&p.gguf_name)
            .map_err(|e| ferrotron_model::ModelError::Input(e.to_string()))?;
        let [rows, cols] = [p.hf_shape[0] as usize, p.hf_shape[1] as usize];
        let q = QuantMatrix::new(ty, rows, cols, bytes.to_vec())
            .map_err(|e| self.err(p, e.to_string()))?;
        let Some(heads) = p.unpermute_heads else {
            return Ok(q);
        };
        let order = qk_gguf_rows(rows, heads as usize)
            .ok_or_else(|| self.err(p, "rows do not split into rotary halves".into()))?;
        let pieces: Vec<_> = order.into_iter().map(|r| (&q, r..r + 1)).collect();
        QuantMatrix::cat_rows(&pieces).map_err(|e| self.err(p, e.to_string()))
    }
}

impl WeightSource for GgufWeights<'_> {
    fn take(&mut self, name: &str) -> ferrotron_model::Result<Option<Tensor>> {
        match self.plans.remove(name) {
            None => Ok(None),
            Some(p) => self.dense(&p).map(Some),
        }
    }

    fn take_value(&mut self, name: &str) -> ferrotron_model::Result<Option<ParamValue>> {
        let Some(p) = self.plans.remove(name) else {
            return Ok(None);
        };
        let info = self
            .file
            .tensor_info(&p.gguf_name)
            .expect("planned tensors are in the file");
        let value = match info.ggml_type.quant_type() {
            Some(ty) if p.hf_shape.len() == 2 => ParamValue::Quantized(self.quantized(&p, ty)?),
            _ => ParamValue::Dense(self.dense(&p)?),
        };
        Ok(Some(value))
    }

    fn remaining(&self) -> Vec<String> {
        self.plans.keys().cloned().collect()
    }
}
