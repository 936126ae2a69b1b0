//! ZeRO-3 parameters (Megatron-FSDP's `optim_grads_params`, PyTorch FSDP's `FULL_SHARD`):
//! between uses a rank holds only its shard of every bucket of the parameter storage — the
//! shard its optimizer updates — and the rest of the storage's pages are given back to the
//! system ([`ferrotron_tensor::Storage::release`]; the model's views keep pointing at them,
//! as FSDP keeps a parameter whose storage it resized to 0).
//!
//! A micro-batch runs one layer group ([`GptModel::layer_groups`]) at a time: before a
//! group's forward its buckets are all-gathered (Megatron-FSDP's pre-forward hook) while the
//! next group's gathers are already submitted to the progress thread (prefetch), and after
//! it they are released unless the next group reads them; the backward walks the groups in
//! reverse, gathering each again (a full-recompute group re-runs its forward inside its own
//! backward, so it finds its parameters there) and prefetching the one before. A group
//! reads the buckets of its own parameters, the embedding's on the first group and the
//! head's on the last (with a tied output layer, the embedding's again). At most two
//! groups' parameters are whole at a time, as in Megatron-FSDP.
//!
//! Outside a training pass the weights are gathered whole by
//! [`Trainer::finish_param_gather`](super::Trainer::finish_param_gather) (validation,
//! checkpoints, the end of training); the next pass releases them again as it goes.

use std::ops::Range;
use std::time::{Duration, Instant};

use ferrotron_comm::{AsyncComm, CommHandle, Communicator};
use ferrotron_model::{GptModel, GradReady, LossStats, MoeLosses, StageForward, TrainBatch};
use ferrotron_optim::{ParamAndGradBuffer, ParamId};
use ferrotron_tensor::Storage;

use super::activation_peak::ActivationPeak;
use super::data_parallel::comm_err;
use super::param_gather::install_gathered;
use super::{Result, TrainError};

/// Where a bucket's values are.
enum State {
    /// Only this rank's shard is held; the rest reads as zeros.
    Sharded,
    /// The all-gather is on the progress thread.
    InFlight(CommHandle<Vec<u8>>),
    /// The whole bucket holds the current values.
    Gathered,
}

/// One bucket of the parameter storage.
struct Bucket {
    /// Element range in the storage.
    range: Range<usize>,
    /// This rank's shard, elements, absolute.
    shard: Range<usize>,
    state: State,
}

/// The sharded parameter storage of a ZeRO-3 trainer and which buckets each layer group
/// reads.
pub(super) struct ParamShards {
    buckets: Vec<Bucket>,
    /// [`GptModel::layer_groups`] of the model.
    groups: Vec<Range<usize>>,
    /// Per group: the buckets its forward and backward read, ascending.
    reads: Vec<Vec<usize>>,
}

impl ParamShards {
    /// The buckets of `buffer` (laid out with FSDP units, see
    /// [`super::sharding::fsdp_units`]) sharded over `size` ranks as rank `rank`; every
    /// bucket starts whole ([`State::Gathered`]: the storage holds the broadcast weights).
    pub(super) fn new(
        model: &GptModel,
        buffer: &ParamAndGradBuffer,
        rank: usize,
        size: usize,
    ) -> ParamShards {
        let buckets = buffer
            .buckets()
            .iter()
            .map(|b| Bucket {
                range: b.start..b.end,
                shard: b.shard_range(rank, size),
                state: State::Gathered,
            })
            .collect();
        let bucket_of = |i: usize| buffer.info(ParamId(i)).bucket_id;
        let groups = model.layer_groups();
        let last = groups.len().saturating_sub(1);
        let output = model.layout().output_weight().map(|id| id.index());
        let reads = groups
            .iter()
            .enumerate()
            .map(|(g, layers)| {
                let mut reads: Vec<usize> = model
                    .part_params(layers.clone())
                    .chain(output.filter(|_| g == last))
                    .filter_map(bucket_of)
                    .collect();
                reads.sort_unstable();
                reads.dedup();
                reads
            })
            .collect();
        ParamShards {
            buckets,
            groups,
            reads,
        }
    }

    /// Whether every bucket holds its current values.
    pub(super) fn is_whole(&self) -> bool {
        self.buckets
            .iter()
            .all(|b| matches!(b.state, State::Gathered))
    }

