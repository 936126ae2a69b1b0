//! `overlap_grad_reduce` (Megatron-Core `DistributedDataParallel` with its backward hooks,
//! `param_and_grad_buffer.py` `start_grad_sync`): during the last micro-batch's backward,
//! each gradient bucket is copied out as soon as all its parameters' gradients are final
//! and reduced on the data-parallel group's progress thread ([`AsyncComm`]) while the
//! backward goes on with earlier layers; [`BucketOverlap::finish`] waits for the reductions
//! in bucket order and writes them back.
//!
//! Buckets fill in backward order (the buffer places parameters in reverse), so bucket 0
//! (output layer, last decoder layers) is ready first. The copy costs one pass over the
//! gradients; the reduction itself then leaves the compute threads.

use std::time::{Duration, Instant};

use ferrotron_comm::{AsyncComm, CommHandle, ReduceOp};
use ferrotron_model::GradReady;
use ferrotron_optim::ParamAndGradBuffer;

use super::bucket_staging::BucketStaging;
use super::data_parallel::{BucketComms, comm_err};
use super::{Result, TrainError};

/// The per-step state of overlapped gradient reduction; a [`GradReady`] hook for
/// [`GptModel::forward_backward_with`](ferrotron_model::GptModel::forward_backward_with).
pub(super) struct BucketOverlap<'a> {
    distributed: bool,
    /// Per bucket: the progress thread of the group reducing it.
    comms: Vec<&'a AsyncComm>,
    staging: BucketStaging,
    /// Per bucket: its reduction, once submitted.
    pending: Vec<Option<CommHandle<Vec<f32>>>>,
    error: Option<String>,
}

impl<'a> BucketOverlap<'a> {
    /// Ready to hear the parameters of `buffer`; each bucket's reduction goes to its group's
    /// thread in `comms` (reduce-scatter into each rank's shard when `distributed`,
    /// all-reduce otherwise).
    pub(super) fn new(
        comms: BucketComms<'a>,
        distributed: bool,
        buffer: &ParamAndGradBuffer,
    ) -> Self {
        BucketOverlap {
            distributed,
            comms: buffer.buckets().iter().map(|b| comms.of(b)).collect(),
            staging: BucketStaging::new(buffer),
            pending: buffer.buckets().iter().map(|_| None).collect(),
            error: None,
        }
    }

    /// Waits for every bucket's reduction (in bucket order) and writes the results into the
    /// buffer's gradients. Returns the time spent waiting.
    ///
    /// # Errors
    /// A failed reduction, or a bucket whose parameters did not all report (a bug).
    pub(super) fn finish(self, buffer: &mut ParamAndGradBuffer) -> Result<Duration> {
        if let Some(e) = self.error {
            return Err(TrainError::Comm(e));
        }
        if let Some((b, _, waiting)) = self.staging.incomplete(1) {
            return Err(TrainError::Comm(format!(
                "gradient bucket {b}: {waiting} parameters never reported ready"
            )));
        }
        let start = Instant::now();
        for (b, pending) in self.pending.into_iter().enumerate() {
            let pending = pending
                .ok_or_else(|| TrainError::Comm(format!("gradient bucket {b}: never reduced")))?;
            let reduced = pending.wait().map_err(comm_err)?;
            buffer.bucket_grads_mut(b).copy_from_slice(&reduced);
        }
        Ok(start.elapsed())
    }
}

impl GradReady for BucketOverlap<'_> {
    fn ready(&mut self, params: &[usize], grads: &mut [&mut [f32]]) {
        for &i in params {
            match self.staging.stage(i, grads) {
                Ok(Some((b, staged))) => {
                    let comm = self.comms[b];
                    self.pending[b] = Some(if self.distributed {
                        comm.reduce_scatter_in_place(staged, ReduceOp::Sum)
                    } else {
                        comm.all_reduce(staged, ReduceOp::Sum)
                    });
                }
                Ok(None) => {}
                Err(e) => self.error = Some(e),
            }
        }
    }
}
