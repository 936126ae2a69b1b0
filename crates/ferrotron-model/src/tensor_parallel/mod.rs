//! Tensor-parallel shards of a [`GptModel`]: Megatron-Core's layout of a `GPTModel` over
//! `t` ranks (`megatron/core/tensor_parallel/layers.py`):
//!
//! | parameter | split | rank `r` holds |
//! |---|---|---|
//! | `embedding.word_embeddings`, `output_layer` `[v, h]` | [`TpSplit::Vocab`] | rows `r·v'/t ..`, `v'` = `v` padded |
//! | `linear_qkv` `[g·(a/g+2)·d, h]` (+ bias) | [`TpSplit::Rows`] (1 part) | query groups `r·g/t ..` |
//! | `linear_fc1` `[2f, h]` (+ bias) | [`TpSplit::Rows`] (2 parts) | gate rows `r·f/t ..` then up rows `f + r·f/t ..` |
//! | `linear_proj` `[h, a·d]`, `linear_fc2` `[h, f]` | [`TpSplit::Columns`] | columns `r·n/t ..` |
//! | norms, `linear_proj` / `linear_fc2` biases | [`TpSplit::Replicated`] | everything |
//!
//! The splits are part of each parameter's declaration ([`crate::module::ParamDecl::split`]).
//! The shard is itself a [`GptModel`] computing with the local sizes (`a/t` heads, `g/t`
//! groups, `f/t`, `v'/t` vocabulary rows), so every kernel runs unchanged; the forward and
//! backward add the tensor-parallel collectives where the [`TpInfo`] says so. The
//! vocabulary is padded to a multiple of `make_vocab_size_divisible_by · t` as Megatron does,
//! but padded ids are masked out of the softmax (Megatron trains them), so the loss is the
//! unpadded model's.

use ferrotron_comm::{Collectives, Communicator};
use ferrotron_nn::TensorParallel;
use ferrotron_tensor::Tensor;

use crate::module::{ExpertTensorParallel, ModelLayout, ParamRole};
use crate::param_table::dense;
use crate::{GptModel, ModelError, Result};

mod split;
pub use split::{ParamBox, TpSplit};

/// What a tensor-parallel shard knows beyond its layout.
#[derive(Clone, Debug)]
pub struct TpInfo {
    /// The group and sequence parallelism.
    pub group: TensorParallel,
    /// Vocabulary rows after padding (`v'`, a multiple of `t`).
    pub padded_vocab: usize,
    /// Global id of this rank's first vocabulary row.
    pub vocab_start: usize,
    /// Real (unpadded) rows of this rank's vocabulary shard.
    pub vocab_valid: usize,
    /// How the shard holds the routed experts.
    pub experts: ExpertTensorParallel,
}

/// `v` padded to a multiple of `divisible_by · t` (Megatron's `_vocab_size_with_padding`).
pub fn padded_vocab_size(v: usize, divisible_by: usize, t: usize) -> usize {
    v.div_ceil(divisible_by * t) * divisible_by * t
}

impl GptModel {
    /// This rank's tensor-parallel shard of the full model `self` (Megatron's layout, see the
    /// module docs), in the same storage dtype; `make_vocab_size_divisible_by` as Megatron's
    /// flag (128 by default there). A group of one returns a plain copy. The routed experts
    /// are split too (`expert_tensor_parallel_size` = tp; see
    /// [`GptModel::tensor_parallel_shard_with`]).
    ///
    /// # Errors
    /// [`ModelError::Input`] when heads, query groups or the FFN size do not divide by `t`,
    /// or `self` is already a shard.
    pub fn tensor_parallel_shard(
        &self,
        group: TensorParallel,
        make_vocab_size_divisible_by: usize,
    ) -> Result<GptModel> {
        let split = ExpertTensorParallel::Split;
        self.tensor_parallel_shard_with(group, make_vocab_size_divisible_by, split)
    }

