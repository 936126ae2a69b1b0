//! Training: the model's parameters as flat f32 views in a fixed order ([`ParamInfo`],
//! [`GptModel::parameters`]) and one explicit forward + backward pass over a micro-batch
//! ([`GptModel::forward_backward`]), llm.c style: the forward saves exactly what the backward
//! needs per layer, the backward walks the layers in reverse.
//!
//! Mirrors Megatron-Core's `GPTModel.forward` + `loss_func` of `pretrain_gpt.py` at
//! tensor/pipeline/context-parallel size 1: the loss is the mean cross entropy over the
//! loss-masked tokens, `Σ mask·CE / Σ mask`.
//!
//! Data flow of the current design: the optimizer owns the f32 master weights and the
//! gradients in its own flat buffers; each micro-batch's `forward_backward` **accumulates**
//! (`+=`) into the gradient views, and after each optimizer step the trainer copies the
//! updated master weights into the model with [`GptModel::load_parameters_from`] (rounded to
//! the model's storage dtype when that is bf16/f16).
//!
//! Activation recomputation follows [`TransformerConfig::recompute_granularity`]
//! (Megatron's selective core-attention recompute and full uniform/block layer recompute,
//! bit-identical gradients; see [`recompute`]); [`TransformerConfig::activation_memory`] gives
//! the saved-activation bytes at the peak of a pass ([`memory`]).
//!
//! Not done yet: per-document attention masks (Megatron's `reset_attention_mask`; position
//! ids may be reset per document through [`TrainBatch::position_ids`], but attention stays
//! causal over the whole sequence, as Megatron with `reset_position_ids` alone), Megatron's
//! other selective-recompute modules (`recompute_modules` beyond `core_attn`: norms, MLP,
//! SwiGLU), `distribute_saved_activations`, buffer reuse across calls.
//!
//! [`TransformerConfig::recompute_granularity`]: crate::TransformerConfig::recompute_granularity
//! [`TransformerConfig::activation_memory`]: crate::TransformerConfig::activation_memory

mod backward;
mod forward;
mod loss;
pub mod memory;
pub(crate) mod params;
pub mod recompute;
mod stored;
mod tp_ops;
mod trace;

pub use trace::ForwardTrace;

pub use memory::ActivationMemory;
pub use params::ParamInfo;

use crate::{GptModel, ModelError, Result};
use ferrotron_nn::attention::DocumentStarts;
use ferrotron_tensor::ops::IGNORE_INDEX;

/// One micro-batch for [`GptModel::forward_backward`], every per-token field in Megatron's
/// `[s, b]` order (token `t` of sequence `j` at index `t·b + j`). Use
/// [`TrainBatch::from_batch_major`] for data in the data loader's `[b, s]` order.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainBatch {
    /// Input token ids `[s, b]`.
    pub tokens: Vec<u32>,
    /// Target ids `[s, b]` (the next token for language modeling); [`IGNORE_INDEX`] (-100)
    /// marks a token without loss.
    pub labels: Vec<i64>,
    /// Per-token loss weight `[s, b]` (Megatron's `loss_mask`); `None` means all ones.
    pub loss_mask: Option<Vec<f32>>,
    /// Rotary position of each token `[s, b]`; `None` means `0..s` for every sequence.
    pub position_ids: Option<Vec<usize>>,
    /// Per-document causal attention for packed rows (Megatron's `reset_attention_mask`):
    /// for each token `[s, b]`, the position of the first token of its document, so query
    /// `t` sees keys `start ..= t` of its own sequence. `None`: causal over the whole row.
    /// Checked by [`ferrotron_nn::attention::DocumentStarts::new`].
    pub document_starts: Option<Vec<u32>>,
    /// Micro-batch size `b`.
    pub micro_batch: usize,
    /// Sequence length `s`.
    pub seq: usize,
}