    /// Gathers every bucket (the weights whole in the model): those in flight from their
    /// thread, the others in place over `comm` (the data-parallel group; no staging copy).
    /// Returns the time it took.
    ///
    /// # Errors
    /// A failed all-gather.
    pub(super) fn gather_all(
        &mut self,
        thread: Option<&AsyncComm>,
        comm: &dyn Communicator,
        model: &mut GptModel,
    ) -> Result<Duration> {
        let start = Instant::now();
        let in_flight: Vec<usize> = (0..self.buckets.len())
            .filter(|&b| matches!(self.buckets[b].state, State::InFlight(_)))
            .collect();
        self.gather(&in_flight, &[], thread, model)?;
        with_storage(model, |storage| {
            let elem = storage.dtype().size_in_bytes();
            for bucket in &mut self.buckets {
                if matches!(bucket.state, State::Sharded) && comm.size() > 1 {
                    let r = &bucket.range;
                    let bytes = &mut storage.as_bytes_mut()[r.start * elem..r.end * elem];
                    comm.all_gather_bytes(bytes).map_err(comm_err)?;
                }
                bucket.state = State::Gathered;
            }
            Ok::<(), TrainError>(())
        })??;
        Ok(start.elapsed())
    }

    /// Releases every bucket but this rank's shards (after an optimizer step, whose update
    /// the other ranks' parts do not have yet).
    ///
    /// # Errors
    /// The storage is lent out (a bug).
    pub(super) fn release_all(&mut self, model: &mut GptModel) -> Result<()> {
        let all: Vec<usize> = (0..self.buckets.len()).collect();
        self.release(&all, &[], model)
    }

    /// Makes the buckets `need` whole: submits their gathers and those of `prefetch`
    /// (where not whole or in flight yet), then waits for `need`'s and writes them into the
    /// storage. Without a progress thread (one rank) every bucket is whole already. Returns
    /// the time waited.
    fn gather(
        &mut self,
        need: &[usize],
        prefetch: &[usize],
        comm: Option<&AsyncComm>,
        model: &mut GptModel,
    ) -> Result<Duration> {
        let Some(comm) = comm else {
            // One rank: its shard is the whole bucket.
            for &b in need {
                self.buckets[b].state = State::Gathered;
            }
            return Ok(Duration::ZERO);
        };
        with_storage(model, |storage| {
            for &b in need.iter().chain(prefetch) {
                self.submit(b, comm, storage);
            }
            let start = Instant::now();
            for &b in need {
                let bucket = &mut self.buckets[b];
                if let State::InFlight(handle) =
                    std::mem::replace(&mut bucket.state, State::Gathered)
                {
                    let gathered = handle.wait().map_err(comm_err)?;
                    install_gathered(storage, b, bucket.range.clone(), &gathered)?;
                }
            }
            Ok(start.elapsed())
        })?
    }

    /// Submits the all-gather of bucket `b` unless it is whole or in flight: a zeroed
    /// bucket-sized buffer with this rank's shard in place (never reading the released
    /// pages).
    fn submit(&mut self, b: usize, comm: &AsyncComm, storage: &Storage) {
        let bucket = &mut self.buckets[b];
        if !matches!(bucket.state, State::Sharded) {
            return;
        }
        let elem = storage.dtype().size_in_bytes();
        let (r, s) = (&bucket.range, &bucket.shard);
        let mut staged = vec![0u8; r.len() * elem];
        staged[(s.start - r.start) * elem..(s.end - r.start) * elem]
            .copy_from_slice(&storage.as_bytes()[s.start * elem..s.end * elem]);
        bucket.state =
            State::InFlight(comm.submit(move |c| c.all_gather_bytes(&mut staged).map(|()| staged)));
    }

    /// Releases the buckets of `done` that are not in `keep` (all but this rank's shard).
    fn release(&mut self, done: &[usize], keep: &[usize], model: &mut GptModel) -> Result<()> {
        with_storage(model, |storage| {
            for &b in done.iter().filter(|b| !keep.contains(b)) {
                let bucket = &mut self.buckets[b];
                if let State::InFlight(handle) =
                    std::mem::replace(&mut bucket.state, State::Sharded)
                {
                    // Its values are not needed; the collective must still complete.
                    handle.wait().map_err(comm_err)?;
                }
                storage.release(bucket.range.start..bucket.shard.start);
                storage.release(bucket.shard.end..bucket.range.end);
            }
            Ok(())
        })?
    }

    /// One micro-batch's forward and backward group by group, each group's buckets whole
    /// only around its passes (see the module doc); the same values as
    /// [`GptModel::forward_backward_with`]. Returns the loss and the time waited for
    /// gathers.
    ///
    /// # Errors
    /// A model or communication failure.
    pub(super) fn forward_backward(
        &mut self,
        comm: Option<&AsyncComm>,
        model: &mut GptModel,
        buffer: &mut ParamAndGradBuffer,
        batch: &TrainBatch,
        scale: f32,
        ready: &mut (dyn GradReady + Send),
    ) -> Result<(LossStats, Duration)> {
        let mut peak = ActivationPeak::default();
        let (forward, mut waited) = self.forward(comm, model, batch, None, scale, &mut peak)?;
        let mut loss = forward.loss.ok_or_else(|| {
            TrainError::Config("optim_grads_params: the model computed no loss".into())
        })?;
        // Every group's MoE layers, not only the last group's.
        loss.moe = forward.moe;
        let io = (None, &mut peak);
        let (_, w) = self.backward(comm, model, buffer, batch, forward, io, ready)?;
        waited += w;
        loss.activation_peak_bytes = peak.peak();
        Ok((loss, waited))
    }

