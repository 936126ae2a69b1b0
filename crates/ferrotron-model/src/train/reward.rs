//! A reward model's pairwise loss (TRL's `RewardTrainer`, Bradley-Terry): per pair of rows,
//! `loss = −logσ(r_c − r_r − m) + c·(r_c + r_r)²` averaged over the pairs (`m` the pair's
//! optional `margin`, TRL's dataset column), the reward `r` of a row
//! being its score head's output at the row's last token that is not `pad_token_id`, exactly
//! where HF's `...ForSequenceClassification` reads it (`GenericForSequenceClassification`:
//! the largest index whose token differs from the pad id, 0 when every token is padding); `c`
//! is TRL's `center_rewards_coefficient`. A model whose pad token is also its end-of-turn
//! token (SmolLM2's `<|im_end|>`) is thus read at what follows the last end token, as HF
//! reads it.

use super::dpo::{log_sigmoid, sigmoid};
use super::forward::Activations;
use super::{DpoStats, LossStats, TrainBatch};
use crate::{GptModel, ModelError, OutputHead, Result};

/// A micro-batch of preference pairs for a reward model: rows `2k` (chosen) and `2k + 1`
/// (rejected); the loss mask marks each row's completion, whose end carries the reward.
#[derive(Clone, Debug, PartialEq)]
pub struct RewardTargets {
    /// TRL's `center_rewards_coefficient` (0 turns the centering term off); >= 0.
    pub center_rewards_coefficient: f64,
    /// The model's `pad_token_id` (HF's `config.pad_token_id`): each row's reward is read at
    /// its last other token. `None`: at the row's last position (HF's rule without a pad
    /// id, for rows that are not padded).
    pub pad_token_id: Option<u32>,
    /// `[b / 2]` each pair's `margin` (TRL: the chosen reward must beat the rejected one by
    /// it; 0 for none).
    pub margins: Vec<f64>,
}

impl RewardTargets {
    pub(crate) fn validate(&self, micro_batch: usize) -> Result<()> {
        if !micro_batch.is_multiple_of(2) {
            return Err(ModelError::Input(format!(
                "reward batch: {micro_batch} rows do not form chosen/rejected pairs"
            )));
        }
        if self.margins.len() != micro_batch / 2 || self.margins.iter().any(|m| !m.is_finite()) {
            return Err(ModelError::Input(format!(
                "reward batch: {} margins for {} pairs (finite, one per pair)",
                self.margins.len(),
                micro_batch / 2
            )));
        }
        let c = self.center_rewards_coefficient;
        if !(c.is_finite() && c >= 0.0) {
            return Err(ModelError::Input(format!(
                "reward batch: center_rewards_coefficient must be >= 0, got {c}"
            )));
        }
        Ok(())
    }
}

/// The `[s, b]` index of each row's reward token: its last token other than `pad_token_id`
/// (position 0 when it has none, as HF's argmax gives), or its last position without a pad
/// id (see the module doc).
pub(crate) fn reward_positions(batch: &TrainBatch, pad_token_id: Option<u32>) -> Vec<usize> {
    let (b, s) = (batch.micro_batch, batch.seq);
    (0..b)
        .map(|j| {
            let t = match pad_token_id {
                None => s - 1,
                Some(pad) => (0..s)
                    .rev()
                    .find(|&t| batch.tokens[t * b + j] != pad)
                    .unwrap_or(0),
            };
            t * b + j
        })
        .collect()
}

impl GptModel {
    /// The reward of each row `[b]` (the score at its reward token, see the module doc, with
    /// the pad id of the batch's [`RewardTargets`], its last position without them): the
    /// training forward without a backward. A whole model with a score head.
    ///
    /// # Errors
    /// No score head, a pipeline stage, or what the training forward reports.
    pub fn rewards(&self, batch: &TrainBatch) -> Result<Vec<f64>> {
        self.require_score_head(true)?;
        let part = self.chunk_part(0)?;
        let acts = self.train_forward(
            batch,
            part,
            None,
            None,
            &mut super::memory::Ledger::default(),
        )?;
        let scores = acts.dlogits.host();
        let pad = match &batch.objective {
            super::Objective::Reward(t) => t.pad_token_id,
            _ => None,
        };
        Ok(reward_positions(batch, pad)
            .iter()
            .map(|&i| scores[i] as f64)
            .collect())
    }

