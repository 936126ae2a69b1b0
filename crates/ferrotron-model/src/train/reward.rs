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
use ferrotron_comm::{Collectives, ReduceOp};
use ferrotron_nn::attention::DocumentStarts;

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
    /// Where each row's reward token lies on this rank: its `[s, b]` index, or `None` where
    /// another context-parallel rank holds it (the token is then found over the group: the
    /// last position of the whole row, among every rank's tokens, that is not the pad id).
    ///
    /// # Errors
    /// A failed all-reduce over the context-parallel group.
    fn reward_tokens(&self, batch: &TrainBatch, pad: Option<u32>) -> Result<Vec<Option<usize>>> {
        let Some(cp) = &self.cp else {
            return Ok(reward_positions(batch, pad).into_iter().map(Some).collect());
        };
        let (b, s) = (batch.micro_batch, batch.seq);
        let documents = match &batch.document_starts {
            Some(d) => {
                Some(DocumentStarts::new(d, b).map_err(|e| ModelError::Input(e.to_string()))?)
            }
            None => None,
        };
        let split = (cp.split(s * cp.size(), b, documents))
            .map_err(|e| ModelError::Input(e.to_string()))?;
        // Global position of each local [s, b] index.
        let mut global = vec![0usize; s * b];
        for run in split.runs(cp.rank()) {
            for (t, pos) in run.local_tokens().zip(run.positions()) {
                run.rows.clone().for_each(|j| global[t * b + j] = pos);
            }
        }
        let counts = |i: &usize| pad.is_none_or(|pad| batch.tokens[*i] != pad);
        let mut last: Vec<f64> = (0..b)
            .map(|j| {
                let local = (0..s).map(|t| t * b + j).filter(counts);
                local.map(|i| global[i] as f64).fold(-1.0, f64::max)
            })
            .collect();
        cp.comm()
            .all_reduce(&mut last, ReduceOp::Max)
            .map_err(|e| ModelError::Comm(format!("reward tokens over context parallel: {e}")))?;
        // No token but padding: HF's argmax reads position 0.
        Ok((0..b)
            .map(|j| {
                let want = last[j].max(0.0) as usize;
                (0..s).map(|t| t * b + j).find(|&i| global[i] == want)
            })
            .collect())
    }

    /// Each row's reward `[b]` from the scores `[s, b]` at its reward tokens (summed over the
    /// context-parallel group, where one rank holds each).
    fn row_rewards(&self, scores: &[f32], tokens: &[Option<usize>]) -> Result<Vec<f64>> {
        let mut r: Vec<f64> = tokens
            .iter()
            .map(|t| t.map_or(0.0, |i| f64::from(scores[i])))
            .collect();
        if let Some(cp) = &self.cp {
            cp.comm()
                .all_reduce(&mut r, ReduceOp::Sum)
                .map_err(|e| ModelError::Comm(format!("rewards over context parallel: {e}")))?;
        }
        Ok(r)
    }

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
        let pad = match &batch.objective {
            super::Objective::Reward(t) => t.pad_token_id,
            _ => None,
        };
        let tokens = self.reward_tokens(batch, pad)?;
        self.row_rewards(acts.dlogits.host(), &tokens)
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
        let tokens = self.reward_tokens(batch, targets.pad_token_id)?;
        let r = self.row_rewards(acts.dlogits.host(), &tokens)?;
        let scores = acts.dlogits.host_mut();
        scores.iter_mut().for_each(|x| *x = 0.0);
        let pairs = (b / 2) as f64;
        // Under context parallelism every rank of the group counts the pairs (`loss_scale` is
        // `1/cp` of their share, as DPO's) while a reward token's gradient comes from the one
        // rank holding it: it takes the whole weight.
        let cp = self.cp.as_ref().map_or(1, |cp| cp.size());
        let (c, scale) = (
            targets.center_rewards_coefficient,
            loss_scale as f64 * cp as f64 / pairs,
        );
        let mut set = |row: usize, grad: f64| {
            if let Some(i) = tokens[row] {
                scores[i] = grad as f32;
            }
        };
        let mut stats = DpoStats::default();
        let mut loss_sum = 0.0;
        for k in 0..b / 2 {
            let (rc, rr) = (r[2 * k], r[2 * k + 1]);
            let (delta, sum) = (rc - rr - targets.margins[k], rc + rr);
            loss_sum += -log_sigmoid(delta) + c * sum * sum;
            // ∂/∂Δ −logσ(Δ) = −σ(−Δ), Δ = r_c − r_r − m; ∂/∂r of c·(r_c + r_r)² = 2c·(r_c + r_r).
            let sig = sigmoid(-delta);
            set(2 * k, scale * (-sig + 2.0 * c * sum));
            set(2 * k + 1, scale * (sig + 2.0 * c * sum));
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
