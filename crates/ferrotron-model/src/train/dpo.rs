//! Direct preference optimization (Rafailov et al. 2023) as TRL's `DPOTrainer` computes it
//! (`loss_type="sigmoid"`): per pair, `z = (logπ(c) − logπ(r)) − (logπ_ref(c) − logπ_ref(r))`
//! with log-probs **summed** over the completion tokens (the loss mask), and
//! `loss = −(1−ε)·logσ(β·z) − ε·logσ(−β·z)`.
//!
//! The gradient reuses the cross-entropy kernel: `∂ logπ(y)/∂logits_t = −∂CE_t/∂logits_t`
//! on every completion token, so the token gradients of one sequence are its CE gradients
//! times one weight, `−∂loss/∂logπ`. At step 0 (policy = reference) `z = 0`, the loss is
//! `ln 2` and every reward 0.

use super::forward::Activations;
use super::memory::Ledger;
use super::{LossStats, TrainBatch};
use crate::{GptModel, ModelError, Result};

/// A micro-batch of preference pairs: rows `2k` (chosen) and `2k + 1` (rejected) share a
/// prompt; the loss mask marks each row's completion tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct DpoTargets {
    /// `β`, the strength of the KL penalty (TRL's default 0.1); > 0.
    pub beta: f64,
    /// `ε`, the label smoothing of the conservative DPO loss (TRL's default 0); in `[0, 0.5)`.
    pub label_smoothing: f64,
    /// `logπ_ref` of each row `[b]`: the reference model's summed completion log-probs
    /// ([`GptModel::sequence_logps`] of the frozen reference, or of the policy with its
    /// adapters disabled).
    pub reference_logps: Vec<f64>,
}

impl DpoTargets {
    pub(crate) fn validate(&self, micro_batch: usize) -> Result<()> {
        let bad = |m: String| Err(ModelError::Input(format!("DPO batch: {m}")));
        if !micro_batch.is_multiple_of(2) {
            return bad(format!(
                "{micro_batch} rows do not form chosen/rejected pairs"
            ));
        }
        if self.reference_logps.len() != micro_batch {
            return bad(format!(
                "{} reference log-probs for {micro_batch} rows",
                self.reference_logps.len()
            ));
        }
        if !(self.beta.is_finite() && self.beta > 0.0) {
            return bad(format!("beta must be > 0, got {}", self.beta));
        }
        if !(0.0..0.5).contains(&self.label_smoothing) {
            return bad(format!(
                "label_smoothing must be in [0, 0.5), got {}",
                self.label_smoothing
            ));
        }
        Ok(())
    }
}

/// TRL's DPO metrics of a micro-batch, **summed** over its pairs (divide by `pairs`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DpoStats {
    /// Pairs.
    pub pairs: f64,
    /// `Σ β·(logπ(c) − logπ_ref(c))` (`rewards/chosen`).
    pub rewards_chosen: f64,
    /// `Σ β·(logπ(r) − logπ_ref(r))` (`rewards/rejected`).
    pub rewards_rejected: f64,
    /// Pairs whose chosen reward beats the rejected one (`rewards/accuracies`).
    pub accuracies: f64,
    /// `Σ logπ(c)` (`logps/chosen`).
    pub logps_chosen: f64,
    /// `Σ logπ(r)` (`logps/rejected`).
    pub logps_rejected: f64,
}

/// What [`GptModel::stage_sequence_logps`] gives: the stage's output for the next stage, or
/// on the last the rows' summed log-probs `[b]`.
#[derive(Clone, Debug, PartialEq)]
pub enum StageLogps {
    Output(Vec<f32>),
    Logps(Vec<f64>),
}

impl DpoStats {
    /// The sums in field order (for collectives).
    pub fn to_array(&self) -> [f64; 6] {
        [
            self.pairs,
            self.rewards_chosen,
            self.rewards_rejected,
            self.accuracies,
            self.logps_chosen,
            self.logps_rejected,
        ]
    }

