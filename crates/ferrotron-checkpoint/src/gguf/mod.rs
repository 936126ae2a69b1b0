//! GGUF import: read llama.cpp's GGUF files and convert LLaMA-family models to HF directories.
//!
//! - [`GgufFile`] (`reader.rs`, `parse.rs`): memory-mapped, validated header, metadata
//!   ([`GgufValue`], [`GgufArray`]) and tensor table ([`TensorInfo`]); mirrors llama.cpp's
//!   `ggml/src/gguf.cpp` and gguf-py's `GGUFReader`.
//! - [`dequantize`] (`dequant.rs`): F32, F16, BF16 and the block formats of
//!   `ferrotron_tensor::quant` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K) to f32, bit-identical
//!   to ggml's `dequantize_row_*` and gguf-py's `quants.py`.
//! - [`hf_tokenizer_from_gguf`] (`tokenizer.rs`): `tokenizer.json` and `tokenizer_config.json`
//!   encoding identically to transformers' GGUF tokenizer conversion.
//! - [`gguf_to_hf`] (`to_hf.rs`, `config.rs`, `tensors.rs`): the whole conversion.
//! - [`load_gguf_model`] (`model.rs`): the model for inference with its quantized weights kept
//!   in their blocks (served by `ferrotron serve --model FILE.gguf`).

mod config;
mod dequant;
mod metadata;
mod model;
mod parse;
mod reader;
mod tensors;
mod to_hf;
mod tokenizer;
mod types;
mod value;

pub use config::{LlamaGgufConfig, OutputDtype};
pub use dequant::{DequantError, dequantize};
pub use model::{GgufModel, load_gguf_model};
pub use reader::{GGUF_DEFAULT_ALIGNMENT, GgufFile, TensorInfo};
pub use tensors::{
    TensorPlan, permute_qk_rows, plan_llama_tensors, qk_gguf_rows, unpermute_qk_rows,
};
pub use to_hf::{GgufToHfOptions, GgufToHfReport, gguf_to_hf};
pub use tokenizer::{HfTokenizerFiles, bytes_to_unicode, hf_tokenizer_from_gguf};
pub use types::{GgmlType, GgufValueType};
pub use value::{GgufArray, GgufValue};
