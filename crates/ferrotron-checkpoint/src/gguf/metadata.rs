//! Typed access to GGUF metadata values, with errors naming the key and the expected type.

use super::reader::{GgufFile, brief};
use super::value::GgufArray;
use crate::CheckpointError;

impl GgufFile {
    fn meta_err(&self, key: &str, detail: String) -> CheckpointError {
        CheckpointError::Metadata {
            file: self.file_name().to_string(),
            key: key.to_string(),
            detail,
        }
    }

    /// `key` as a non-negative integer of any integer type; `None` when absent.
    ///
    /// # Errors
    /// [`CheckpointError::Metadata`] if present with another type or a negative value.
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>, CheckpointError> {
        self.get(key)
            .map(|v| {
                v.as_u64().ok_or_else(|| {
                    self.meta_err(
                        key,
                        format!("expected a non-negative integer, found {}", brief(v)),
                    )
                })
            })
            .transpose()
    }

    /// `key` as a non-negative integer; see [`GgufFile::opt_u64`].
    ///
    /// # Errors
    /// [`CheckpointError::Metadata`] if absent, of another type, or negative.
    pub fn require_u64(&self, key: &str) -> Result<u64, CheckpointError> {
        self.opt_u64(key)?
            .ok_or_else(|| self.meta_err(key, "missing (expected a non-negative integer)".into()))
    }

    /// `key` as f64 (float or integer types); `None` when absent.
    ///
    /// # Errors
    /// [`CheckpointError::Metadata`] if present with a non-numeric type.
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>, CheckpointError> {
        self.get(key)
            .map(|v| {
                v.as_f64().ok_or_else(|| {
                    self.meta_err(key, format!("expected a number, found {}", brief(v)))
                })
            })
            .transpose()
    }

    /// `key` as a bool; `None` when absent.
    ///
    /// # Errors
    /// [`CheckpointError::Metadata`] if present with another type.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, CheckpointError> {
        self.get(key)
            .map(|v| {
                v.as_bool().ok_or_else(|| {
                    self.meta_err(key, format!("expected a bool, found {}", brief(v)))
                })
            })
            .transpose()
    }

    /// `key` as a string; `None` when absent.
    ///
    /// # Errors
    /// [`CheckpointError::Metadata`] if present with another type.
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>, CheckpointError> {
        self.get(key)
            .map(|v| {
                v.as_str().ok_or_else(|| {
                    self.meta_err(key, format!("expected a string, found {}", brief(v)))
                })
            })
            .transpose()
    }

    /// `key` as an array; `None` when absent.
    ///
    /// # Errors
    /// [`CheckpointError::Metadata`] if present with another type.
    pub fn opt_array(&self, key: &str) -> Result<Option<&GgufArray>, CheckpointError> {
        self.get(key)
            .map(|v| {
                v.as_array().ok_or_else(|| {
                    self.meta_err(key, format!("expected an array, found {}", brief(v)))
                })
            })
            .transpose()
    }
}