    /// One micro-batch's forward through the model (a pipeline stage of one chunk), group
    /// by group, from token ids (`input = None`) or the previous stage's output; each
    /// group's buckets gathered before it (the next group's prefetched) and released after
    /// unless the next group reads them; each group's forward joins `peak`. Returns the
    /// forward and the time waited.
    ///
    /// # Errors
    /// A model or communication failure.
    pub(super) fn forward(
        &mut self,
        comm: Option<&AsyncComm>,
        model: &mut GptModel,
        batch: &TrainBatch,
        input: Option<Vec<f32>>,
        scale: f32,
        peak: &mut ActivationPeak,
    ) -> Result<(UnitForward, Duration)> {
        let n = self.groups.len();
        let mut forward = UnitForward {
            states: Vec::with_capacity(n),
            loss: None,
            moe: MoeLosses::default(),
        };
        let (mut x, mut waited) = (input, Duration::ZERO);
        for g in 0..n {
            let next = self.reads.get(g + 1).cloned().unwrap_or_default();
            waited += self.gather(&self.reads[g].clone(), &next, comm, model)?;
            let mut state = model.part_forward(batch, self.groups[g].clone(), x.take(), scale)?;
            peak.forward(&state);
            forward.moe.add(&state.moe_losses());
            forward.loss = state.loss();
            if g + 1 < n {
                x = Some(state.take_output());
                self.release(&self.reads[g].clone(), &next, model)?;
            }
            forward.states.push(state);
        }
        Ok((forward, waited))
    }

    /// The backward of a [`ParamShards::forward`]: the groups in reverse, each gathered
    /// again (the one before prefetched) and released after; accumulates into `buffer`'s
    /// gradients from `dout` (none on the last stage), telling `ready`; each group's
    /// backward joins `peak`. Returns the gradient of the input (`None` on the first stage)
    /// and the time waited.
    ///
    /// # Errors
    /// A model or communication failure.
    #[allow(clippy::too_many_arguments)] // the backward's own inputs and where it writes
    pub(super) fn backward(
        &mut self,
        comm: Option<&AsyncComm>,
        model: &mut GptModel,
        buffer: &mut ParamAndGradBuffer,
        batch: &TrainBatch,
        forward: UnitForward,
        (mut dout, peak): (Option<Vec<f32>>, &mut ActivationPeak),
        ready: &mut (dyn GradReady + Send),
    ) -> Result<(Option<Vec<f32>>, Duration)> {
        let mut waited = Duration::ZERO;
        for (g, state) in forward.states.into_iter().enumerate().rev() {
            let before = g
                .checked_sub(1)
                .map(|p| self.reads[p].clone())
                .unwrap_or_default();
            waited += self.gather(&self.reads[g].clone(), &before, comm, model)?;
            let mut grads = buffer.grad_slices_mut();
            dout = peak.backward(model, batch, state, (&mut grads, dout), ready)?;
            self.release(&self.reads[g].clone(), &before, model)?;
        }
        Ok((dout, waited))
    }
}

/// One micro-batch's forward run group by group ([`ParamShards::forward`]), kept for its
/// backward.
pub(super) struct UnitForward {
    states: Vec<StageForward>,
    /// The loss (last stage only).
    loss: Option<LossStats>,
    /// Every group's MoE balancing losses.
    moe: MoeLosses,
}

impl UnitForward {
    /// The loss (last stage only), without the MoE losses ([`UnitForward::moe_losses`]).
    pub(super) fn loss(&self) -> Option<LossStats> {
        self.loss
    }

    /// The balancing losses of every group's MoE layers.
    pub(super) fn moe_losses(&self) -> MoeLosses {
        self.moe
    }

    /// The output `[local rows, h]` for the next stage (empty on the last stage, and after
    /// the first call).
    pub(super) fn take_output(&mut self) -> Vec<f32> {
        self.states
            .last_mut()
            .map(StageForward::take_output)
            .unwrap_or_default()
    }
}

/// Runs `f` on the model's parameter storage (taken out of its table and put back).
fn with_storage<R>(model: &mut GptModel, f: impl FnOnce(&mut Storage) -> R) -> Result<R> {
    let table = model.param_table_mut();
    let mut storage = table.take_storage()?;
    let out = f(&mut storage);
    table.restore_storage(storage)?;
    Ok(out)
}
