//! ZeRO-2 gradients (Megatron-FSDP's `optim_grads`, DeepSpeed's stage 2): every
//! micro-batch's gradients are reduce-scattered as its backward finishes each bucket (a
//! bucket never spans two FSDP units), summed into this rank's shard, and given back to the
//! system: between micro-batches a rank holds only the `1/d` of the gradients it owns.
//!
//! The backward accumulates into the full-size gradient buffer as always; when the last
//! parameter of a bucket reports ready ([`GradReady`]) the bucket is copied out, its
//! parameters' gradients are released ([`ferrotron_tensor::pages::release`]: zero, their
//! pages returned), and the copy is reduce-scattered — on the data-parallel progress thread
//! with `overlap_grad_reduce` (waited for when the micro-batch ends), else at once. The
//! reduced shard is added into an accumulator of the shards this rank owns, which
//! [`GradShards::finish`] writes into the buffer's shard ranges for the optimizer.

use std::ops::Range;
use std::time::{Duration, Instant};

use ferrotron_comm::{AsyncComm, Collectives, CommHandle, Communicator, ReduceOp};
use ferrotron_model::GradReady;
use ferrotron_optim::ParamAndGradBuffer;
use ferrotron_tensor::pages;

use super::bucket_staging::BucketStaging;
use super::data_parallel::{DataParallel, comm_err, through_bf16};
use super::{Result, TrainError};

/// Where a bucket's shard goes.
struct Shard {
    /// This rank's shard of the bucket, relative to its start.
    within: Range<usize>,
    /// Where the shard starts in the accumulator.
    local_start: usize,
}

/// The gradient shards of one step and the per-micro-batch [`GradReady`] hook that fills
/// them.
pub(super) struct GradShards<'a> {
    comm: &'a dyn Communicator,
    /// The progress thread, with `overlap_grad_reduce`.
    thread: Option<&'a AsyncComm>,
    /// Reduce as bf16 (`grad_reduce_in_fp32 = false`; not on the progress thread).
    narrow: bool,
    staging: BucketStaging,
    /// Per bucket: this rank's shard of it.
    shards: Vec<Shard>,
    /// The shards this rank owns, bucket after bucket (the optimizer's local order).
    accum: Vec<f32>,
    /// Reductions in flight on the progress thread: (bucket, handle).
    pending: Vec<(usize, CommHandle<Vec<f32>>)>,
    /// Time spent waiting for reductions.
    waited: Duration,
    error: Option<String>,
}

impl<'a> GradShards<'a> {
    /// Empty shards for the buckets of `buffer`, reduced over `dp`'s group; on its
    /// `overlap_grad_reduce` progress thread when `overlap` (each micro-batch's reductions
    /// are then waited for by [`GradShards::end_micro_batch`]).
    pub(super) fn new(dp: &'a DataParallel, buffer: &ParamAndGradBuffer, overlap: bool) -> Self {
        let (rank, size) = (dp.rank(), dp.size());
        let mut local = 0;
        let shards = (buffer.buckets().iter())
            .map(|b| {
                let shard = b.shard_range(rank, size);
                let within = shard.start - b.start..shard.end - b.start;
                local += shard.len();
                Shard {
                    local_start: local - shard.len(),
                    within,
                }
            })
            .collect();
        let thread = (dp.overlap_comms())
            .filter(|_| overlap && !buffer.buckets().is_empty())
            .map(|c| c.of(&buffer.buckets()[0]));
        GradShards {
            comm: &**dp.comm(),
            thread,
            narrow: dp.grad_reduce_in_bf16(),
            staging: BucketStaging::new(buffer),
            shards,
            accum: vec![0.0; local],
            pending: Vec::new(),
            waited: Duration::ZERO,
            error: None,
        }
    }

    /// A backward is over: waits for its reductions and adds them into the shards.
    ///
    /// # Errors
    /// A failed reduction.
    pub(super) fn end_micro_batch(&mut self) -> Result<()> {
        if let Some(e) = self.error.take() {
            return Err(TrainError::Comm(e));
        }
        for (b, handle) in std::mem::take(&mut self.pending) {
            let start = Instant::now();
            let reduced = handle.wait().map_err(comm_err)?;
            self.waited += start.elapsed();
            self.accumulate(b, &reduced);
        }
        Ok(())
    }

    /// Writes the summed shards into the buffer's shard ranges (the rest of the buffer
    /// holds zeros). Returns the time spent waiting for reductions.
    ///
    /// # Errors
    /// A failed reduction, or a bucket not finished by each of the `micro_batches`
    /// backwards (a bug).
    pub(super) fn finish(
        mut self,
        buffer: &mut ParamAndGradBuffer,
        micro_batches: usize,
    ) -> Result<Duration> {
        self.end_micro_batch()?;
        if let Some((b, done, waiting)) = self.staging.incomplete(micro_batches) {
            return Err(TrainError::Comm(format!(
                "gradient bucket {b}: finished by {done} of {micro_batches} backwards \
                 ({waiting} parameters did not report in the last)"
            )));
        }
        let grads = buffer.grads_mut();
        for (b, shard) in self.shards.iter().enumerate() {
            let range = self.staging.range(b);
            let within = range.start + shard.within.start..range.start + shard.within.end;
            // Zeros already; released again for the pages the per-parameter releases kept
            // at parameter boundaries.
            pages::release(&mut grads[range.start..within.start]);
            pages::release(&mut grads[within.end..range.end]);
            let local = shard.local_start..shard.local_start + within.len();
            grads[within].copy_from_slice(&self.accum[local]);
        }
        Ok(self.waited)
    }

    /// Adds the reduced bucket `b` (its shard part) into the accumulator.
    fn accumulate(&mut self, b: usize, reduced: &[f32]) {
        let shard = &self.shards[b];
        let local = &mut self.accum[shard.local_start..shard.local_start + shard.within.len()];
        for (a, r) in local.iter_mut().zip(&reduced[shard.within.clone()]) {
            *a += r;
        }
    }

    /// Reduce-scatters the staged bucket `b` (now, or on the progress thread).
    fn reduce(&mut self, b: usize, mut staged: Vec<f32>) -> std::result::Result<(), String> {
        if let Some(thread) = self.thread {
            self.pending
                .push((b, thread.reduce_scatter_in_place(staged, ReduceOp::Sum)));
            return Ok(());
        }
        let start = Instant::now();
        let comm = self.comm;
        let reduced = if self.narrow {
            through_bf16(&mut staged, |n| {
                comm.reduce_scatter_in_place(n, ReduceOp::Sum)
            })
        } else {
            comm.reduce_scatter_in_place(&mut staged, ReduceOp::Sum)
        };
        reduced.map_err(|e| e.to_string())?;
        self.waited += start.elapsed();
        self.accumulate(b, &staged);
        Ok(())
    }
}

impl GradReady for GradShards<'_> {
    fn ready(&mut self, params: &[usize], grads: &mut [&mut [f32]]) {
        for &i in params {
            let staged = self.staging.stage(i, grads);
            if staged.is_ok()
                && let Some(grad) = grads.get_mut(i)
            {
                // Copied out: the buffer's memory for it goes back until the next backward.
                pages::release(grad);
            }
            let result = match staged {
                Ok(Some((b, staged))) => self.reduce(b, staged),
                Ok(None) => Ok(()),
                Err(e) => Err(e),
            };
            if let Err(e) = result {
                self.error.get_or_insert(e);
            }
        }
    }
}
