//! `overlap_param_gather` (Megatron-Core `DistributedOptimizer` with
//! `overlap_param_gather`, the Megatron-LLaMA `OverlappedDistributedOptimizer` idea): after
//! the optimizer step each rank has updated only its shard of every bucket; instead of
//! all-gathering the buckets before the step returns, [`ParamGather::launch`] dispatches
//! their all-gathers on the data-parallel progress thread in the order the next forward
//! needs them, and the next step's first micro-batch runs its forward one layer group at a
//! time ([`GptModel::part_forward`]), first making that group's parameters current
//! ([`ParamGather::install_through`], Megatron's forward pre-hook). The gathers of later
//! buckets thus run while earlier layers compute.
//!
//! The buffer holds parameters in reverse order, so the embedding sits in the last bucket:
//! buckets are dispatched and waited for from the last to the first. The values are the
//! same as with the synchronous gather; only the waiting moves.

use std::ops::Range;
use std::time::{Duration, Instant};

use ferrotron_comm::{AsyncComm, CommHandle};
use ferrotron_model::GptModel;
use ferrotron_optim::{ParamAndGradBuffer, ParamId};

use super::data_parallel::{BucketComms, comm_err};
use super::step::with_params_in_buffer;
use super::{Result, TrainError};

/// The in-flight parameter all-gathers of one optimizer step.
pub(super) struct ParamGather {
    /// Per bucket: its gather, until installed.
    pending: Vec<Option<CommHandle<Vec<u8>>>>,
    /// Per parameter: its bucket (`None` when frozen).
    param_bucket: Vec<Option<usize>>,
    /// Time spent waiting for gathers so far.
    waited: Duration,
}

impl ParamGather {
    /// Dispatches the all-gather of every bucket's parameters (this rank's updated shard in
    /// place, the others' to be filled in) on its group's thread in `comms`, the last bucket
    /// first.
    pub(super) fn launch(comms: BucketComms<'_>, buffer: &mut ParamAndGradBuffer) -> ParamGather {
        let ranges: Vec<(Range<usize>, &AsyncComm)> = buffer
            .buckets()
            .iter()
            .map(|b| (b.start..b.end, comms.of(b)))
            .collect();
        let n = buffer.params().len();
        let param_bucket = (0..n).map(|i| buffer.info(ParamId(i)).bucket_id).collect();
        let (params, _) = buffer.data_mut();
        let elem = params.dtype().size_in_bytes();
        let bytes = params.as_bytes_mut();
        let mut pending: Vec<Option<CommHandle<Vec<u8>>>> = ranges.iter().map(|_| None).collect();
        for (b, (r, comm)) in ranges.iter().enumerate().rev() {
            let mut staged = bytes[r.start * elem..r.end * elem].to_vec();
            pending[b] =
                Some(comm.submit(move |c| c.all_gather_bytes(&mut staged).map(|()| staged)));
        }
        ParamGather {
            pending,
            param_bucket,
            waited: Duration::ZERO,
        }
    }

    /// Makes parameters `0..end` (order of [`GptModel::parameters`]) current in `buffer`
    /// and `model`: waits for every bucket holding one of them that has not arrived yet,
    /// then writes its parameters into the storage the model reads.
    ///
    /// # Errors
    /// A failed all-gather, or a gathered bucket of the wrong size.
    pub(super) fn install_through(
        &mut self,
        end: usize,
        buffer: &mut ParamAndGradBuffer,
        model: &mut GptModel,
    ) -> Result<()> {
        let mut needed: Vec<usize> = self.param_bucket[..end.min(self.param_bucket.len())]
            .iter()
            .flatten()
            .copied()
            .filter(|&b| self.pending[b].is_some())
            .collect();
        needed.sort_unstable_by(|a, b| b.cmp(a));
        needed.dedup();
        for b in needed {
            let Some(handle) = self.pending[b].take() else {
                continue;
            };
            let start = Instant::now();
            let gathered = handle.wait().map_err(comm_err)?;
            self.waited += start.elapsed();
            install_bucket(buffer, model, b, &gathered)?;
        }
        Ok(())
    }

    /// Installs every bucket still in flight; returns the total time spent waiting.
    ///
    /// # Errors
    /// As [`ParamGather::install_through`].
    pub(super) fn finish(
        mut self,
        buffer: &mut ParamAndGradBuffer,
        model: &mut GptModel,
    ) -> Result<Duration> {
        self.install_through(self.param_bucket.len(), buffer, model)?;
        Ok(self.waited)
    }
}

/// Writes gathered bucket `b` into the parameter storage (the model's, lent to the buffer
/// for the copy).
fn install_bucket(
    buffer: &mut ParamAndGradBuffer,
    model: &mut GptModel,
    b: usize,
    gathered: &[u8],
) -> Result<()> {
    let range = buffer.buckets()[b].start..buffer.buckets()[b].end;
    with_params_in_buffer(model, buffer, |buffer| {
        let (storage, _) = buffer.data_mut();
        install_gathered(storage, b, range, gathered)
    })
}

/// Writes bucket `b`'s all-gathered bytes over its element `range` of `storage`.
///
/// # Errors
/// A gather of another size than the range (a bug).
pub(super) fn install_gathered(
    storage: &mut ferrotron_tensor::Storage,
    b: usize,
    range: Range<usize>,
    gathered: &[u8],
) -> Result<()> {
    let elem = storage.dtype().size_in_bytes();
    let dst = &mut storage.as_bytes_mut()[range.start * elem..range.end * elem];
    if dst.len() != gathered.len() {
        return Err(TrainError::Comm(format!(
            "parameter bucket {b}: gathered {} bytes, expected {}",
            gathered.len(),
            dst.len()
        )));
    }
    dst.copy_from_slice(gathered);
    Ok(())
}