    /// The inverse of [`DpoStats::to_array`].
    pub fn from_array(v: [f64; 6]) -> DpoStats {
        let [
            pairs,
            rewards_chosen,
            rewards_rejected,
            accuracies,
            logps_chosen,
            logps_rejected,
        ] = v;
        DpoStats {
            pairs,
            rewards_chosen,
            rewards_rejected,
            accuracies,
            logps_chosen,
            logps_rejected,
        }
    }

    /// Adds `other`'s sums to these.
    pub fn add(&mut self, other: &DpoStats) {
        let (a, b) = (self.to_array(), other.to_array());
        *self = DpoStats::from_array(std::array::from_fn(|i| a[i] + b[i]));
    }
}

/// `ln σ(x)`, stable for large `|x|`.
pub(super) fn log_sigmoid(x: f64) -> f64 {
    -((-x).max(0.0) + (-x.abs()).exp().ln_1p())
}

/// `σ(x) = 1 / (1 + e^{−x})`.
pub(super) fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// TRL's sigmoid loss of one pair at `z` and its derivative `∂loss/∂z`.
fn sigmoid_loss(z: f64, beta: f64, eps: f64) -> (f64, f64) {
    let loss = -(1.0 - eps) * log_sigmoid(beta * z) - eps * log_sigmoid(-beta * z);
    let dz = -(1.0 - eps) * beta * sigmoid(-beta * z) + eps * beta * sigmoid(beta * z);
    (loss, dz)
}

/// Each row's `Σ_t −losses[t·b + j]` (the row's summed completion log-prob) `[b]`.
fn row_logps(losses: &[f32], b: usize) -> Vec<f64> {
    let mut out = vec![0f64; b];
    for (i, &l) in losses.iter().enumerate() {
        out[i % b] -= l as f64;
    }
    out
}

impl GptModel {
    /// [`row_logps`] of the whole sequences: on a context-parallel rank, which holds two of
    /// each row's `2·cp` chunks, the sums of every rank's share (all-reduced over the group).
    fn sequence_sums(&self, losses: &[f32], b: usize) -> Result<Vec<f64>> {
        let mut logps = row_logps(losses, b);
        if let Some(cp) = &self.cp {
            use ferrotron_comm::Collectives;
            cp.comm()
                .all_reduce(&mut logps, ferrotron_comm::ReduceOp::Sum)
                .map_err(|e| ModelError::Comm(e.to_string()))?;
        }
        Ok(logps)
    }

    /// The summed log-prob of each row's masked tokens `[b]` (`Σ_t mask·log p(label_t)`):
    /// the training forward without a backward. Whole models and tensor-parallel shards.
    ///
    /// # Errors
    /// A pipeline stage; what the training forward reports.
    pub fn sequence_logps(&self, batch: &TrainBatch) -> Result<Vec<f64>> {
        if !self.is_pre_process() || !self.is_post_process() {
            return Err(ModelError::Input(
                "sequence_logps needs every layer (not a pipeline stage)".into(),
            ));
        }
        match self.stage_sequence_logps(batch, 0, None)? {
            StageLogps::Logps(logps) => Ok(logps),
            StageLogps::Output(_) => unreachable!("a whole model ends with its head"),
        }
    }

    /// [`GptModel::sequence_logps`] through one pipeline stage's model chunk `chunk` (see
    /// [`GptModel::stage_forward`] for `input`): the log-probs on the last virtual stage,
    /// otherwise the output `[local rows, h]` for the next one. No activations are kept.
    ///
    /// # Errors
    /// As [`GptModel::stage_forward`].
    pub fn stage_sequence_logps(
        &self,
        batch: &TrainBatch,
        chunk: usize,
        input: Option<Vec<f32>>,
    ) -> Result<StageLogps> {
        let part = self.chunk_part(chunk)?;
        let post_process = part.post_process;
        let mut acts = self.train_forward(batch, part, input, None, &mut Ledger::default())?;
        if !post_process {
            return Ok(StageLogps::Output(
                std::mem::take(&mut acts.x_final).into_host(),
            ));
        }
        let rows = batch.tokens.len();
        let losses = self.token_losses(batch, acts.dlogits.host_mut(), &vec![0.0; rows])?;
        Ok(StageLogps::Logps(
            self.sequence_sums(&losses, batch.micro_batch)?,
        ))
    }