impl TrainBatch {
    /// Builds a batch from `[b, s]`-ordered tokens, labels and optional loss mask (transposed
    /// to `[s, b]`), with positions `0..s`.
    ///
    /// # Panics
    /// When a slice is not `b·s` long (a caller bug).
    pub fn from_batch_major(
        tokens: &[u32],
        labels: &[i64],
        loss_mask: Option<&[f32]>,
        micro_batch: usize,
        seq: usize,
    ) -> TrainBatch {
        let n = micro_batch * seq;
        assert!(
            tokens.len() == n && labels.len() == n,
            "batch is not [b, s]"
        );
        TrainBatch {
            tokens: to_seq_major(tokens, micro_batch, seq),
            labels: to_seq_major(labels, micro_batch, seq),
            loss_mask: loss_mask.map(|m| {
                assert_eq!(m.len(), n, "loss_mask is not [b, s]");
                to_seq_major(m, micro_batch, seq)
            }),
            position_ids: None,
            document_starts: None,
            micro_batch,
            seq,
        }
    }

    /// Sets [`TrainBatch::document_starts`] from `[b, s]` segment ids (the data loader's
    /// form: a token attends to earlier tokens of its row with the same id), or clears it
    /// when every row is one segment. A segment starts wherever the id changes.
    ///
    /// # Panics
    /// When `segment_ids` is not `b·s` long (a caller bug).
    pub fn set_segments(&mut self, segment_ids: &[u32]) {
        let (b, s) = (self.micro_batch, self.seq);
        assert_eq!(segment_ids.len(), b * s, "segment_ids is not [b, s]");
        let single = segment_ids
            .chunks(s.max(1))
            .all(|row| row.iter().all(|&id| id == row[0]));
        if single {
            self.document_starts = None;
            return;
        }
        let mut starts = vec![0u32; b * s];
        for j in 0..b {
            let row = &segment_ids[j * s..(j + 1) * s];
            for t in 1..s {
                starts[t * b + j] = if row[t] == row[t - 1] {
                    starts[(t - 1) * b + j]
                } else {
                    t as u32
                };
            }
        }
        self.document_starts = Some(starts);
    }

    /// `Σ loss_mask` over tokens whose label is not [`IGNORE_INDEX`]: the denominator of the
    /// mean loss (for per-token loss across micro-batches, see
    /// [`GptModel::forward_backward`]).
    pub fn loss_token_count(&self) -> f64 {
        self.labels
            .iter()
            .enumerate()
            .filter(|&(_, &y)| y != IGNORE_INDEX)
            .map(|(i, _)| self.loss_mask.as_ref().map_or(1.0, |m| m[i] as f64))
            .sum()
    }

    fn validate(&self, model: &GptModel) -> Result<()> {
        let n = self.micro_batch * self.seq;
        let bad = |what: &str, len: usize| {
            Err(ModelError::Input(format!(
                "train batch: {what} has {len} entries, expected s·b = {}·{} = {n}",
                self.seq, self.micro_batch
            )))
        };
        if n == 0 {
            return Err(ModelError::Input("train batch: empty".into()));
        }
        if self.tokens.len() != n {
            return bad("tokens", self.tokens.len());
        }
        if self.labels.len() != n {
            return bad("labels", self.labels.len());
        }
        if let Some(m) = &self.loss_mask
            && m.len() != n
        {
            return bad("loss_mask", m.len());
        }
        if let Some(d) = &self.document_starts {
            if d.len() != n {
                return bad("document_starts", d.len());
            }
            DocumentStarts::new(d, self.micro_batch)
                .map_err(|e| ModelError::Input(format!("train batch: {e}")))?;
        }
        let max_pos = model.rope().max_positions();
        match &self.position_ids {
            Some(p) if p.len() != n => return bad("position_ids", p.len()),
            Some(p) => {
                if let Some(&bad_pos) = p.iter().find(|&&x| x >= max_pos) {
                    return Err(ModelError::Input(format!(
                        "train batch: position id {bad_pos} >= max_position_embeddings {max_pos}"
                    )));
                }
            }
            None if self.seq > max_pos => {
                return Err(ModelError::Input(format!(
                    "train batch: sequence of {} tokens exceeds max_position_embeddings {max_pos}",
                    self.seq
                )));
            }
            None => {}
        }
        Ok(())
    }

