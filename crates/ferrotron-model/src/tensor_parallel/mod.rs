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
//! The shard is itself a [`GptModel`] whose `config` has the local sizes (`a/t` heads, `g/t`
//! groups, `f/t`, `v'/t` vocabulary rows), so every kernel runs unchanged; the forward and
//! backward add the tensor-parallel collectives where the [`TpInfo`] says so. The
//! vocabulary is padded to a multiple of `make_vocab_size_divisible_by · t` as Megatron does,
//! but padded ids are masked out of the softmax (Megatron trains them), so the loss is the
//! unpadded model's.

use ferrotron_comm::{Collectives, Communicator};
use ferrotron_nn::{Embedding, Linear, RmsNorm, SwiGluMlp, TensorParallel};
use ferrotron_tensor::{DType, Tensor};

use crate::{GptModel, ModelError, Result, TransformerConfig, TransformerLayer};

mod split;
pub use split::{ParamBox, TpSplit};

/// What a tensor-parallel shard knows beyond its local config.
#[derive(Clone, Debug)]
pub struct TpInfo {
    /// The group and sequence parallelism.
    pub group: TensorParallel,
    /// The full model's config.
    pub global: TransformerConfig,
    /// Global id of this rank's first vocabulary row.
    pub vocab_start: usize,
    /// Real (unpadded) rows of this rank's vocabulary shard.
    pub vocab_valid: usize,
    /// How each parameter (order of [`GptModel::parameters`]) is split.
    pub splits: Vec<TpSplit>,
    /// Each parameter's full shape.
    pub global_shapes: Vec<Vec<usize>>,
}

/// `v` padded to a multiple of `divisible_by · t` (Megatron's `_vocab_size_with_padding`).
pub fn padded_vocab_size(v: usize, divisible_by: usize, t: usize) -> usize {
    v.div_ceil(divisible_by * t) * divisible_by * t
}

impl GptModel {
    /// The split of every parameter (order of [`GptModel::parameters`]) over `t` ranks with
    /// the vocabulary padded to `padded_vocab` rows.
    fn tp_splits(&self, padded_vocab: usize) -> Vec<TpSplit> {
        let rows = |parts| TpSplit::Rows { parts };
        let vocab = TpSplit::Vocab {
            padded: padded_vocab,
        };
        let mut out = Vec::new();
        if self.has_embedding_param() {
            out.push(vocab);
        }
        for l in &self.layers {
            out.push(TpSplit::Replicated);
            out.push(rows(1));
            if l.linear_qkv.bias().is_some() {
                out.push(rows(1));
            }
            out.push(TpSplit::Columns);
            if l.linear_proj.bias().is_some() {
                out.push(TpSplit::Replicated);
            }
            out.push(TpSplit::Replicated);
            out.push(rows(2));
            if l.mlp.linear_fc1.bias().is_some() {
                out.push(rows(2));
            }
            out.push(TpSplit::Columns);
            if l.mlp.linear_fc2.bias().is_some() {
                out.push(TpSplit::Replicated);
            }
        }
        if self.is_post_process() {
            out.push(TpSplit::Replicated);
            if self.output_layer.is_some() {
                out.push(vocab);
            }
        }
        out
    }

