//! The optimizer offload during training ([`ferrotron_optim::offload`]): the auto policy's
//! placement between steps, and what a step reports about it.
//!
//! Auto policy (Pai-Megatron-Patch's, on this machine's tiers): the rank's memory budget
//! holds the model state outside the optimizer (parameters and the f32 gradient buffer),
//! the peak of non-model memory (the activations a pass holds for its backward, logits
//! included, as the activation ledger measures them: the largest of any step so far) and as
//! many of the optimizer's chunks as fit — the last ones; the first chunks go to the slow
//! tier. The first step runs with every chunk offloaded (the warmup that measures the peak);
//! after each step the chunks are re-placed, so a changed budget
//! ([`Trainer::set_offload_budget`]) or a higher peak moves chunks at the next step.

use super::{Result, TrainError, Trainer};
use ferrotron_optim::offload::{OffloadPolicy, chunks_in_budget};

/// The offloaded optimizer state after a step (in a log line: after the interval's last
/// step, `moved_bytes` the mean per iteration).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OffloadStats {
    /// Chunks of the optimizer state.
    pub chunks: usize,
    /// Chunks in the slow tier.
    pub slow_chunks: usize,
    /// Bytes of optimizer state in the slow tier.
    pub offloaded_bytes: u64,
    /// Bytes read from and written to the slow tier during the step (and the placement
    /// after it).
    pub moved_bytes: u64,
}

impl Trainer {
    /// After a step whose passes held at most `activation_peak` bytes: the auto policy's
    /// placement for the running peak, then the step's offload statistics (`None` without
    /// offloading).
    ///
    /// # Errors
    /// An I/O error moving chunks.
    pub(super) fn after_step_offload(
        &mut self,
        activation_peak: u128,
    ) -> Result<Option<OffloadStats>> {
        self.non_model_peak = self.non_model_peak.max(activation_peak as u64);
        let adam = self.optimizer.adam();
        let policy = adam.offload().policy;
        if policy == OffloadPolicy::None {
            return Ok(None);
        }
        if let OffloadPolicy::Auto { budget_bytes } = policy {
            let other = self.model.param_table().storage_bytes() as u64
                + std::mem::size_of_val(self.buffer.grads()) as u64
                + self.non_model_peak;
            let bytes: Vec<u64> = adam.chunks().chunk_bytes().collect();
            let slow = chunks_in_budget(&bytes, budget_bytes, other);
            self.optimizer.adam_mut().place_chunks(slow)?;
        }
        let adam = self.optimizer.adam_mut();
        let moved_bytes = adam.take_moved_bytes();
        let store = adam.chunks();
        Ok(Some(OffloadStats {
            chunks: store.layout().chunks().len(),
            slow_chunks: store.slow_chunks(),
            offloaded_bytes: store.slow_bytes(),
            moved_bytes,
        }))
    }

    /// The largest activation peak of any step so far, in bytes: the non-model memory the
    /// auto policy keeps room for (under pipeline parallelism this stage's, with the
    /// micro-batches its schedule keeps in flight).
    pub fn activation_peak_bytes(&self) -> u64 {
        self.non_model_peak
    }

    /// Changes the auto policy's memory budget to `bytes`; the chunks move after the next
    /// step.
    ///
    /// # Errors
    /// [`TrainError::Config`] when the optimizer is not under the auto policy.
    pub fn set_offload_budget(&mut self, bytes: u64) -> Result<()> {
        let offload = self.optimizer.adam().offload().clone();
        match offload.policy {
            OffloadPolicy::Auto { .. } => {
                self.optimizer
                    .adam_mut()
                    .set_offload_policy(OffloadPolicy::Auto {
                        budget_bytes: bytes,
                    });
                Ok(())
            }
            _ => Err(TrainError::Config(
                "an offload budget needs optimizer_offload_policy = \"auto\"".into(),
            )),
        }
    }
}

impl std::fmt::Display for OffloadStats {
    /// ` offloaded: 12.34 GiB (100/100 chunks) | moved per iteration: 24.68 GiB |`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        write!(
            f,
            " offloaded: {:.2} GiB ({}/{} chunks) | moved per iteration: {:.2} GiB |",
            gib(self.offloaded_bytes),
            self.slow_chunks,
            self.chunks,
            gib(self.moved_bytes)
        )
    }
}
