//! Optimizer-state offload with chunks (Pai-Megatron-Patch's chunk manager and HybridAdam;
//! DeepSpeed ZeRO-Infinity's optimizer swapper, on this machine's memory tiers): Adam's
//! moments and the fp32 master weights are packed into chunks ([`ChunkLayout`]: next-fit,
//! the chunk size with the least internal fragmentation), each chunk living in the fast tier
//! (RAM) or the slow tier (a file under `offload_path`), and the step updates every chunk
//! with the same kernel wherever it lives, reading slow chunks ahead and writing them behind
//! ([`ChunkStore`]). The arithmetic is the in-RAM optimizer's, element for element: any
//! placement trains bit-identically.
//!
//! Placement ([`OffloadPolicy`]): `Static` keeps a fraction of the chunks in the slow tier
//! (Megatron's `--optimizer-offload-fraction`, the first chunks, as `HybridDeviceOptimizer`
//! offloads the first parameters); `Auto` keeps as many chunks in RAM as a memory budget
//! leaves after the model state outside the optimizer and the measured peak of everything
//! else, re-placing them when the budget or the peak changes (Pai-Megatron-Patch's auto
//! policy, which tracks non-model memory per iteration).

mod layout;
mod store;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use layout::ChunkLayout;
pub use store::{BUFFERS, ChunkPlanes, ChunkStore, Tier};

use crate::error::{Result, config_err};

/// Where the optimizer state's chunks live (`optimizer.optimizer_offload_policy`).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub enum OffloadPolicy {
    /// Everything in RAM.
    #[default]
    None,
    /// `fraction` of the chunks (rounded up) in the slow tier, the first ones
    /// (`optimizer.optimizer_offload_fraction`).
    Static {
        /// In `[0, 1]`.
        fraction: f64,
    },
    /// As many chunks in RAM as `budget_bytes` allows beside the rest of the process's
    /// memory (`optimizer.offload_memory_budget_gib`); see [`chunks_in_budget`].
    Auto {
        /// The process's memory budget in bytes.
        budget_bytes: u64,
    },
}

/// The offload settings of an optimizer.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct OffloadConfig {
    /// Placement policy.
    pub policy: OffloadPolicy,
    /// Directory of the slow tier's file (`optimizer.offload_path`); required unless the
    /// policy is `None`.
    pub path: Option<PathBuf>,
    /// Elements per chunk and state array; `None`: chosen for least fragmentation.
    pub chunk_size: Option<usize>,
}

impl OffloadConfig {
    /// Checks the fields.
    ///
    /// # Errors
    /// [`OptimError::Config`](crate::OptimError::Config) naming `optimizer_offload_fraction`
    /// (outside `[0, 1]`), `offload_path` (missing) or `offload_chunk_size` (0).
    pub fn validate(&self) -> Result<()> {
        if let OffloadPolicy::Static { fraction } = self.policy
            && !(0.0..=1.0).contains(&fraction)
        {
            return Err(config_err(format!(
                "optimizer_offload_fraction must be in [0, 1], got {fraction}"
            )));
        }
        if self.policy != OffloadPolicy::None && self.path.is_none() {
            return Err(config_err(
                "offload_path is required to offload the optimizer state",
            ));
        }
        if self.chunk_size == Some(0) {
            return Err(config_err("offload_chunk_size must be at least 1"));
        }
        Ok(())
    }

    /// Chunks in the slow tier out of `n` before the first step: none, a static policy's
    /// fraction (rounded up), or all of them for the auto policy's warmup step (which
    /// measures the memory the rest of the step needs).
    pub fn initial_slow_chunks(&self, n: usize) -> usize {
        match self.policy {
            OffloadPolicy::None => 0,
            OffloadPolicy::Static { fraction } => ((fraction * n as f64).ceil() as usize).min(n),
            OffloadPolicy::Auto { .. } => n,
        }
    }
}

/// The auto policy's placement: of `chunk_bytes` (each chunk's state bytes, in order), how
/// many of the **last** chunks fit in RAM within `budget` once `other` bytes (the model
/// state outside the optimizer plus the peak of everything else) are taken; returns the
/// number of leading chunks to offload.
pub fn chunks_in_budget(chunk_bytes: &[u64], budget: u64, other: u64) -> usize {
    let mut left = budget.saturating_sub(other);
    let mut fast = 0;
    for &b in chunk_bytes.iter().rev() {
        if b > left {
            break;
        }
        left -= b;
        fast += 1;
    }
    chunk_bytes.len() - fast
}
