//! LLaMA hyper-parameters from `llama.*` metadata, and the HF `config.json` built from them.
//!
//! Mirrors transformers' `GGUF_CONFIG_MAPPING["llama"]` (`integrations/ggml.py`) and
//! `load_gguf_checkpoint` (`modeling_gguf_pytorch_utils.py`): `rope.dimension_count` is the head
//! dim, `vocab_size` falls back to the token count, `tie_word_embeddings` is true iff the file has
//! no `output.weight`, and the tokenizer's bos/eos/unk/pad ids become the config's token ids.
//! Values are widened exactly (an f32 epsilon of 1e-5 stays 9.999999747378752e-06, as there).
//! Unlike transformers, metadata that would change the model but cannot be expressed (mixture of
//! experts, non-linear rope scaling) is an error rather than silently ignored.

use serde_json::{Value, json};

use super::reader::GgufFile;
use crate::CheckpointError;

/// The dtype of the tensors written to `model.safetensors`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutputDtype {
    /// 32-bit float (the default): dequantized values are stored exactly.
    #[default]
    F32,
    /// bfloat16, rounded to nearest even from the dequantized f32 values.
    BF16,
    /// IEEE half, rounded to nearest even from the dequantized f32 values.
    F16,
}

impl OutputDtype {
    /// The safetensors dtype tag (`F32`, `BF16`, `F16`).
    pub fn safetensors_name(self) -> &'static str {
        match self {
            OutputDtype::F32 => "F32",
            OutputDtype::BF16 => "BF16",
            OutputDtype::F16 => "F16",
        }
    }

    /// The PyTorch dtype name used for `torch_dtype` in `config.json`.
    pub fn torch_name(self) -> &'static str {
        match self {
            OutputDtype::F32 => "float32",
            OutputDtype::BF16 => "bfloat16",
            OutputDtype::F16 => "float16",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            OutputDtype::F32 => 4,
            OutputDtype::BF16 | OutputDtype::F16 => 2,
        }
    }
}

/// A LLaMA-family model's shape, read from a GGUF file's metadata (architecture `llama`).
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaGgufConfig {
    /// `llama.embedding_length` (h).
    pub hidden_size: u64,
    /// `llama.feed_forward_length`.
    pub intermediate_size: u64,
    /// `llama.block_count`.
    pub num_hidden_layers: u64,
    /// `llama.attention.head_count` (a).
    pub num_attention_heads: u64,
    /// `llama.attention.head_count_kv` (g), defaulting to the head count.
    pub num_key_value_heads: u64,
    /// `llama.rope.dimension_count`, else `llama.attention.key_length`, else h / a (d).
    pub head_dim: u64,
    /// `llama.attention.layer_norm_rms_epsilon`, widened from f32.
    pub rms_norm_eps: f64,
    /// `llama.rope.freq_base`, default 10000.
    pub rope_theta: f64,
    /// Linear rope scaling factor from `llama.rope.scaling.type = linear`, if any.
    pub rope_linear_factor: Option<f64>,
    /// `llama.context_length`.
    pub max_position_embeddings: u64,
    /// `llama.vocab_size`, else the length of `tokenizer.ggml.tokens`, else `token_embd` rows (v).
    pub vocab_size: u64,
    /// True iff the file has no `output.weight` tensor.
    pub tie_word_embeddings: bool,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos_token_id: Option<u64>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos_token_id: Option<u64>,
    /// `tokenizer.ggml.padding_token_id`.
    pub pad_token_id: Option<u64>,
    /// `tokenizer.ggml.unknown_token_id`.
    pub unk_token_id: Option<u64>,
}

