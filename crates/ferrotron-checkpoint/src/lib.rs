//! Checkpoint I/O for Ferrotron: GGUF import, HF export and distributed (sharded) training
//! checkpoints.
//!
//! The entry point for GGUF is [`gguf::gguf_to_hf`]; [`gguf::GgufFile`] reads GGUF files.
//! [`export_hf`] writes a `GptModel` as an HF model directory transformers loads.
//! Training checkpoints: [`dist::CheckpointWriter`] / [`dist::CheckpointReader`].
//! Every failure is a [`CheckpointError`] naming the file, the field or tensor, and what was
//! expected; malformed input never panics.

#![warn(missing_docs)]

pub mod convert;
pub mod dist;
mod error;
pub mod gguf;
mod hf_export;
pub mod peft;
mod safetensors_writer;
mod staging;
mod upcycle;
pub mod vocab;

pub use error::CheckpointError;
pub use gguf::{GgufFile, GgufToHfOptions, GgufToHfReport, OutputDtype, gguf_to_hf};
pub use hf_export::{
    DEFAULT_MAX_SHARD_SIZE, HfExportOptions, HfExportReport, HfExportSource, TOKENIZER_FILES,
    export_hf, tokenizer_files,
};
pub use peft::{PeftAdapter, write_peft_adapter};
pub use upcycle::{UpcycleReport, upcycle_hf};
pub use vocab::{ExpandVocabOptions, ExpandVocabReport, VocabMode, expand_vocab};
