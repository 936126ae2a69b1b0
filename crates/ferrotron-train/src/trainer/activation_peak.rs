//! The activation peak of a step whose passes keep several forwards for later backwards: a
//! pipeline schedule's micro-batches in flight, ZeRO-3's and `overlap_param_gather`'s layer
//! groups. At any time the rank holds what the kept forwards hold for their backwards plus
//! what the running pass holds; the peak is the most of that at any time, as the activation
//! ledger of one whole forward and backward counts it (the auto offload policy's non-model
//! memory, `trainer/offload.rs`).

use super::Result;
use ferrotron_model::{GptModel, GradReady, StageForward, TrainBatch};

/// Activation bytes held by kept forwards, and the peak so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct ActivationPeak {
    held: u128,
    peak: u128,
}

impl ActivationPeak {
    /// `forward` ran (on top of what is kept) and is kept for its backward.
    pub(super) fn forward(&mut self, forward: &StageForward) {
        self.kept(forward.activation_peak_bytes(), forward.activation_bytes());
    }

    /// Runs the backward of the kept `forward` through `model` into `grads` from `dout`
    /// ([`GptModel::stage_backward_with`], telling `ready`), recording its peak; returns the
    /// gradient of the forward's input.
    ///
    /// # Errors
    /// What the backward reports.
    pub(super) fn backward(
        &mut self,
        model: &GptModel,
        batch: &TrainBatch,
        forward: StageForward,
        (grads, dout): (&mut [&mut [f32]], Option<Vec<f32>>),
        ready: &mut (dyn GradReady + Send),
    ) -> Result<Option<Vec<f32>>> {
        let held = forward.activation_bytes();
        let backward = model.stage_backward_with(batch, forward, grads, dout, ready)?;
        self.released(held, backward.activation_peak_bytes);
        Ok(backward.input_grad)
    }

    /// A forward peaking at `peak` bytes ran and keeps `held`.
    fn kept(&mut self, peak: u128, held: u128) {
        self.peak = self.peak.max(self.held + peak);
        self.held += held;
    }

    /// The backward of a forward that kept `held` bytes ran, peaking at `peak` (its pass's
    /// peak, from the forward's kept bytes up).
    fn released(&mut self, held: u128, peak: u128) {
        self.held = self.held.saturating_sub(held);
        self.peak = self.peak.max(self.held + peak);
    }

    /// The most bytes held at once.
    pub(super) fn peak(&self) -> u128 {
        self.peak
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The peak of passes `(forward peak, kept bytes, backward peak)` run in `order`
    /// (`(true, i)`: pass `i`'s forward, `(false, i)`: its backward).
    fn run(passes: &[(u128, u128, u128)], order: &[(bool, usize)]) -> u128 {
        let mut peak = ActivationPeak::default();
        for &(forward, i) in order {
            let (f, held, b) = passes[i];
            match forward {
                true => peak.kept(f, held),
                false => peak.released(held, b),
            }
        }
        peak.peak()
    }

    #[test]
    fn kept_forwards_add_to_the_running_pass() {
        // 1F1B warmup of two micro-batches: F0 F1 B0 B1, each forward peaking at 10 and
        // keeping 6, each backward peaking at 8 over its own kept 6.
        let passes = [(10, 6, 8), (10, 6, 8)];
        let order = [(true, 0), (true, 1), (false, 0), (false, 1)];
        // F1 runs on top of F0's 6: 16; B0 runs with F1's 6 kept: 14.
        assert_eq!(run(&passes, &order), 16);
        // One at a time: the single pass's peak.
        let order = [(true, 0), (false, 0), (true, 1), (false, 1)];
        assert_eq!(run(&passes, &order), 10);
        // A backward re-running a layer (recompute) can peak above its forward.
        assert_eq!(run(&[(10, 2, 12), (10, 2, 8)], &order), 12);
        // Layer groups of one pass (ZeRO-3): forwards kept in turn, backwards in reverse.
        let groups = [(4, 3, 4), (5, 3, 5)];
        let order = [(true, 0), (true, 1), (false, 1), (false, 0)];
        assert_eq!(run(&groups, &order), 8);
    }
}