impl LlamaGgufConfig {
    /// Reads the config from `f`'s metadata.
    ///
    /// # Errors
    /// [`CheckpointError::Metadata`] if `general.architecture` is not `llama`, a required key
    /// (`block_count`, `embedding_length`, `feed_forward_length`, `attention.head_count`,
    /// `attention.layer_norm_rms_epsilon`, `context_length`) is missing or mistyped, the head
    /// counts are zero or do not divide, the head dim disagrees between keys, the file is a
    /// mixture of experts (`llama.expert_count` > 0), or rope scaling is not `none`/`linear`.
    pub fn from_gguf(f: &GgufFile) -> Result<LlamaGgufConfig, CheckpointError> {
        check_architecture(f)?;
        let (hidden_size, num_attention_heads, num_key_value_heads) = attention_heads(f)?;
        let head_dim = head_dim(f, hidden_size, num_attention_heads)?;
        if let Some(n) = f.opt_u64("llama.expert_count")?
            && n > 0
        {
            return Err(metadata_err(
                f,
                "llama.expert_count",
                format!("{n}: mixture-of-experts files are not supported"),
            ));
        }
        let rope_linear_factor = rope_scaling(f)?;
        let vocab_size = vocab_size(f)?;
        Ok(LlamaGgufConfig {
            hidden_size,
            intermediate_size: f.require_u64("llama.feed_forward_length")?,
            num_hidden_layers: f.require_u64("llama.block_count")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: f
                .opt_f64("llama.attention.layer_norm_rms_epsilon")?
                .ok_or_else(|| {
                    metadata_err(
                        f,
                        "llama.attention.layer_norm_rms_epsilon",
                        "missing (expected a float)".into(),
                    )
                })?,
            rope_theta: f.opt_f64("llama.rope.freq_base")?.unwrap_or(10000.0),
            rope_linear_factor,
            max_position_embeddings: f.require_u64("llama.context_length")?,
            vocab_size,
            tie_word_embeddings: f.tensor_info("output.weight").is_none(),
            bos_token_id: f.opt_u64("tokenizer.ggml.bos_token_id")?,
            eos_token_id: f.opt_u64("tokenizer.ggml.eos_token_id")?,
            pad_token_id: f.opt_u64("tokenizer.ggml.padding_token_id")?,
            unk_token_id: f.opt_u64("tokenizer.ggml.unknown_token_id")?,
        })
    }

    /// The HF `config.json` object for `LlamaForCausalLM` (transformers' `LlamaConfig` fields).
    /// Rope is written both in the v4 spelling (`rope_theta`, `rope_scaling`) and the v5 one
    /// (`rope_parameters`), so either version reads it.
    pub fn to_hf_json(&self, dtype: OutputDtype) -> Value {
        let mut v = json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "attention_bias": false,
            "attention_dropout": 0.0,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "mlp_bias": false,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "pretraining_tp": 1,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": match self.rope_linear_factor {
                None => json!({"rope_theta": self.rope_theta, "rope_type": "default"}),
                Some(f) => json!({"rope_theta": self.rope_theta, "rope_type": "linear", "factor": f}),
            },
            "rope_scaling": self.rope_linear_factor.map(|f| json!({"rope_type": "linear", "factor": f})),
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": dtype.torch_name(),
            "use_cache": true,
            "vocab_size": self.vocab_size,
        });
        let ids = [
            ("bos_token_id", self.bos_token_id),
            ("eos_token_id", self.eos_token_id),
            ("pad_token_id", self.pad_token_id),
            ("unk_token_id", self.unk_token_id),
        ];
        if let Some(obj) = v.as_object_mut() {
            for (k, id) in ids {
                if let Some(id) = id {
                    obj.insert(k.to_string(), json!(id));
                }
            }
        }
        v
    }
}

/// A [`CheckpointError::Metadata`] for `key` of `f` with `detail`.
fn metadata_err(f: &GgufFile, key: &str, detail: String) -> CheckpointError {
    CheckpointError::Metadata {
        file: f.file_name().to_string(),
        key: key.to_string(),
        detail,
    }
}

/// Checks that `general.architecture` is present and `llama`.
fn check_architecture(f: &GgufFile) -> Result<(), CheckpointError> {
    let arch = f.opt_str("general.architecture")?.ok_or_else(|| {
        metadata_err(
            f,
            "general.architecture",
            "missing (expected \"llama\")".into(),
        )
    })?;
    if arch != "llama" {
        return Err(metadata_err(
            f,
            "general.architecture",
            format!("{arch:?} is not supported (expected \"llama\")"),
        ));
    }
    Ok(())
}

