//! The MoE layers' balancing losses as Megatron logs them (`track_moe_metrics`,
//! `megatron/core/transformer/moe/moe_utils.py`): each layer's loss over its coefficient,
//! averaged over the MoE layers, the micro-batches and the data-parallel ranks of a step
//! (summed over the pipeline stages that hold the layers first), then over the log interval.

use super::{Result, Trainer};
use ferrotron_model::{LoadBalancing, MoeLosses};
use serde::{Deserialize, Serialize};
use std::fmt;

/// One step's (or interval's) MoE losses, each logged when the run has it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MoeMetrics {
    /// Mean load-balancing loss over the coefficient (`load_balancing_loss`; 1 at an even
    /// load for `aux_loss`); `None` without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_balancing_loss: Option<f64>,
    /// Mean router z-loss over its coefficient (`z_loss`); `None` without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub z_loss: Option<f64>,
}

impl MoeMetrics {
    /// `self + other`, fieldwise (an interval's sums).
    pub fn add(&mut self, other: &MoeMetrics) {
        let sum = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0.0) + b.unwrap_or(0.0)),
        };
        self.load_balancing_loss = sum(self.load_balancing_loss, other.load_balancing_loss);
        self.z_loss = sum(self.z_loss, other.z_loss);
    }

    /// `self / n` (an interval's means).
    pub fn mean(&self, n: u64) -> MoeMetrics {
        let n = n.max(1) as f64;
        MoeMetrics {
            load_balancing_loss: self.load_balancing_loss.map(|v| v / n),
            z_loss: self.z_loss.map(|v| v / n),
        }
    }

    /// The TensorBoard scalars (Megatron's tags).
    pub fn scalars(&self) -> Vec<(&'static str, f64)> {
        let tags = [
            ("load_balancing_loss", self.load_balancing_loss),
            ("z_loss", self.z_loss),
        ];
        tags.into_iter()
            .filter_map(|(t, v)| Some((t, v?)))
            .collect()
    }
}

impl fmt::Display for MoeMetrics {
    /// ` load_balancing_loss: 1.012345E+00 | z_loss: ... |` (Megatron's
    /// `total_loss_dict` entries, `{:.6E}`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (tag, v) in self.scalars() {
            write!(f, " {tag}: {} |", super::format_sci(v, 6))?;
        }
        Ok(())
    }
}

impl Trainer {
    /// A step's [`MoeMetrics`] from this rank's `local` sums (its micro-batches, and its
    /// stage's layers summed over the pipeline already): the sums over the data-parallel
    /// ranks divided by the layer passes they count. `None` for a model without MoE layers.
    /// Collective over the data-parallel group.
    pub(super) fn moe_metrics(&self, local: MoeLosses) -> Result<Option<MoeMetrics>> {
        let Some(moe) = &self.model.config().moe else {
            return Ok(None);
        };
        let mut v = [local.load_balancing_loss, local.z_loss, local.layers];
        self.dp.sum(&mut v)?;
        let per = |x: f64| x / v[2].max(1.0);
        Ok(Some(MoeMetrics {
            load_balancing_loss: (moe.load_balancing_type != LoadBalancing::None)
                .then(|| per(v[0])),
            z_loss: moe.z_loss_coeff.map(|_| per(v[1])),
        }))
    }
}
