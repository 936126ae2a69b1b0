use crate::DType;

/// Errors from tensor construction and kernels. Messages name what was expected.
#[derive(Debug, thiserror::Error)]
pub enum TensorError {
    /// The element count implied by a shape differs from the data length.
    #[error("shape {shape:?} needs {expected} elements, got {actual}")]
    ShapeMismatch {
        shape: Vec<usize>,
        expected: usize,
        actual: usize,
    },
    /// An operation needed one dtype and got another.
    #[error("expected dtype {expected}, got {actual}")]
    DTypeMismatch { expected: DType, actual: DType },
    /// An index (e.g. a token id) is outside its table.
    #[error("{what} {index} is out of range (size {size})")]
    IndexOutOfRange {
        what: &'static str,
        index: usize,
        size: usize,
    },
    /// A shape product overflowed `usize`.
    #[error("shape {0:?} is too large (element count overflows)")]
    Overflow(Vec<usize>),
}