    /// [`GptModel::tensor_parallel_shard`] holding the routed experts as `experts` says.
    ///
    /// # Errors
    /// As [`GptModel::tensor_parallel_shard`]; whole experts on a model without MoE layers.
    pub fn tensor_parallel_shard_with(
        &self,
        group: TensorParallel,
        make_vocab_size_divisible_by: usize,
        experts: ExpertTensorParallel,
    ) -> Result<GptModel> {
        let (t, r) = (group.size(), group.rank());
        let c = self.config();
        if self.tp.is_some() {
            return Err(ModelError::Input(
                "the model is already a tensor-parallel shard".into(),
            ));
        }
        if experts == ExpertTensorParallel::Whole && c.moe.is_none() {
            return Err(ModelError::Input(
                "expert_tensor_parallel_size 1: the model has no MoE layers".into(),
            ));
        }
        let moe_widths = c.moe.iter().flat_map(|m| {
            [
                Some(("moe_ffn_hidden_size", m.moe_ffn_hidden_size))
                    .filter(|_| experts == ExpertTensorParallel::Split),
                m.shared_expert_intermediate_size
                    .map(|f| ("moe_shared_expert_intermediate_size", f)),
            ]
            .into_iter()
            .flatten()
        });
        let problems: Vec<String> = [
            ("num_attention_heads", c.num_attention_heads),
            ("num_query_groups", c.num_query_groups),
            ("ffn_hidden_size", c.ffn_hidden_size),
        ]
        .into_iter()
        .chain(moe_widths)
        .filter(|(_, n)| !n.is_multiple_of(t))
        .map(|(name, n)| {
            format!("{name} ({n}) is not divisible by tensor_model_parallel_size ({t})")
        })
        .collect();
        if !problems.is_empty() {
            return Err(ModelError::Input(problems.join("; ")));
        }
        let padded = padded_vocab_size(c.vocab_size, make_vocab_size_divisible_by.max(1), t);
        let mut part = self.part();
        part.expert_tp = experts;
        let layout = ModelLayout::new(c, padded, &part);
        // One full parameter widened at a time: every in-process rank shards the same model.
        let params = layout
            .decls()
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let full = self.param_table().view(i);
                let shard = d.split.shard(&full.to_f32(), &d.shape, t, r);
                Ok(Tensor::from_f32(&d.local_shape(t), shard)?.to_dtype(full.dtype()))
            })
            .collect::<Result<Vec<_>>>()?;
        let vocab_start = r * (padded / t);
        let tp = TpInfo {
            group,
            padded_vocab: padded,
            vocab_start,
            vocab_valid: c.vocab_size.saturating_sub(vocab_start).min(padded / t),
            experts,
        };
        GptModel::assemble(
            c.clone(),
            layout,
            dense(params),
            Some(tp),
            self.stage.clone(),
        )
    }

    /// The full shape of parameter `i` (order of [`GptModel::parameters`]): on an
    /// expert-parallel shard an expert stack's holds every rank's experts.
    pub fn global_param_shape(&self, i: usize) -> Vec<usize> {
        let mut shape = self.layout().decls()[i].shape.clone();
        if let Some(ep) = self.ep.as_ref().filter(|_| self.is_expert_param(i)) {
            shape[0] *= ep.shard().size;
        }
        shape
    }

    /// Where the local elements `range` of parameter `i` (order of
    /// [`GptModel::parameters`]) lie in the full parameter: one box per contiguous run (see
    /// [`TpSplit::boxes`]); a full model's parameter is its own full tensor.
    pub fn param_boxes(&self, i: usize, range: std::ops::Range<usize>) -> Vec<ParamBox> {
        let d = &self.layout().decls()[i];
        let mut boxes = match &self.tp {
            Some(tp) => d
                .split
                .boxes(&d.shape, tp.group.size(), tp.group.rank(), range),
            None => TpSplit::Replicated.boxes(&d.shape, 1, 0, range),
        };
        // An expert-parallel rank's experts are rows `rank·rows ..` of the whole stack.
        if let Some(ep) = self.ep.as_ref().filter(|_| self.is_expert_param(i)) {
            for b in &mut boxes {
                b.global_offset[0] += ep.shard().rank * d.shape[0];
            }
        }
        boxes
    }

    /// Whether another rank of the model-parallel group holds the stored copy of parameter
    /// `i`: a replicated parameter on tensor-parallel rank > 0, a non-expert parameter on
    /// expert-parallel rank > 0, or the last pipeline stage's
    /// shared copy of a tied embedding (stage 0 stores it). Checkpoints write each parameter
    /// once (Megatron's `replica_id`).
    pub fn is_param_replica(&self, i: usize) -> bool {
        // Every expert-parallel rank holds the non-expert parameters; the first stores them.
        let ep_replica = self
            .ep
            .as_ref()
            .is_some_and(|ep| ep.shard().rank > 0 && !self.is_expert_param(i));
        ep_replica || self.is_model_parallel_replica(i)
    }

    /// [`GptModel::is_param_replica`] within the tensor x pipeline group alone: a replicated
    /// parameter on tensor-parallel rank > 0, or the last stage's copy of a tied embedding
    /// (the data-parallel ranks, expert-parallel ones included, each own a shard of the
    /// others under the distributed optimizer).
    pub fn is_model_parallel_replica(&self, i: usize) -> bool {
        let tp_replica = self.tp.as_ref().is_some_and(|tp| {
            tp.group.rank() > 0 && self.layout().decls()[i].split == TpSplit::Replicated
        });
        let embedding = self.layout().embedding.map(|e| e.index());
        tp_replica || (embedding == Some(i) && self.holds_shared_embedding_copy())
    }

    /// The tensor-parallel shard info, `None` for a full model.
    pub fn tensor_parallel(&self) -> Option<&TpInfo> {
        self.tp.as_ref()
    }

    /// Per-parameter arrays of this shard (order of [`GptModel::parameters`], e.g. weights or
    /// Adam moments) → the full model's, gathered over the tensor-parallel group (every rank
    /// gets them). A full model returns them unchanged. Collective.
    ///
    /// # Errors
    /// A failed all-gather.
    pub fn gather_tensor_parallel(&self, local: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>> {
        let Some(tp) = &self.tp else {
            return Ok(local);
        };
        let t = tp.group.size();
        local
            .into_iter()
            .zip(self.layout().decls())
            .map(|(mine, d)| {
                let (split, shape) = (&d.split, &d.shape);
                if *split == TpSplit::Replicated {
                    return Ok(mine);
                }
                let n = mine.len();
                let mut all = vec![0f32; n * t];
                tp.group
                    .comm()
                    .all_gather(&mine, &mut all)
                    .map_err(|e| ModelError::Comm(format!("tensor-parallel gather: {e}")))?;
                let parts: Vec<&[f32]> = all.chunks_exact(n).collect();
                Ok(split.unshard(&parts, shape))
            })
            .collect()
    }

    /// The inverse of [`gather_tensor_parallel`](Self::gather_tensor_parallel): this rank's
    /// parts of full per-parameter arrays (no communication).
    pub fn shard_tensor_parallel(&self, full: Vec<Vec<f32>>) -> Vec<Vec<f32>> {
        let Some(tp) = &self.tp else {
            return full;
        };
        let (t, r) = (tp.group.size(), tp.group.rank());
        full.into_iter()
            .zip(self.layout().decls())
            .map(|(v, d)| d.split.shard(&v, &d.shape, t, r))
            .collect()
    }

    /// Megatron's `finalize_model_grads` for tensor parallelism, once per step after every
    /// micro-batch's backward: under sequence parallelism each rank's gradients of the
    /// replicated parameters (norms, row-parallel biases) cover only its rows, so they are
    /// all-reduced over the group. A replicated LoRA matrix's gradient is always a sum of the
    /// ranks' partial products (`train/lora.rs`), so it is all-reduced with or without
    /// sequence parallelism, as is a score head's (the first rank's alone, the others
    /// contributing zeros: `train/backward.rs`). Nothing to do on one rank.
    ///
    /// # Errors
    /// A failed all-reduce.
    pub fn finalize_grads(&self, grads: &mut [&mut [f32]]) -> Result<()> {
        let Some(tp) = &self.tp else {
            return Ok(());
        };
        let sp = tp.group.sequence_parallel();
        let comm: &dyn Communicator = tp.group.comm().as_ref();
        let mut summed = self.layout().single_contributor_params();
        summed.extend(self.layout().partial_grad_params());
        for (i, (g, d)) in grads.iter_mut().zip(self.layout().decls()).enumerate() {
            // Frozen parameters have empty slices (and the same on every rank).
            let partial = sp || d.role == ParamRole::Adapter || summed.contains(&i);
            if d.split == TpSplit::Replicated && partial && !g.is_empty() {
                comm.all_reduce(g, ferrotron_comm::ReduceOp::Sum)
                    .map_err(|e| ModelError::Comm(format!("tensor-parallel grads: {e}")))?;
            }
        }
        Ok(())
    }
}
