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

use std::ops::Range;
use std::time::{Duration, Instant};

use ferrotron_comm::{AsyncComm, CommHandle, ReduceOp};
use ferrotron_model::GradReady;
use ferrotron_optim::{ParamAndGradBuffer, ParamId};

use super::data_parallel::{BucketComms, comm_err};
use super::{Result, TrainError};

struct Bucket<'a> {
    /// The progress thread of the group reducing it.
    comm: &'a AsyncComm,
    range: Range<usize>,
    waiting_for: usize,
    staging: Vec<f32>,
    pending: Option<CommHandle<Vec<f32>>>,
}

/// The per-step state of overlapped gradient reduction; a [`GradReady`] hook for
/// [`GptModel::forward_backward_with`](ferrotron_model::GptModel::forward_backward_with).
pub(super) struct BucketOverlap<'a> {
    distributed: bool,
    buckets: Vec<Bucket<'a>>,
    /// Per parameter: its bucket and flat range (`None` for a frozen one).
    params: Vec<Option<(usize, Range<usize>)>>,
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
        let mut buckets: Vec<Bucket> = buffer
            .buckets()
            .iter()
            .map(|b| Bucket {
                comm: comms.of(b),
                range: b.start..b.end,
                waiting_for: 0,
                staging: Vec::new(),
                pending: None,
            })
            .collect();
        let params = (0..buffer.params().len())
            .map(|i| {
                let info = buffer.info(ParamId(i));
                let bucket = info.bucket_id?;
                buckets[bucket].waiting_for += 1;
                Some((bucket, info.range()))
            })
            .collect();
        BucketOverlap {
            distributed,
            buckets,
            params,
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
        let start = Instant::now();
        for (b, bucket) in self.buckets.into_iter().enumerate() {
            let Some(pending) = bucket.pending else {
                return Err(TrainError::Comm(format!(
                    "gradient bucket {b}: {} parameters never reported ready",
                    bucket.waiting_for
                )));
            };
            let reduced = pending.wait().map_err(comm_err)?;
            buffer.bucket_grads_mut(b).copy_from_slice(&reduced);
        }
        Ok(start.elapsed())
    }
}

impl GradReady for BucketOverlap<'_> {
    fn ready(&mut self, params: &[usize], grads: &mut [&mut [f32]]) {
        for &i in params {
            let (b, range) = match self.params.get(i) {
                Some(Some(p)) => p.clone(),
                Some(None) => continue, // frozen: no gradient
                None => {
                    self.error = Some(format!("parameter {i} is not in the gradient buffer"));
                    continue;
                }
            };
            let bucket = &mut self.buckets[b];
            if bucket.staging.is_empty() {
                bucket.staging = vec![0f32; bucket.range.len()];
            }
            let at = range.start - bucket.range.start;
            bucket.staging[at..at + range.len()].copy_from_slice(grads[i]);
            bucket.waiting_for -= 1;
            if bucket.waiting_for == 0 {
                let staged = std::mem::take(&mut bucket.staging);
                bucket.pending = Some(if self.distributed {
                    bucket.comm.reduce_scatter_in_place(staged, ReduceOp::Sum)
                } else {
                    bucket.comm.all_reduce(staged, ReduceOp::Sum)
                });
            }
        }
    }
}
