//! Checkpoint I/O for Ferrotron: GGUF import (and, later, safetensors/HF I/O and sharded
//! checkpoints).
//!
//! The entry point for GGUF is [`gguf::gguf_to_hf`]; [`gguf::GgufFile`] reads GGUF files.
//! Every failure is a [`CheckpointError`] naming the file, the field or tensor, and what was
//! expected; malformed input never panics.

#![warn(missing_docs)]

mod error;
pub mod gguf;
mod safetensors_writer;
mod staging;

pub use error::CheckpointError;
pub use gguf::{GgufFile, GgufToHfOptions, GgufToHfReport, OutputDtype, gguf_to_hf};