    /// Position of every row `t·b + j`.
    fn row_positions(&self) -> Vec<usize> {
        match &self.position_ids {
            Some(p) => p.clone(),
            None => (0..self.seq)
                .flat_map(|t| std::iter::repeat_n(t, self.micro_batch))
                .collect(),
        }
    }
}

fn to_seq_major<T: Copy>(x: &[T], b: usize, s: usize) -> Vec<T> {
    (0..s)
        .flat_map(|t| (0..b).map(move |j| x[j * s + t]))
        .collect()
}

/// Hears, during [`GptModel::forward_backward_with`], that the gradients of some parameters
/// are final for this call (Megatron's backward hooks that make DDP buckets ready): the
/// output layer and final norm first, then each decoder layer from the last, the embedding
/// last.
pub trait GradReady {
    /// `params` (indices in the order of [`GptModel::parameters`]) will not change any more
    /// in this call; `grads` are all gradients, readable.
    fn ready(&mut self, params: &[usize], grads: &[&mut [f32]]);
}

/// A [`GradReady`] that ignores everything.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoGradHook;

impl GradReady for NoGradHook {
    fn ready(&mut self, _: &[usize], _: &[&mut [f32]]) {}
}

/// The loss of one [`GptModel::forward_backward`] call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossStats {
    /// Mean loss over the loss tokens, `loss_sum / loss_count` (0 when there are none).
    pub loss: f32,
    /// `Σ mask·CE` over the micro-batch (summed in f64).
    pub loss_sum: f64,
    /// `Σ mask` over tokens with a label ([`TrainBatch::loss_token_count`]).
    pub loss_count: f64,
}

impl GptModel {
    /// The loss of `batch` from the training forward alone (no gradients; activations
    /// dropped as soon as the loss is known): validation for batches the inference forward
    /// cannot take (packed documents, reset positions, tensor-parallel shards).
    ///
    /// # Errors
    /// As [`GptModel::forward_backward`].
    pub fn forward_loss(&self, batch: &TrainBatch) -> Result<LossStats> {
        if !self.is_pre_process() || !self.is_post_process() {
            return Err(ModelError::Input(
                "forward_loss needs the whole model (a pipeline stage: stage_forward)".into(),
            ));
        }
        let forward = self.stage_forward(batch, 0, None, 0.0)?;
        Ok(forward.loss().expect("a whole model computes its loss"))
    }

    /// One training forward and backward pass over `batch` (no KV cache, causal attention with
    /// the model's sliding window if any), returning the loss.
    ///
    /// `grads` holds one f32 slice per parameter in the order of [`GptModel::parameters`],
    /// each [`ParamInfo::numel`] long; the gradient of `loss_scale · loss` is **accumulated**
    /// into them (`+=`), so micro-batches add up. `loss` is the mean over this micro-batch's
    /// loss tokens (`Σ mask·CE / Σ mask`, Megatron's default). For fp16 loss scaling pass the
    /// scale; for the mean over a global batch of `M` equal micro-batches pass `1/M`; for
    /// Megatron's `--calculate-per-token-loss` pass
    /// `batch.loss_token_count() / total_loss_tokens_of_the_global_batch`.
    /// With tied embeddings the output layer's gradient accumulates into the embedding's.
    ///
    /// Activations are kept or recomputed as [`TransformerConfig::recompute_granularity`]
    /// says; the loss and gradients are bit-identical either way.
    ///
    /// [`TransformerConfig::recompute_granularity`]: crate::TransformerConfig::recompute_granularity
    ///
    /// # Errors
    /// Malformed batch (lengths, positions beyond the rotary table, token ids `>= v`, labels
    /// outside `0..v` other than -100), gradient slices of the wrong count or length, or a
    /// `recompute_num_layers` outside `1..=num_layers`; `grads` is untouched then.
    pub fn forward_backward(
        &self,
        batch: &TrainBatch,
        grads: &mut [&mut [f32]],
        loss_scale: f32,
    ) -> Result<LossStats> {
        self.forward_backward_with(batch, grads, loss_scale, &mut NoGradHook)
    }

