//! Tensor (and sequence) parallelism: the group a model shard belongs to, the paired
//! communication "mappings" of Megatron-Core (`megatron/core/tensor_parallel/mappings.py`)
//! as explicit forward/backward functions, the vocab-parallel embedding and the
//! vocab-parallel cross entropy (`layers.py`, `cross_entropy.py`).
//!
//! Activations are rows `[s, b]` of width `h`; with sequence parallelism the residual stream
//! of rank `r` holds rows `r·(s/t)·b .. (r+1)·(s/t)·b` (a contiguous slice: splitting `s`
//! splits the rows), Megatron's `[s/t, b, h]`.

mod cross_entropy;
mod embedding;
mod mappings;

use std::sync::Arc;

use ferrotron_comm::Communicator;

pub use cross_entropy::vocab_parallel_cross_entropy;
pub use embedding::{vocab_parallel_embedding_backward, vocab_parallel_embedding_forward};
pub use mappings::{
    copy_to_tensor_model_parallel_region_backward, gather_from_sequence_parallel_region,
    gather_from_sequence_parallel_region_backward, reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region_backward,
};

use crate::{NnError, Result};

/// A model shard's tensor-parallel group (Megatron's tp group) and whether the residual
/// stream is split along the sequence over it (`--sequence-parallel`).
#[derive(Clone)]
pub struct TensorParallel {
    comm: Arc<dyn Communicator>,
    sequence_parallel: bool,
}

impl std::fmt::Debug for TensorParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorParallel")
            .field("rank", &self.comm.rank())
            .field("size", &self.comm.size())
            .field("sequence_parallel", &self.sequence_parallel)
            .finish()
    }
}

impl TensorParallel {
    /// The group `comm`; `sequence_parallel` splits norms and residuals along `s`.
    pub fn new(comm: Arc<dyn Communicator>, sequence_parallel: bool) -> Self {
        TensorParallel {
            comm,
            sequence_parallel,
        }
    }

    /// Tensor-parallel rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Tensor-parallel size `t`.
    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// Whether the residual stream is split along the sequence.
    pub fn sequence_parallel(&self) -> bool {
        self.sequence_parallel
    }

    /// The group.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// Rows of this rank's residual stream for a pass of `rows = s·b` rows: all of them, or
    /// with sequence parallelism the rank's `1/t` (`s` must divide by `t`).
    ///
    /// # Errors
    /// [`NnError::BadInput`] when sequence parallelism cannot split `s`.
    pub fn local_rows(&self, seq: usize, batch: usize) -> Result<usize> {
        let t = self.size();
        if !self.sequence_parallel {
            return Ok(seq * batch);
        }
        if !seq.is_multiple_of(t) {
            return Err(NnError::BadInput {
                field: "sequence length".into(),
                reason: format!(
                    "{seq} tokens do not split over tensor_model_parallel_size {t} \
                     (sequence_parallel)"
                ),
            });
        }
        Ok(seq / t * batch)
    }
}

pub(crate) fn comm_err(e: ferrotron_comm::CommError) -> NnError {
    NnError::Comm(format!("tensor parallel: {e}"))
}