/// `(hidden_size, num_attention_heads, num_key_value_heads)`: all non-zero, kv heads dividing
/// the heads.
fn attention_heads(f: &GgufFile) -> Result<(u64, u64, u64), CheckpointError> {
    let hidden_size = f.require_u64("llama.embedding_length")?;
    let num_attention_heads = f.require_u64("llama.attention.head_count")?;
    let num_key_value_heads = f
        .opt_u64("llama.attention.head_count_kv")?
        .unwrap_or(num_attention_heads);
    if hidden_size == 0 || num_attention_heads == 0 || num_key_value_heads == 0 {
        return Err(metadata_err(
            f,
            "llama.attention.head_count",
            format!(
                "hidden {hidden_size}, heads {num_attention_heads}, kv heads {num_key_value_heads}: \
                 expected all non-zero"
            ),
        ));
    }
    if !num_attention_heads.is_multiple_of(num_key_value_heads) {
        return Err(metadata_err(
            f,
            "llama.attention.head_count_kv",
            format!("{num_key_value_heads} does not divide the head count {num_attention_heads}"),
        ));
    }
    Ok((hidden_size, num_attention_heads, num_key_value_heads))
}

/// The head dim: rope dimension count or key length (which must agree), else hidden / heads;
/// even, and equal to the value length when that is given.
fn head_dim(
    f: &GgufFile,
    hidden_size: u64,
    num_attention_heads: u64,
) -> Result<u64, CheckpointError> {
    let rope_dim = f.opt_u64("llama.rope.dimension_count")?;
    let key_len = f.opt_u64("llama.attention.key_length")?;
    let head_dim = match (rope_dim, key_len) {
        (Some(r), Some(k)) if r != k => {
            return Err(metadata_err(
                f,
                "llama.rope.dimension_count",
                format!(
                    "{r} differs from llama.attention.key_length {k} (partial rotary is not supported)"
                ),
            ));
        }
        (Some(d), _) | (None, Some(d)) => d,
        (None, None) if hidden_size.is_multiple_of(num_attention_heads) => {
            hidden_size / num_attention_heads
        }
        (None, None) => {
            return Err(metadata_err(
                f,
                "llama.rope.dimension_count",
                format!(
                    "missing, and hidden {hidden_size} is not divisible by {num_attention_heads} heads"
                ),
            ));
        }
    };
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(metadata_err(
            f,
            "llama.rope.dimension_count",
            format!("{head_dim}: expected an even head dim"),
        ));
    }
    if let Some(v) = f.opt_u64("llama.attention.value_length")?
        && v != head_dim
    {
        return Err(metadata_err(
            f,
            "llama.attention.value_length",
            format!("{v} differs from the head dim {head_dim} (not supported by LlamaForCausalLM)"),
        ));
    }
    Ok(head_dim)
}

/// `llama.vocab_size`, else the token count, else `token_embd.weight`'s row count.
fn vocab_size(f: &GgufFile) -> Result<u64, CheckpointError> {
    Ok(match f.opt_u64("llama.vocab_size")? {
        Some(v) => v,
        None => match f.opt_array("tokenizer.ggml.tokens")? {
            Some(a) => a.len() as u64,
            None => f
                .tensor_info("token_embd.weight")
                .and_then(|t| t.dims.get(1).copied())
                .ok_or_else(|| {
                    metadata_err(
                        f,
                        "llama.vocab_size",
                        "missing, and no tokens or token_embd.weight".into(),
                    )
                })?,
        },
    })
}

/// `llama.rope.scaling.type` / `.factor` (or the older `llama.rope.scale_linear`): `None` for no
/// scaling, the factor for linear scaling, an error for any other kind.
fn rope_scaling(f: &GgufFile) -> Result<Option<f64>, CheckpointError> {
    let factor = f.opt_f64("llama.rope.scaling.factor")?;
    let kind = f.opt_str("llama.rope.scaling.type")?;
    let linear = match kind {
        None => f.opt_f64("llama.rope.scale_linear")?,
        Some("none") => None,
        Some("linear") => factor,
        Some(other) => {
            return Err(CheckpointError::Metadata {
                file: f.file_name().to_string(),
                key: "llama.rope.scaling.type".into(),
                detail: format!(
                    "{other:?} rope scaling is not supported (expected none or linear)"
                ),
            });
        }
    };
    Ok(linear.filter(|&x| x != 1.0))
}