    /// This rank's tensor-parallel shard of the full model `self` (Megatron's layout, see the
    /// module docs), in the same storage dtype; `make_vocab_size_divisible_by` as Megatron's
    /// flag (128 by default there). A group of one returns a plain copy.
    ///
    /// # Errors
    /// [`ModelError::Input`] when heads, query groups or the FFN size do not divide by `t`,
    /// or `self` is already a shard.
    pub fn tensor_parallel_shard(
        &self,
        group: TensorParallel,
        make_vocab_size_divisible_by: usize,
    ) -> Result<GptModel> {
        let (t, r) = (group.size(), group.rank());
        let c = &self.config;
        if self.tp.is_some() {
            return Err(ModelError::Input(
                "the model is already a tensor-parallel shard".into(),
            ));
        }
        let mut problems = Vec::new();
        for (name, n) in [
            ("num_attention_heads", c.num_attention_heads),
            ("num_query_groups", c.num_query_groups),
            ("ffn_hidden_size", c.ffn_hidden_size),
        ] {
            if !n.is_multiple_of(t) {
                problems.push(format!(
                    "{name} ({n}) is not divisible by tensor_model_parallel_size ({t})"
                ));
            }
        }
        if !problems.is_empty() {
            return Err(ModelError::Input(problems.join("; ")));
        }
        let padded = padded_vocab_size(c.vocab_size, make_vocab_size_divisible_by.max(1), t);
        let mut local = c.clone();
        local.num_attention_heads /= t;
        local.num_query_groups /= t;
        local.ffn_hidden_size /= t;
        local.vocab_size = padded / t;
        let splits = self.tp_splits(padded);
        // One full parameter widened at a time: every in-process rank shards the same model.
        let (infos, values): (Vec<_>, Vec<Vec<f32>>) = self
            .param_views()
            .into_iter()
            .zip(&splits)
            .map(|((info, view), split)| {
                let shard = split.shard(&view.to_f32(), &info.shape, t, r);
                (info, shard)
            })
            .unzip();
        let mut shard = self.zeroed_like(local)?;
        let views: Vec<&[f32]> = values.iter().map(Vec::as_slice).collect();
        shard.load_parameters_from(&views)?;
        let vocab_start = r * (padded / t);
        shard.tp = Some(TpInfo {
            group,
            global: c.clone(),
            vocab_start,
            vocab_valid: c.vocab_size.saturating_sub(vocab_start).min(padded / t),
            splits,
            global_shapes: infos.into_iter().map(|i| i.shape).collect(),
        });
        Ok(shard)
    }

