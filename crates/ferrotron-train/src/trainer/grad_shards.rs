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
use ferrotron_optim::{ParamAndGradBuffer, ParamId};
use ferrotron_tensor::pages;
use half::bf16;

use super::data_parallel::{DataParallel, comm_err};
use super::{Result, TrainError};

/// One bucket of the ZeRO-2 reduction.
struct Bucket {
    range: Range<usize>,
    /// This rank's shard of the bucket, relative to its start.
    shard: Range<usize>,
    /// Where the shard starts in the accumulator.
    local_start: usize,
    /// Parameters of the bucket; reports left in this micro-batch.
    params: usize,
    waiting_for: usize,
    /// Backwards that finished the bucket so far.
    completed: usize,
    staging: Vec<f32>,
}

/// The gradient shards of one step and the per-micro-batch [`GradReady`] hook that fills
/// them.
pub(super) struct GradShards<'a> {
    comm: &'a dyn Communicator,
    /// The progress thread, with `overlap_grad_reduce`.
    thread: Option<&'a AsyncComm>,
    /// Reduce as bf16 (`grad_reduce_in_fp32 = false`; not on the progress thread).
    narrow: bool,
    buckets: Vec<Bucket>,
    /// Per parameter: its bucket and flat range (`None` for a frozen one).
    params: Vec<Option<(usize, Range<usize>)>>,
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
        let mut buckets: Vec<Bucket> = buffer
            .buckets()
            .iter()
            .map(|b| {
                let shard = b.shard_range(rank, size);
                let bucket = Bucket {
                    range: b.start..b.end,
                    shard: shard.start - b.start..shard.end - b.start,
                    local_start: local,
                    params: 0,
                    waiting_for: 0,
                    completed: 0,
                    staging: Vec::new(),
                };
                local += shard.len();
                bucket
            })
            .collect();
        let params = (0..buffer.params().len())
            .map(|i| {
                let info = buffer.info(ParamId(i));
                let bucket = info.bucket_id?;
                buckets[bucket].params += 1;
                Some((bucket, info.range()))
            })
            .collect();
        for b in &mut buckets {
            b.waiting_for = b.params;
        }
        let thread = (dp.overlap_comms())
            .filter(|_| overlap && !buffer.buckets().is_empty())
            .map(|c| c.of(&buffer.buckets()[0]));
        GradShards {
            comm: &**dp.comm(),
            thread,
            narrow: dp.grad_reduce_in_bf16(),
            buckets,
            params,
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
        if let Some((b, bucket)) =
            (self.buckets.iter().enumerate()).find(|(_, bucket)| bucket.completed != micro_batches)
        {
            return Err(TrainError::Comm(format!(
                "gradient bucket {b}: finished by {} of {micro_batches} backwards ({} of its \
                 parameters never reported ready)",
                bucket.completed,
                bucket.params - bucket.waiting_for
            )));
        }
        let grads = buffer.grads_mut();
        for b in &self.buckets {
            let shard = b.range.start + b.shard.start..b.range.start + b.shard.end;
            // Zeros already; released again for the pages the per-parameter releases kept
            // at parameter boundaries.
            pages::release(&mut grads[b.range.start..shard.start]);
            pages::release(&mut grads[shard.end..b.range.end]);
            let local = b.local_start..b.local_start + shard.len();
            grads[shard].copy_from_slice(&self.accum[local]);
        }
        Ok(self.waited)
    }

    /// Adds the reduced bucket `b` (its shard part) into the accumulator.
    fn accumulate(&mut self, b: usize, reduced: &[f32]) {
        let bucket = &self.buckets[b];
        let local = &mut self.accum[bucket.local_start..bucket.local_start + bucket.shard.len()];
        for (a, r) in local.iter_mut().zip(&reduced[bucket.shard.clone()]) {
            *a += r;
        }
    }

    /// Reduce-scatters the staged bucket `b` (now, or on the progress thread).
    fn reduce(&mut self, b: usize) -> std::result::Result<(), String> {
        let mut staged = std::mem::take(&mut self.buckets[b].staging);
        if let Some(thread) = self.thread {
            self.pending
                .push((b, thread.reduce_scatter_in_place(staged, ReduceOp::Sum)));
            return Ok(());
        }
        let start = Instant::now();
        if self.narrow {
            let mut narrow: Vec<bf16> = staged.iter().map(|&g| bf16::from_f32(g)).collect();
            self.comm
                .reduce_scatter_in_place(&mut narrow, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            let shard = self.buckets[b].shard.clone();
            for (g, n) in staged[shard.clone()].iter_mut().zip(&narrow[shard]) {
                *g = n.to_f32();
            }
        } else {
            self.comm
                .reduce_scatter_in_place(&mut staged, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
        }
        self.waited += start.elapsed();
        self.accumulate(b, &staged);
        Ok(())
    }
}

impl GradReady for GradShards<'_> {
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
            pages::release(grads[i]);
            bucket.waiting_for -= 1;
            if bucket.waiting_for == 0 {
                // Ready for the next micro-batch (or model chunk) to fill again.
                bucket.waiting_for = bucket.params;
                bucket.completed += 1;
                if let Err(e) = self.reduce(b) {
                    self.error.get_or_insert(e);
                }
            }
        }
    }
}
