//! Megatron-Core's `global_aux_loss` state (`router.py` `_apply_global_aux_loss`): the
//! load-balancing loss taken with the **global batch's** expert counts — each micro-batch's
//! counts summed over the data-parallel ranks, averaged over the step's micro-batches so far
//! (`global_tokens_per_expert / ga_steps`) — and the global token total (the micro-batch's
//! tokens times the data-parallel size). As Megatron's router keeps these in the module, the
//! model keeps them until the trainer resets them after each step.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use ferrotron_comm::{Collectives, Communicator, ReduceOp};

use crate::module::ParamId;
use crate::{GptModel, ModelError, Result};

/// The running global-batch counts of a model's MoE layers (keyed by their routers) and the
/// group they are summed over. A clone shares the group and starts with no counts.
#[derive(Default)]
pub(crate) struct GlobalAux {
    group: Option<Arc<dyn Communicator>>,
    sums: Mutex<BTreeMap<ParamId, (Vec<f64>, u32)>>,
}

impl Clone for GlobalAux {
    fn clone(&self) -> Self {
        GlobalAux {
            group: self.group.clone(),
            sums: Mutex::default(),
        }
    }
}

impl std::fmt::Debug for GlobalAux {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GlobalAux")
            .field("group_size", &self.group.as_ref().map_or(1, |g| g.size()))
            .finish()
    }
}

impl GlobalAux {
    /// Adds a micro-batch's expert `counts` of layer `router` (over its `rows` tokens),
    /// summed over the group first (collective), to the step's; returns the step's average
    /// counts so far and the micro-batch's global token total.
    ///
    /// # Errors
    /// A failed all-reduce.
    pub(crate) fn average(
        &self,
        router: ParamId,
        mut counts: Vec<f64>,
        rows: usize,
    ) -> Result<(Vec<f64>, f64)> {
        let ranks = match &self.group {
            Some(g) if g.size() > 1 => {
                g.all_reduce(&mut counts, ReduceOp::Sum)
                    .map_err(|e| ModelError::Comm(format!("global_aux_loss counts: {e}")))?;
                g.size()
            }
            _ => 1,
        };
        let mut sums = self.sums.lock().expect("no pass panics holding the counts");
        let (sum, steps) = sums
            .entry(router)
            .or_insert_with(|| (vec![0.0; counts.len()], 0));
        sum.iter_mut().zip(&counts).for_each(|(s, c)| *s += c);
        *steps += 1;
        let average = sum.iter().map(|s| s / f64::from(*steps)).collect();
        Ok((average, (rows * ranks) as f64))
    }

    fn reset(&self) {
        self.sums
            .lock()
            .expect("no pass panics holding the counts")
            .clear();
    }
}

impl GptModel {
    /// The ranks whose micro-batches form the global batch with this one's (the
    /// data-parallel group; a duplicate of it, so the forward's all-reduces never meet
    /// another thread's): `global_aux_loss` sums each micro-batch's expert counts over them.
    pub fn set_global_aux_group(&mut self, group: Arc<dyn Communicator>) {
        self.global_aux.group = Some(group);
    }

    /// Forgets the step's `global_aux_loss` counts (Megatron resets them after every
    /// training step).
    pub fn reset_global_aux(&self) {
        self.global_aux.reset();
    }
}

#[cfg(test)]
mod tests {
    use super::GlobalAux;
    use crate::module::ParamId;

    /// The counts average over the micro-batches of a step, per layer, until reset.
    #[test]
    fn counts_average_over_the_step() {
        let state = GlobalAux::default();
        let (a, b) = (ParamId(3), ParamId(7));
        assert_eq!(
            state.average(a, vec![2.0, 4.0], 3).unwrap(),
            (vec![2.0, 4.0], 3.0)
        );
        assert_eq!(
            state.average(b, vec![1.0, 1.0], 3).unwrap().0,
            vec![1.0, 1.0]
        );
        assert_eq!(
            state.average(a, vec![4.0, 0.0], 3).unwrap().0,
            vec![3.0, 2.0]
        );
        state.reset();
        assert_eq!(
            state.average(a, vec![6.0, 0.0], 3).unwrap().0,
            vec![6.0, 0.0]
        );
    }
}