    /// A score head on this stage (the last), and the whole model when `whole`.
    fn require_score_head(&self, whole: bool) -> Result<()> {
        if self.config().output_head != OutputHead::Score || !self.is_post_process() {
            return Err(ModelError::Input(
                "a reward needs a model (or last pipeline stage) with a score head \
                 (OutputHead::Score)"
                    .into(),
            ));
        }
        if whole && !self.is_pre_process() {
            return Err(ModelError::Input(
                "rewards are computed by the whole model (not a pipeline stage)".into(),
            ));
        }
        Ok(())
    }

    /// The reward model's loss over the pairs of `batch`, replacing the scores in
    /// `acts.dlogits` (`[rows, 1]`) with the gradient of `loss_scale ·` their mean loss
    /// (nonzero only at the reward tokens). The stats reuse DPO's fields: rewards, accuracies
    /// (chosen above rejected), no log-probs.
    pub(crate) fn reward_loss_and_logit_grad(
        &self,
        batch: &TrainBatch,
        targets: &RewardTargets,
        acts: &mut Activations,
        loss_scale: f32,
    ) -> Result<LossStats> {
        self.require_score_head(false)?;
        let b = batch.micro_batch;
        let positions = reward_positions(batch, targets.pad_token_id);
        let scores = acts.dlogits.host_mut();
        let r: Vec<f64> = positions.iter().map(|&i| scores[i] as f64).collect();
        scores.iter_mut().for_each(|x| *x = 0.0);
        let pairs = (b / 2) as f64;
        let (c, scale) = (
            targets.center_rewards_coefficient,
            loss_scale as f64 / pairs,
        );
        let mut stats = DpoStats::default();
        let mut loss_sum = 0.0;
        for k in 0..b / 2 {
            let (rc, rr) = (r[2 * k], r[2 * k + 1]);
            let (delta, sum) = (rc - rr - targets.margins[k], rc + rr);
            loss_sum += -log_sigmoid(delta) + c * sum * sum;
            // ∂/∂Δ −logσ(Δ) = −σ(−Δ), Δ = r_c − r_r − m; ∂/∂r of c·(r_c + r_r)² = 2c·(r_c + r_r).
            let sig = sigmoid(-delta);
            scores[positions[2 * k]] = (scale * (-sig + 2.0 * c * sum)) as f32;
            scores[positions[2 * k + 1]] = (scale * (sig + 2.0 * c * sum)) as f32;
            stats.add(&DpoStats {
                pairs: 1.0,
                rewards_chosen: rc,
                rewards_rejected: rr,
                accuracies: f64::from(u8::from(rc > rr)),
                ..DpoStats::default()
            });
        }
        Ok(LossStats {
            loss: (loss_sum / pairs) as f32,
            loss_sum,
            loss_count: pairs,
            dpo: Some(stats),
            moe: Default::default(),
            activation_peak_bytes: 0,
        })
    }
}

impl GptModel {
    /// This whole causal LM as a reward model (HF's `AutoModelForSequenceClassification` with
    /// `num_labels = 1` on a causal LM checkpoint): the output layer (or the tie to the
    /// embedding) replaced by a `score` head `[1, h]` drawn `N(0, init.init_method_std)` from
    /// `init.seed`, every other parameter kept.
    ///
    /// # Errors
    /// A shard or stage, or a model that has a score head already.
    pub fn with_score_head(self, init: &crate::InitConfig) -> Result<GptModel> {
        self.require_whole("a score head is added")?;
        if self.config().output_head == OutputHead::Score {
            return Err(ModelError::Input(
                "the model has a score head already".into(),
            ));
        }
        let mut config = self.config().clone();
        config.output_head = OutputHead::Score;
        let whole = crate::module::ModelPart::whole(config.num_layers);
        let layout = crate::module::ModelLayout::new(&config, config.vocab_size, &whole);
        let names: Vec<String> = self
            .layout()
            .decls()
            .iter()
            .map(|d| d.name.clone())
            .collect();
        let mut old: Vec<Option<crate::ParamValue>> = self
            .into_param_table()
            .into_values()
            .into_iter()
            .map(Some)
            .collect();
        let values = layout
            .decls()
            .iter()
            .map(|d| match names.iter().position(|n| *n == d.name) {
                Some(i) => old[i]
                    .take()
                    .ok_or_else(|| ModelError::Input(format!("{}: declared twice", d.name))),
                None => Ok(crate::ParamValue::Dense(crate::init::init_param(
                    d, init, 0.0,
                )?)),
            })
            .collect::<Result<Vec<_>>>()?;
        GptModel::from_values(config, values)
    }
}
