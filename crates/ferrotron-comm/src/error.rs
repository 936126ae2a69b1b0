//! Error type of the communication crate.

use thiserror::Error;

/// What can go wrong building a process grid or running a collective.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum CommError {
    /// An impossible parallel layout; the message names the sizes and what was expected,
    /// e.g. `world size 6 is not divisible by tensor_model_parallel_size (4) x ...`.
    #[error("invalid parallel layout: {0}")]
    Layout(String),
    /// Ranks called a collective with buffers that do not fit together (lengths, roots).
    #[error("{op}: {reason}")]
    Mismatch {
        /// The collective, e.g. `all_reduce`.
        op: &'static str,
        /// What did not fit.
        reason: String,
    },
    /// A rank index outside the group.
    #[error("{op}: rank {rank} is not in a group of {size}")]
    Rank {
        /// The operation.
        op: &'static str,
        /// The rank asked for.
        rank: usize,
        /// Group size.
        size: usize,
    },
    /// Another rank failed; this rank stopped waiting for it.
    #[error("aborted: rank {rank} failed: {reason}")]
    Aborted {
        /// World rank that failed first.
        rank: usize,
        /// Its error.
        reason: String,
    },
    /// The MPI library reported an error or is unavailable.
    #[error("mpi: {0}")]
    Mpi(String),
}

/// Result of a communication call.
pub type Result<T> = std::result::Result<T, CommError>;

pub(crate) fn mismatch(op: &'static str, reason: impl Into<String>) -> CommError {
    CommError::Mismatch {
        op,
        reason: reason.into(),
    }
}
