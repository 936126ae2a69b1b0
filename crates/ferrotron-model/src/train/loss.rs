//! The loss of the last pipeline stage: Megatron's masked-mean cross entropy over the
//! logits, fused with its gradient (vocab-parallel on a tensor-parallel shard), and the row
//! counts a pass works with.

use super::forward::Activations;
use super::{LossStats, Objective, TrainBatch};
use crate::{GptModel, Result};
use ferrotron_nn::tensor_parallel::vocab_parallel_cross_entropy;
use ferrotron_tensor::ops::{VocabShard, cross_entropy_fused_inplace};

impl GptModel {
    /// Values in the activation a pipeline stage passes on for `batch` (`[local rows, h]`).
    ///
    /// # Errors
    /// Sequence parallelism cannot split the sequence.
    pub fn activation_len(&self, batch: &TrainBatch) -> Result<usize> {
        Ok(self.local_rows(batch)? * self.local_config().hidden_size)
    }

    /// Rows of this rank's residual stream for `batch`: all `s·b`, or `1/t` of them under
    /// sequence parallelism.
    ///
    /// # Errors
    /// Sequence parallelism cannot split the sequence.
    pub(crate) fn local_rows(&self, batch: &TrainBatch) -> Result<usize> {
        match &self.tp {
            Some(tp) => Ok(tp.group.local_rows(batch.seq, batch.micro_batch)?),
            None => Ok(batch.tokens.len()),
        }
    }

    /// Cross entropy of the logits in `acts.dlogits` (Megatron's masked mean), replacing them
    /// with the gradient of `loss_scale · loss`; DPO's or a reward model's loss instead for a
    /// batch of pairs ([`TrainBatch::objective`]).
    pub(crate) fn loss_and_logit_grad(
        &self,
        batch: &TrainBatch,
        acts: &mut Activations,
        loss_scale: f32,
    ) -> Result<LossStats> {
        match &batch.objective {
            Objective::LanguageModel => {}
            Objective::Dpo(t) => return self.dpo_loss_and_logit_grad(batch, t, acts, loss_scale),
            Objective::Reward(t) => {
                return self.reward_loss_and_logit_grad(batch, t, acts, loss_scale);
            }
        }
        let rows = batch.tokens.len();
        let count = batch.loss_token_count();
        let dl = if count > 0.0 {
            (loss_scale as f64 / count) as f32
        } else {
            0.0
        };
        let losses = self.token_losses(batch, acts.dlogits.host_mut(), &vec![dl; rows])?;
        let loss_sum: f64 = losses.iter().map(|&l| l as f64).sum();
        let loss = if count > 0.0 {
            (loss_sum / count) as f32
        } else {
            0.0
        };
        Ok(LossStats {
            loss,
            loss_sum,
            loss_count: count,
            dpo: None,
            moe: Default::default(),
            activation_peak_bytes: 0,
        })
    }

    /// Per-token `mask·CE` `[rows]` of the logits `[rows, v]` (this rank's vocabulary part on
    /// a tensor-parallel shard), which become `dloss[t]·mask·(softmax − onehot)`.
    pub(crate) fn token_losses(
        &self,
        batch: &TrainBatch,
        dlogits: &mut [f32],
        dloss: &[f32],
    ) -> Result<Vec<f32>> {
        let mut losses = vec![0f32; batch.tokens.len()];
        match &self.tp {
            None => cross_entropy_fused_inplace(
                dlogits,
                &batch.labels,
                batch.loss_mask.as_deref(),
                dloss,
                &mut losses,
                self.local_config().vocab_size,
            )?,
            Some(tp) => {
                let shard = VocabShard {
                    labels: &batch.labels,
                    loss_mask: batch.loss_mask.as_deref(),
                    v_local: self.local_config().vocab_size,
                    valid: tp.vocab_valid,
                    vocab_start: tp.vocab_start,
                };
                vocab_parallel_cross_entropy(
                    &tp.group,
                    &shard,
                    self.config().vocab_size,
                    dlogits,
                    dloss,
                    &mut losses,
                )?;
            }
        }
        Ok(losses)
    }
}
