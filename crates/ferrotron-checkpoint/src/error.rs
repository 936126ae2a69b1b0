//! The one error type of this crate.
//!
//! Every message names the file it is about (its file name, not the whole path, for inputs; the
//! whole path for outputs), then the field or tensor, then what was found and what was expected,
//! e.g. `model.gguf: tensor blk.3.attn_q.weight: data [1024..2048) lies past end of file (1500 bytes)`.

use std::path::{Path, PathBuf};

/// Errors from reading, validating and converting checkpoints.
///
/// No variant is produced by a panic path: malformed input of any kind (bad magic, truncation,
/// sizes that overflow, unknown types, inconsistent shapes) is reported through this type.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// An operating-system I/O error on `path` (open, read, map, create, write, rename).
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory the operation was about.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// The file's bytes do not form a valid file of the expected format (header, metadata,
    /// tensor table). `detail` names the field and what was expected.
    #[error("{file}: {detail}")]
    Format {
        /// Name of the input file.
        file: String,
        /// What is wrong, naming the field and the expectation.
        detail: String,
    },

    /// A metadata key is missing, has the wrong type, or holds a value the converter cannot use.
    #[error("{file}: metadata {key}: {detail}")]
    Metadata {
        /// Name of the input file.
        file: String,
        /// The metadata key, e.g. `llama.attention.head_count`.
        key: String,
        /// What is wrong and what was expected.
        detail: String,
    },

    /// One tensor is malformed, unexpected, missing, or has the wrong shape.
    #[error("{file}: tensor {tensor}: {detail}")]
    Tensor {
        /// Name of the input file.
        file: String,
        /// The tensor's name as stored in the file, e.g. `blk.3.attn_q.weight`.
        tensor: String,
        /// What is wrong and what was expected.
        detail: String,
    },

    /// A tensor is stored in a ggml type this crate cannot dequantize.
    #[error(
        "{file}: tensor {tensor}: ggml type {ggml_type} is not supported \
         (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1)"
    )]
    UnsupportedType {
        /// Name of the input file.
        file: String,
        /// The tensor's name as stored in the file.
        tensor: String,
        /// The ggml type's name, e.g. `Q4_K`.
        ggml_type: String,
    },

    /// The tokenizer described by the file's metadata cannot be built.
    #[error("{file}: tokenizer: {detail}")]
    Tokenizer {
        /// Name of the input file.
        file: String,
        /// What is wrong and what was expected.
        detail: String,
    },

    /// The output path exists and is not an empty directory, and `force` was not given.
    #[error("{}: {detail}", path.display())]
    OutputExists {
        /// The output path.
        path: PathBuf,
        /// Why it cannot be used.
        detail: String,
    },
}

impl CheckpointError {
    /// Wraps an I/O error with the path it happened on.
    pub fn io(path: impl AsRef<Path>, source: std::io::Error) -> Self {
        CheckpointError::Io {
            path: path.as_ref().to_path_buf(),
            source,
        }
    }
}

/// The name used for `path` in error messages: its final component, or the whole path when it
/// has none.
pub(crate) fn display_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}
