use ferrotron_tensor::TensorError;

/// Errors from building layers (shape checks) and running them (bad token ids).
#[derive(Debug, thiserror::Error)]
pub enum NnError {
    /// A parameter's shape differs from what the layer needs.
    #[error("{name}: expected shape {expected:?}, got {actual:?}")]
    ParamShape {
        name: String,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    /// A run-time input (not a parameter) is malformed, e.g. document starts of packed rows.
    #[error("{field}: {reason}")]
    BadInput { field: String, reason: String },
    /// A collective of tensor, context or expert parallelism failed (often: another rank
    /// failed first); the message names which.
    #[error("communication: {0}")]
    Comm(String),
    /// A tensor-level error (dtype, index out of range, ...).
    #[error(transparent)]
    Tensor(#[from] TensorError),
}