    /// DPO's loss over the pairs of `batch` (see the module doc), replacing the logits in
    /// `acts.dlogits` with the gradient of `loss_scale ·` their mean loss.
    pub(crate) fn dpo_loss_and_logit_grad(
        &self,
        batch: &TrainBatch,
        targets: &DpoTargets,
        acts: &mut Activations,
        loss_scale: f32,
    ) -> Result<LossStats> {
        let (b, rows) = (batch.micro_batch, batch.tokens.len());
        let dlogits = acts.dlogits.host_mut();
        let losses = self.token_losses(batch, dlogits, &vec![1.0; rows])?;
        let logps = self.sequence_sums(&losses, b)?;
        let (beta, eps) = (targets.beta, targets.label_smoothing);
        let reference = &targets.reference_logps;
        let mut stats = DpoStats::default();
        let mut loss_sum = 0.0;
        let mut weights = vec![0f32; b];
        // The gradient of `loss_scale ·` the mean over the pairs. Under context parallelism
        // every rank of the group counts the pairs (the loss units summed over data x
        // context are `cp` times the pairs, so `loss_scale` is `1/cp` of the pairs' share)
        // while each token's gradient comes from one rank: it takes the whole weight.
        let cp = self.cp.as_ref().map_or(1, |cp| cp.size());
        let scale = loss_scale as f64 * cp as f64 / (b / 2) as f64;
        for k in 0..b / 2 {
            let (c, r) = (2 * k, 2 * k + 1);
            let (chosen, rejected) = (logps[c] - reference[c], logps[r] - reference[r]);
            let (loss, dz) = sigmoid_loss(chosen - rejected, beta, eps);
            loss_sum += loss;
            // dlogits holds ∂CE/∂logits = −∂logπ/∂logits, and ∂z/∂logπ(c) = 1 = −∂z/∂logπ(r).
            weights[c] = (-dz * scale) as f32;
            weights[r] = (dz * scale) as f32;
            stats.add(&DpoStats {
                pairs: 1.0,
                rewards_chosen: beta * chosen,
                rewards_rejected: beta * rejected,
                accuracies: f64::from(u8::from(chosen > rejected)),
                logps_chosen: logps[c],
                logps_rejected: logps[r],
            });
        }
        let v = dlogits.len() / rows;
        for (i, row) in dlogits.chunks_exact_mut(v).enumerate() {
            let w = weights[i % b];
            row.iter_mut().for_each(|x| *x *= w);
        }
        let pairs = (b / 2) as f64;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sigmoid_loss_is_ln2_at_zero_and_its_derivative_is_exact() {
        let (l, d) = sigmoid_loss(0.0, 0.1, 0.0);
        assert_eq!(l, std::f64::consts::LN_2);
        assert_eq!(d, -0.05);
        for (z, eps) in [(3.0, 0.0), (-2.0, 0.1), (40.0, 0.2)] {
            let h = 1e-5;
            let fd =
                (sigmoid_loss(z + h, 0.5, eps).0 - sigmoid_loss(z - h, 0.5, eps).0) / (2.0 * h);
            assert!((fd - sigmoid_loss(z, 0.5, eps).1).abs() < 1e-8, "{z} {eps}");
        }
        assert!(log_sigmoid(-800.0).is_finite() && log_sigmoid(800.0) == 0.0);
    }
}
