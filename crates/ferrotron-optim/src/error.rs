//! Error type of the optimizer crate.

use ferrotron_tensor::DType;
use thiserror::Error;

/// Everything that can go wrong when building buffers, optimizers, scalers and schedules, or
/// when importing their state. Messages name the offending config field.
#[derive(Debug, Error)]
pub enum OptimError {
    /// A cross-rank reduction of the step failed (the message is the communicator's).
    #[error("optimizer step communication: {0}")]
    Comm(String),
    /// An invalid configuration value; the message names the field(s), e.g.
    /// `min_lr (0.1) must be <= lr (0.01)`.
    #[error("invalid optimizer config: {0}")]
    Config(String),
    /// Two parameters registered under the same name.
    #[error("parameter `{0}` is registered twice in the ParamAndGradBuffer")]
    DuplicateParam(String),
    /// A parameter name that was never registered.
    #[error("no parameter named `{0}` in the ParamAndGradBuffer")]
    UnknownParam(String),
    /// Typed access to the parameter buffer with the wrong element type.
    #[error("the parameter buffer holds {actual} elements, but {requested} was requested")]
    DTypeMismatch {
        /// Element type the caller asked for.
        requested: DType,
        /// Element type the buffer stores.
        actual: DType,
    },
    /// A flat index range outside the buffer or outside the optimizer's owned shard.
    #[error("index range {start}..{end} is invalid: {reason}")]
    Range {
        /// Range start (flat element index).
        start: usize,
        /// Range end, exclusive.
        end: usize,
        /// Why the range was rejected.
        reason: String,
    },
    /// A slice of the wrong length handed in (e.g. when setting a parameter's values).
    #[error("length mismatch for {what}: expected {expected}, got {actual}")]
    Length {
        /// What was being written.
        what: String,
        /// Expected number of elements.
        expected: usize,
        /// Number of elements given.
        actual: usize,
    },
    /// Imported state that does not fit the object it is loaded into.
    #[error("cannot import state: {0}")]
    State(String),
    /// The optimizer-state offload: its directory (named) is missing, not writable or too
    /// small, or reading / writing its file failed.
    #[error("optimizer offload: {0}")]
    Offload(String),
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, OptimError>;

/// Shorthand for building an [`OptimError::Config`].
pub(crate) fn config_err(msg: impl Into<String>) -> OptimError {
    OptimError::Config(msg.into())
}
