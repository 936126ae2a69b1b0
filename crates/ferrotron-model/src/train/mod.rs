//! Training: the model's parameters as flat f32 views in table order ([`ParamInfo`],
//! [`GptModel::parameters`]) and one explicit forward + backward pass over a micro-batch
//! ([`GptModel::forward_backward`]), llm.c style: the forward saves exactly what the backward
//! needs per layer, the backward walks the layers in reverse. The same layer forward runs
//! generation (`core_attention::KeysValues::Cached`).
//!
//! Mirrors Megatron-Core's `GPTModel.forward` + `loss_func` of `pretrain_gpt.py`: the loss is
//! the mean cross entropy over the loss-masked tokens, `Σ mask·CE / Σ mask`; on a
//! tensor-parallel shard or a pipeline stage the passes add Megatron's collectives
//! (`tp_ops`) and run a stage at a time ([`GptModel::stage_forward`]).
//!
//! Data flow: the optimizer owns the f32 master weights and the gradients in its own flat
//! buffers; each micro-batch's `forward_backward` **accumulates** (`+=`) into the gradient
//! views, and after each optimizer step the trainer writes the updated weights into the model
//! ([`GptModel::load_parameters_with`], rounded to the storage dtype when that is bf16/f16).
//!
//! A model with bf16 weights (bf16 training) keeps its saved activations in bf16 as well
//! ([`GptModel::activation_dtype`], `stored.rs`): the inputs of its matmuls and of core
//! attention are rounded to bf16 before the forward uses them, as under PyTorch autocast.
//! Packed rows attend per document ([`TrainBatch::document_starts`], Megatron's
//! `reset_attention_mask`).
//!
//! Activation recomputation follows [`TransformerConfig::recompute_granularity`]
//! (Megatron's selective core-attention recompute and full uniform/block layer recompute,
//! bit-identical gradients; see [`recompute`]); [`TransformerConfig::activation_memory`] gives
//! the saved-activation bytes at the peak of a pass ([`memory`]).
//!
//! Not done yet: Megatron's other selective-recompute modules (`recompute_modules` beyond
//! `core_attn`: norms, MLP, SwiGLU), `distribute_saved_activations`, buffer reuse across calls.
//!
//! [`TransformerConfig::recompute_granularity`]: crate::TransformerConfig::recompute_granularity
//! [`TransformerConfig::activation_memory`]: crate::TransformerConfig::activation_memory

mod attention;
mod backward;
pub(crate) mod core_attention;
mod dpo;
mod experts;
pub(crate) mod forward;
mod layer_acts;
mod lora;
mod loss;
pub mod memory;
mod mla;
mod mlp;
mod moe;
mod moe_losses;
pub use moe::MoeLosses;
mod norm;
pub(crate) mod params;
pub mod recompute;
mod reward;
mod stage;
mod stored;
mod tp_ops;
mod trace;

pub use dpo::{DpoStats, DpoTargets, StageLogps};
pub use reward::RewardTargets;
pub use stage::{StageBackward, StageForward};
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
    /// What the batch trains: language modeling, or a loss over preference pairs (rows `2k`
    /// chosen, `2k + 1` rejected, their completions marked by the loss mask).
    pub objective: Objective,
    /// `[b]` one key per row for the LoRA adapters' input dropout (`lora.dropout > 0`): a
    /// training step's rows have them (the trainer derives them from the seed, the iteration
    /// and each row's sample); `None` — evaluation, generation — drops nothing.
    pub dropout_keys: Option<Vec<u64>>,
}