    /// [`GptModel::forward_backward`], telling `ready` as parameter gradients become final
    /// (so their communication can start while the backward goes on).
    ///
    /// # Errors
    /// As [`GptModel::forward_backward`].
    pub fn forward_backward_with(
        &self,
        batch: &TrainBatch,
        grads: &mut [&mut [f32]],
        loss_scale: f32,
        ready: &mut (dyn GradReady + Send),
    ) -> Result<LossStats> {
        if !self.is_pre_process() || !self.is_post_process() {
            return Err(ModelError::Input(
                "forward_backward needs the whole model (a pipeline stage: stage_forward and \
                 stage_backward)"
                    .into(),
            ));
        }
        self.check_grads(batch, grads)?;
        let part = self.chunk_part(0)?;
        rayon::scope(|_| {
            let mut ledger = memory::Ledger::default();
            let mut acts = self.train_forward(batch, part, None, &mut ledger)?;
            let stats = self.loss_and_logit_grad(batch, &mut acts, loss_scale)?;
            self.train_backward(batch, acts, grads, &mut ledger, ready, None)?;
            Ok(stats)
        })
    }

    /// Checks the batch, the recompute setting and that `grads` fit the parameters.
    fn check_grads(&self, batch: &TrainBatch, grads: &[&mut [f32]]) -> Result<()> {
        batch.validate(self)?;
        self.config.validate_recompute()?;
        let infos = self.parameters();
        if infos.len() != grads.len() {
            return Err(ModelError::Input(format!(
                "{} gradient slices given, the model has {} parameters",
                grads.len(),
                infos.len()
            )));
        }
        for (info, g) in infos.iter().zip(grads.iter()) {
            if g.len() != info.numel() {
                return Err(ModelError::Input(format!(
                    "gradient of {}: {} elements, expected {}",
                    info.name,
                    g.len(),
                    info.numel()
                )));
            }
        }
        Ok(())
    }

    /// A pipeline stage's forward of one micro-batch through model chunk `chunk` (0 without
    /// interleaving; see [`GptModel::pipeline_chunks`]): from token ids on the first virtual
    /// stage (`input = None`) or from the previous virtual stage's output `[local rows, h]`;
    /// on the last virtual stage also the loss and the gradient of `loss_scale · loss` with
    /// respect to the logits (as [`GptModel::forward_backward`]). The result waits for
    /// [`GptModel::stage_backward`]; take the output for the next stage from it first.
    ///
    /// # Errors
    /// As [`GptModel::forward_backward`], a chunk the stage does not hold, or an input that
    /// does not fit the stage.
    pub fn stage_forward(
        &self,
        batch: &TrainBatch,
        chunk: usize,
        input: Option<Vec<f32>>,
        loss_scale: f32,
    ) -> Result<StageForward> {
        let part = self.chunk_part(chunk)?;
        self.run_forward(batch, part, input, loss_scale)
    }

    /// [`GptModel::stage_forward`] of `part`.
    fn run_forward(
        &self,
        batch: &TrainBatch,
        part: crate::pipeline_stage::ChunkPart,
        input: Option<Vec<f32>>,
        loss_scale: f32,
    ) -> Result<StageForward> {
        batch.validate(self)?;
        self.config.validate_recompute()?;
        rayon::scope(|_| {
            let mut ledger = memory::Ledger::default();
            let post_process = part.post_process;
            let mut acts = self.train_forward(batch, part, input, &mut ledger)?;
            let loss = if post_process {
                Some(self.loss_and_logit_grad(batch, &mut acts, loss_scale)?)
            } else {
                None
            };
            Ok(StageForward { acts, ledger, loss })
        })
    }