    /// A model of `config`'s sizes with `self`'s structure (biases, tying, dtype), all zeros.
    fn zeroed_like(&self, config: TransformerConfig) -> Result<GptModel> {
        let dtype = self.embedding.weight().dtype();
        let (h, d) = (config.hidden_size, config.kv_channels);
        let (a, f, v) = (
            config.num_attention_heads,
            config.ffn_hidden_size,
            config.vocab_size,
        );
        let zeros = |shape: &[usize], dt: DType| Tensor::zeros(shape, dt);
        let linear = |name: &str, out: usize, inp: usize, bias: bool| -> Result<Linear> {
            let b = if bias {
                Some(zeros(&[out], DType::F32)?)
            } else {
                None
            };
            Ok(Linear::new(name, zeros(&[out, inp], dtype)?, b)?)
        };
        let norm = |name: &str, eps: f32| -> Result<RmsNorm> {
            Ok(RmsNorm::new(name, zeros(&[h], DType::F32)?, h, eps)?)
        };
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(TransformerLayer {
                    input_layernorm: norm("input_layernorm", l.input_layernorm.eps())?,
                    linear_qkv: linear(
                        "linear_qkv",
                        config.qkv_size(),
                        h,
                        l.linear_qkv.bias().is_some(),
                    )?,
                    linear_proj: linear("linear_proj", h, a * d, l.linear_proj.bias().is_some())?,
                    pre_mlp_layernorm: norm("pre_mlp_layernorm", l.pre_mlp_layernorm.eps())?,
                    mlp: SwiGluMlp {
                        linear_fc1: linear(
                            "linear_fc1",
                            2 * f,
                            h,
                            l.mlp.linear_fc1.bias().is_some(),
                        )?,
                        linear_fc2: linear("linear_fc2", h, f, l.mlp.linear_fc2.bias().is_some())?,
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let rows = |has: bool| if has { v } else { 0 };
        let embedding = Embedding::new(
            "embedding",
            zeros(&[rows(self.has_embedding_param()), h], dtype)?,
        )?;
        let output_layer = match &self.output_layer {
            Some(_) => Some(linear(
                "output_layer",
                rows(self.is_post_process()),
                h,
                false,
            )?),
            None => None,
        };
        let final_norm = norm("final_layernorm", self.final_layernorm.eps())?;
        let mut model = GptModel::new(config, embedding, layers, final_norm, output_layer)?;
        model.stage = self.stage.clone();
        Ok(model)
    }

    /// The full shape of parameter `i` (order of [`GptModel::parameters`]).
    pub fn global_param_shape(&self, i: usize) -> Vec<usize> {
        match &self.tp {
            Some(tp) => tp.global_shapes[i].clone(),
            None => self.parameters()[i].shape.clone(),
        }
    }

    /// Where the local elements `range` of parameter `i` (order of
    /// [`GptModel::parameters`]) lie in the full parameter: one box per contiguous run (see
    /// [`TpSplit::boxes`]); a full model's parameter is its own full tensor.
    pub fn param_boxes(&self, i: usize, range: std::ops::Range<usize>) -> Vec<ParamBox> {
        match &self.tp {
            Some(tp) => tp.splits[i].boxes(
                &tp.global_shapes[i],
                tp.group.size(),
                tp.group.rank(),
                range,
            ),
            None => TpSplit::Replicated.boxes(&self.parameters()[i].shape, 1, 0, range),
        }
    }

    /// Whether another rank of the model-parallel group holds the stored copy of parameter
    /// `i`: a replicated parameter on tensor-parallel rank > 0, or the last pipeline stage's
    /// shared copy of a tied embedding (stage 0 stores it). Checkpoints write each parameter
    /// once (Megatron's `replica_id`).
    pub fn is_param_replica(&self, i: usize) -> bool {
        let tp_replica = self
            .tp
            .as_ref()
            .is_some_and(|tp| tp.group.rank() > 0 && tp.splits[i] == TpSplit::Replicated);
        tp_replica || (i == 0 && self.holds_shared_embedding_copy())
    }

    /// The tensor-parallel shard info, `None` for a full model.
    pub fn tensor_parallel(&self) -> Option<&TpInfo> {
        self.tp.as_ref()
    }

    /// The whole model's config: a tensor-parallel shard's own `config` has the local sizes
    /// and a pipeline stage's its own layer count; this has neither.
    pub fn global_config(&self) -> TransformerConfig {
        let mut c = self
            .tp
            .as_ref()
            .map_or(&self.config, |tp| &tp.global)
            .clone();
        if let Some(stage) = &self.stage {
            c.num_layers = stage.total_layers;
        }
        c
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
            .zip(tp.splits.iter().zip(&tp.global_shapes))
            .map(|(mine, (split, shape))| {
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
            .zip(tp.splits.iter().zip(&tp.global_shapes))
            .map(|(v, (split, shape))| split.shard(&v, shape, t, r))
            .collect()
    }

    /// Megatron's `finalize_model_grads` for tensor parallelism, once per step after every
    /// micro-batch's backward: under sequence parallelism each rank's gradients of the
    /// replicated parameters (norms, row-parallel biases) cover only its rows, so they are
    /// all-reduced over the group. Nothing to do otherwise.
    ///
    /// # Errors
    /// A failed all-reduce.
    pub fn finalize_grads(&self, grads: &mut [&mut [f32]]) -> Result<()> {
        let Some(tp) = &self.tp else {
            return Ok(());
        };
        if !tp.group.sequence_parallel() {
            return Ok(());
        }
        let comm: &dyn Communicator = tp.group.comm().as_ref();
        for (g, split) in grads.iter_mut().zip(&tp.splits) {
            if *split == TpSplit::Replicated {
                comm.all_reduce(g, ferrotron_comm::ReduceOp::Sum)
                    .map_err(|e| ModelError::Comm(format!("sequence-parallel grads: {e}")))?;
            }
        }
        Ok(())
    }
}
