//! The optimizer's cross-rank statistics (grad-norm partials, the fp16 inf flag) over the
//! groups whose ranks hold different parts of the gradients
//! ([`DataParallel::stats_reduce`](super::DataParallel) picks them).

use ferrotron_comm::{Collectives, Communicator, ReduceOp};
use ferrotron_optim::{GradStatsReduce, OptimError};

/// [`GradStatsReduce`] over the groups whose ranks hold different parts of the gradients.
pub(super) struct StatsReduce<'a> {
    comms: Vec<&'a dyn Communicator>,
}

impl<'a> StatsReduce<'a> {
    /// Sums / maxima over each of `comms` in turn.
    pub(super) fn new(comms: Vec<&'a dyn Communicator>) -> Self {
        StatsReduce { comms }
    }

    fn reduce(&self, local: f64, op: ReduceOp) -> ferrotron_optim::Result<f64> {
        let mut value = local;
        for c in &self.comms {
            value = c
                .all_reduce_scalar(value, op)
                .map_err(|e| OptimError::Comm(e.to_string()))?;
        }
        Ok(value)
    }
}

impl GradStatsReduce for StatsReduce<'_> {
    fn all_reduce_sum(&mut self, local: f64) -> ferrotron_optim::Result<f64> {
        self.reduce(local, ReduceOp::Sum)
    }
    fn all_reduce_max(&mut self, local: f64) -> ferrotron_optim::Result<f64> {
        self.reduce(local, ReduceOp::Max)
    }
}