/// The loss a [`TrainBatch`] trains.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Objective {
    /// Megatron's masked-mean next-token cross entropy.
    #[default]
    LanguageModel,
    /// DPO over the pairs ([`DpoTargets`]).
    Dpo(DpoTargets),
    /// A reward model's Bradley-Terry loss over the pairs ([`RewardTargets`]).
    Reward(RewardTargets),
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
            objective: Objective::LanguageModel,
            dropout_keys: None,
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

    /// What this batch adds to the denominator of the global batch's mean loss: its loss
    /// tokens ([`TrainBatch::loss_token_count`]), or its pairs under a pairwise objective.
    pub fn loss_units(&self) -> f64 {
        match &self.objective {
            Objective::LanguageModel => self.loss_token_count(),
            Objective::Dpo(_) | Objective::Reward(_) => (self.micro_batch / 2) as f64,
        }
    }

    fn validate(&self, model: &GptModel) -> Result<()> {
        let n = self.micro_batch * self.seq;
        match &self.objective {
            Objective::LanguageModel => {}
            Objective::Dpo(d) => d.validate(self.micro_batch)?,
            Objective::Reward(r) => r.validate(self.micro_batch)?,
        }
        let bad = |what: &str, len: usize| {
            Err(ModelError::Input(format!(
                "train batch: {what} has {len} entries, expected s·b = {}·{} = {n}",
                self.seq, self.micro_batch
            )))
        };
        if n == 0 {
            return Err(ModelError::Input("train batch: empty".into()));
        }
        if let Some(k) = self
            .dropout_keys
            .as_ref()
            .filter(|k| k.len() != self.micro_batch)
        {
            return Err(ModelError::Input(format!(
                "train batch: {} dropout keys for {} rows",
                k.len(),
                self.micro_batch
            )));
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
        // A context-parallel rank's share keeps the whole sequence's document starts and the
        // global positions (TrainBatch::context_parallel_share).
        let cp = model.context_parallel().map_or(1, |cp| cp.size());
        if cp > 1 && self.position_ids.is_none() {
            return Err(ModelError::Input(
                "train batch: a context-parallel rank needs its share of the batch \
                 (TrainBatch::context_parallel_share), with global position ids"
                    .into(),
            ));
        }
        if let Some(d) = &self.document_starts {
            if d.len() != n * cp {
                return Err(ModelError::Input(format!(
                    "train batch: document_starts has {} entries, expected the whole \
                     sequence's s·b = {}·{} = {}",
                    d.len(),
                    self.seq * cp,
                    self.micro_batch,
                    n * cp
                )));
            }
            DocumentStarts::new(d, self.micro_batch)
                .map_err(|e| ModelError::Input(format!("train batch: {e}")))?;
        }
        let max_pos = model.config().max_position_embeddings;
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
    /// in this call; `grads` are all gradients. The hook may take their values and zero
    /// them (ZeRO-2 reduce-scatters them away after each micro-batch); the call goes on
    /// accumulating into the others.
    fn ready(&mut self, params: &[usize], grads: &mut [&mut [f32]]);
}

/// A [`GradReady`] that ignores everything.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoGradHook;

impl GradReady for NoGradHook {
    fn ready(&mut self, _: &[usize], _: &mut [&mut [f32]]) {}
}

/// The loss of one [`GptModel::forward_backward`] call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossStats {
    /// Mean loss over the loss tokens (or DPO pairs), `loss_sum / loss_count` (0 when there
    /// are none).
    pub loss: f32,
    /// `Σ mask·CE` over the micro-batch (summed in f64); under DPO, `Σ` of the pairs' losses.
    pub loss_sum: f64,
    /// [`TrainBatch::loss_units`]: `Σ mask` over tokens with a label, or the pairs.
    pub loss_count: f64,
    /// DPO's or the reward model's pair metrics, summed over the pairs (`None` for language
    /// modeling).
    pub dpo: Option<DpoStats>,
    /// The MoE layers' balancing losses (already part of the gradient; not in `loss`), of the
    /// layers this call ran (zero without MoE layers).
    pub moe: MoeLosses,
    /// Peak bytes the pass held for its backward (saved activations, logits and recomputed
    /// groups, as the activation ledger counts them) in [`GptModel::forward_backward_with`];
    /// 0 where not measured (forward-only and pipeline-stage passes).
    pub activation_peak_bytes: u128,
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
        // On the calling thread (its kernels fan out to the current rayon pool): a pass's
        // buffers then always come from one thread's allocator heap, so memory freed by the
        // last step is what the next one reuses.
        let mut ledger = memory::Ledger::default();
        let mut acts = self.train_forward(batch, part, None, Some(loss_scale), &mut ledger)?;
        let mut stats = self.loss_and_logit_grad(batch, &mut acts, loss_scale)?;
        stats.moe = acts.moe_losses;
        self.train_backward(batch, acts, grads, &mut ledger, ready, None)?;
        stats.activation_peak_bytes = ledger.peak();
        Ok(stats)
    }

    /// Checks the batch, the recompute setting and that `grads` fit the parameters (one slice
    /// per parameter of its length, empty for a frozen one; named when not).
    fn check_grads(&self, batch: &TrainBatch, grads: &[&mut [f32]]) -> Result<()> {
        batch.validate(self)?;
        self.local_config().validate_recompute()?;
        let table = self.param_table();
        if grads.len() != table.len() {
            return Err(ModelError::Input(format!(
                "{} gradient slices given, the model has {} parameters",
                grads.len(),
                table.len()
            )));
        }
        for (i, (g, d)) in grads.iter().zip(self.layout().decls()).enumerate() {
            let want = if table.is_frozen(i) {
                0
            } else {
                table.numel(i)
            };
            if g.len() != want {
                return Err(ModelError::Input(format!(
                    "{}: gradient slice of {} elements, expected {want} ({})",
                    d.name,
                    g.len(),
                    if want == 0 { "frozen" } else { "its elements" }
                )));
            }
        }
        Ok(())
    }
}