    /// The forward of the decoder layers `layers` of a model without interleaving (a whole
    /// model or a pipeline stage): the embedding first when `layers` starts at 0 on the
    /// first stage, the head and loss after when it ends at the last layer of the last stage.
    /// `layers` must be made of whole [`GptModel::layer_groups`]. Running the groups in turn,
    /// each from the previous one's output, then their backwards in reverse
    /// ([`GptModel::stage_backward_with`]) gives [`GptModel::stage_forward`]'s results bit
    /// for bit; between them the caller may change the parameters of layers not yet run
    /// (`overlap_param_gather`).
    ///
    /// # Errors
    /// As [`GptModel::stage_forward`], `layers` empty or outside the model, or a stage of
    /// several model chunks.
    pub fn part_forward(
        &self,
        batch: &TrainBatch,
        layers: std::ops::Range<usize>,
        input: Option<Vec<f32>>,
        loss_scale: f32,
    ) -> Result<StageForward> {
        let n = self.layers.len();
        if self.num_chunks() > 1 || layers.is_empty() || layers.end > n {
            return Err(ModelError::Input(format!(
                "part_forward of layers {layers:?}: needs a range inside the {n} layers of a \
                 model of one chunk"
            )));
        }
        let mut part = self.chunk_part(0)?;
        part.pre_process &= layers.start == 0;
        part.post_process &= layers.end == n;
        part.layers = layers;
        self.run_forward(batch, part, input, loss_scale)
    }

    /// Index range (order of [`GptModel::parameters`]) of the parameters that
    /// [`GptModel::part_forward`] of `layers` reads: the embedding with the first layers of
    /// the first stage, the layers' own, and the final norm and output layer with the last
    /// layers of the last stage (a tied output weight is the embedding, index 0).
    pub fn part_params(&self, layers: std::ops::Range<usize>) -> std::ops::Range<usize> {
        let slots = self.param_slots();
        let total = self.parameters().len();
        let first = |i: usize| slots.layers.get(i).map_or(total, |l| l.norm1);
        let start = if layers.start == 0 {
            0
        } else {
            first(layers.start)
        };
        let end = if layers.end == self.layers.len() {
            total
        } else {
            first(layers.end)
        };
        start..end
    }

    /// The backward of a [`StageForward`] (through the chunk it ran): accumulates into
    /// `grads` (order of [`GptModel::parameters`]) from `dout`, the gradient of the chunk's
    /// output (`None` on the last virtual stage, whose loss gradient is already in the
    /// forward's logits); returns the gradient of the chunk's input for the previous virtual
    /// stage (`None` on the first).
    ///
    /// # Errors
    /// Gradient slices or `dout` that do not fit, or a failed collective.
    pub fn stage_backward(
        &self,
        batch: &TrainBatch,
        forward: StageForward,
        grads: &mut [&mut [f32]],
        dout: Option<Vec<f32>>,
    ) -> Result<Option<Vec<f32>>> {
        self.stage_backward_with(batch, forward, grads, dout, &mut NoGradHook)
    }

    /// [`GptModel::stage_backward`], telling `ready` as parameter gradients become final.
    ///
    /// # Errors
    /// As [`GptModel::stage_backward`].
    pub fn stage_backward_with(
        &self,
        batch: &TrainBatch,
        forward: StageForward,
        grads: &mut [&mut [f32]],
        dout: Option<Vec<f32>>,
        ready: &mut (dyn GradReady + Send),
    ) -> Result<Option<Vec<f32>>> {
        self.check_grads(batch, grads)?;
        let StageForward {
            acts, mut ledger, ..
        } = forward;
        rayon::scope(|_| self.train_backward(batch, acts, grads, &mut ledger, ready, dout))
    }
}

/// One micro-batch's forward on a pipeline stage, kept for its backward
/// ([`GptModel::stage_forward`]).
pub struct StageForward {
    acts: forward::Activations,
    ledger: memory::Ledger,
    loss: Option<LossStats>,
}

impl StageForward {
    /// The loss (last stage only).
    pub fn loss(&self) -> Option<LossStats> {
        self.loss
    }

    /// The stage's output `[local rows, h]` for the next stage (empty on the last stage, and
    /// after the first call).
    pub fn take_output(&mut self) -> Vec<f32> {
        std::mem::take(&mut self.acts.x_final)
    }
}
