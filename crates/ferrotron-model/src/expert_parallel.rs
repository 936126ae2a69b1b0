//! Expert-parallel shards of a [`GptModel`] (Megatron-Core's `expert_model_parallel_size`,
//! `megatron/core/transformer/moe/`): the `E` routed experts of every MoE layer split evenly
//! over the `ep` ranks of the expert-parallel group (rank `r` holds experts
//! `r·E/ep .. (r+1)·E/ep`, [`ExpertShard`]); everything else — attention, routers, shared
//! experts, dense layers — stays replicated. Each rank routes its own tokens and the MoE
//! layer exchanges them with the alltoall token dispatcher
//! ([`ferrotron_nn::moe::ep_experts_forward`]). A rank's expert gradients cover every
//! rank's tokens routed to its experts, so they are reduced over the expert-data-parallel
//! group only (the data-parallel ranks holding the same experts).

use std::sync::Arc;

use ferrotron_comm::{Collectives, Communicator};

use crate::module::{ExpertShard, ModelLayout};
use crate::param_table::dense;
use crate::{GptModel, ModelError, Result};
use ferrotron_tensor::Tensor;

/// The expert-parallel group of a shard.
#[derive(Clone)]
pub struct ExpertParallel {
    comm: Arc<dyn Communicator>,
}

impl std::fmt::Debug for ExpertParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertParallel")
            .field("rank", &self.comm.rank())
            .field("size", &self.comm.size())
            .finish()
    }
}

impl ExpertParallel {
    /// The ranks of `comm` split the experts (rank order = expert order).
    pub fn new(comm: Arc<dyn Communicator>) -> ExpertParallel {
        ExpertParallel { comm }
    }

    /// The group.
    pub fn comm(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }

    /// This rank's share of the experts.
    pub fn shard(&self) -> ExpertShard {
        ExpertShard {
            rank: self.comm.rank(),
            size: self.comm.size(),
        }
    }
}

impl GptModel {
    /// This rank's expert-parallel shard of `self` (a whole model, a pipeline stage or a
    /// tensor-parallel shard): the same model holding only its `E/ep` experts of every MoE
    /// layer (see the module docs). A group of one returns a plain copy.
    ///
    /// # Errors
    /// A model without MoE layers, `E` not divisible by the group size, or a model that is
    /// already an expert-parallel shard; each names `expert_model_parallel_size`.
    pub fn expert_parallel_shard(&self, ep: ExpertParallel) -> Result<GptModel> {
        let c = self.config();
        let bad = |why: String| {
            Err(ModelError::Input(format!(
                "expert_model_parallel_size {}: {why}",
                ep.comm.size()
            )))
        };
        let Some(moe) = &c.moe else {
            return bad("the model has no MoE layers".into());
        };
        if self.ep.is_some() {
            return bad("the model is already an expert-parallel shard".into());
        }
        let (e, n) = (moe.num_experts(), ep.comm.size());
        if !e.is_multiple_of(n) {
            return bad(format!("{e} experts do not split evenly"));
        }
        let mut part = self.part();
        part.experts = Some(ep.shard());
        let padded = self.tp.as_ref().map_or(c.vocab_size, |t| t.padded_vocab);
        let layout = ModelLayout::new(c, padded, &part);
        let experts: Vec<usize> = self.layout().expert_stacks().collect();
        let held = ep.shard().experts(e);
        // The same declarations in the same order; only the expert stacks hold fewer rows.
        let params = layout
            .decls()
            .iter()
            .enumerate()
            .map(|(i, d)| {
                debug_assert_eq!(d.name, self.layout().decls()[i].name);
                let full = self.param_table().view(i);
                if !experts.contains(&i) {
                    return Ok(full.to_tensor());
                }
                // Every expert's rows are one contiguous block of the stack.
                let per_expert = full.shape()[0] / e;
                let cols = full.shape()[1];
                let values = full.to_f32();
                let rows = held.start * per_expert..held.end * per_expert;
                let mine = values[rows.start * cols..rows.end * cols].to_vec();
                Ok(Tensor::from_f32(&[rows.len(), cols], mine)?.to_dtype(full.dtype()))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut model = GptModel::assemble(
            c.clone(),
            layout,
            dense(params),
            self.tp.clone(),
            self.stage.clone(),
        )?;
        model.ep = Some(ep);
        Ok(model)
    }

    /// Full per-parameter arrays from this expert-parallel rank's `local` ones (table
    /// order, each as [`GptModel::gather_tensor_parallel`] gives it): every expert stack
    /// all-gathered over the group (rank order is expert order), the rest as is. Collective
    /// over the expert-parallel group; `local` itself without one.
    ///
    /// # Errors
    /// A failed all-gather.
    pub fn gather_expert_parallel(&self, local: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>> {
        let Some(ep) = &self.ep else {
            return Ok(local);
        };
        let experts: Vec<usize> = self.layout().expert_stacks().collect();
        local
            .into_iter()
            .enumerate()
            .map(|(i, mine)| {
                if !experts.contains(&i) {
                    return Ok(mine);
                }
                let mut all = vec![0f32; mine.len() * ep.comm.size()];
                ep.comm
                    .all_gather(&mine, &mut all)
                    .map_err(|e| ModelError::Comm(format!("expert-parallel gather: {e}")))?;
                Ok(all)
            })
            .collect()
    }

    /// The expert-parallel group of a shard, `None` otherwise.
    pub fn expert_parallel(&self) -> Option<&ExpertParallel> {
        self.ep.as_ref()
    }

    /// Whether parameter `i` (table order) is a stack of routed experts: its gradient is
    /// reduced over the expert-data-parallel group, and each expert-parallel rank holds
    /// other experts.
    pub fn is_expert_param(&self, i: usize) -> bool {
        self.layout().expert_stacks().any(|x| x == i)
    }
}
