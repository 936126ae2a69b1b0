//! DPO in the trainer (TRL's `DPOTrainer` over our passes): each micro-batch of preference
//! pairs gets its reference log-probs before its forward — from the policy with its LoRA
//! adapters disabled (TRL's PEFT reference) or from a frozen copy of the model taken when the
//! trainer was built — and the metrics TRL logs, summed over the data-parallel ranks.

use super::{Result, TrainError, Trainer};
use ferrotron_data::MicroBatch;
use ferrotron_model::{DpoStats, DpoTargets, GptModel, Objective, RewardTargets, TrainBatch};
use serde::{Deserialize, Serialize};

/// Where DPO's reference log-probs come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DpoReference {
    /// The policy with its LoRA adapters disabled: the base model (TRL with a PEFT model and
    /// no `ref_model`). Needs a LoRA model; costs one more forward per micro-batch.
    AdaptersDisabled,
    /// A frozen copy of the model as the trainer got it (TRL's `ref_model`): one more copy
    /// of the weights and one more forward per micro-batch.
    FrozenCopy,
}

/// A reward model (`data.dataset_type = "reward"`): TRL's `RewardTrainer` loss over pairs of
/// rows (chosen, rejected), the model's score head read at each row's last real token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RewardOptions {
    /// TRL's `center_rewards_coefficient` (0: off).
    pub center_rewards_coefficient: f64,
    /// The model's `pad_token_id`: each row's reward is read at its last other token, as
    /// HF's `...ForSequenceClassification` reads it ([`RewardTargets::pad_token_id`]).
    pub pad_token_id: Option<u32>,
}

/// `data.dataset_type = "dpo"`: the loss is DPO's over pairs of rows (chosen, rejected).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DpoOptions {
    /// `β` (TRL's default 0.1).
    pub beta: f64,
    /// `ε` of the conservative loss (TRL's default 0).
    pub label_smoothing: f64,
    /// The reference model.
    pub reference: DpoReference,
}

/// TRL's DPO metrics, means over pairs, for the log lines and `metrics.jsonl`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct DpoMetrics {
    /// `rewards/chosen`: mean `β·(logπ(c) − logπ_ref(c))`.
    pub rewards_chosen: f64,
    /// `rewards/rejected`.
    pub rewards_rejected: f64,
    /// `rewards/margins`: chosen − rejected.
    pub rewards_margins: f64,
    /// `rewards/accuracies`: the fraction of pairs whose chosen reward is higher.
    pub rewards_accuracies: f64,
    /// `logps/chosen`: mean summed completion log-prob of the chosen answers.
    pub logps_chosen: f64,
    /// `logps/rejected`.
    pub logps_rejected: f64,
}

impl DpoMetrics {
    /// The means of `sums`; `None` without pairs.
    pub fn from_sums(sums: &DpoStats) -> Option<DpoMetrics> {
        let n = sums.pairs;
        (n > 0.0).then(|| DpoMetrics {
            rewards_chosen: sums.rewards_chosen / n,
            rewards_rejected: sums.rewards_rejected / n,
            rewards_margins: (sums.rewards_chosen - sums.rewards_rejected) / n,
            rewards_accuracies: sums.accuracies / n,
            logps_chosen: sums.logps_chosen / n,
            logps_rejected: sums.logps_rejected / n,
        })
    }
}

impl std::fmt::Display for DpoMetrics {
    /// `rewards/chosen: x | rewards/rejected: y | rewards/margins: z | rewards/accuracies: a |`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, " rewards/chosen: {:.4} |", self.rewards_chosen)?;
        write!(f, " rewards/rejected: {:.4} |", self.rewards_rejected)?;
        write!(f, " rewards/margins: {:.4} |", self.rewards_margins)?;
        write!(f, " rewards/accuracies: {:.3} |", self.rewards_accuracies)
    }
}

/// The frozen reference copy of `model` when `options` asks for one; checks that the model
/// can run DPO with this reference.
pub(super) fn reference_copy(
    model: &GptModel,
    options: Option<&DpoOptions>,
) -> Result<Option<GptModel>> {
    let Some(dpo) = options else {
        return Ok(None);
    };
    match dpo.reference {
        DpoReference::FrozenCopy => Ok(Some(model.clone())),
        DpoReference::AdaptersDisabled if model.config().lora.is_none() => Err(TrainError::Config(
            "DPO's reference without adapters needs a LoRA model (lora.enabled), or a \
                 frozen copy as the reference"
                .into(),
        )),
        DpoReference::AdaptersDisabled => Ok(None),
    }
}

impl Trainer {
    /// Gives every batch its objective: a reward model's targets (with the pairs' margins of
    /// its micro-batch in `micro_batches`), or DPO's (the reference log-probs of its rows);
    /// language modeling otherwise.
    ///
    /// # Errors
    /// A failed reference forward.
    pub(super) fn attach_objective(
        &mut self,
        batches: &mut [TrainBatch],
        micro_batches: &[MicroBatch],
    ) -> Result<()> {
        if let Some(reward) = self.options.reward {
            for (batch, mb) in batches.iter_mut().zip(micro_batches) {
                // Both rows of a pair carry its margin: the chosen (even) rows give it.
                let margins = mb.margins.iter().step_by(2).map(|&m| f64::from(m));
                batch.objective = Objective::Reward(RewardTargets {
                    center_rewards_coefficient: reward.center_rewards_coefficient,
                    pad_token_id: reward.pad_token_id,
                    margins: margins.collect(),
                });
            }
            return Ok(());
        }
        let Some(dpo) = self.options.dpo else {
            return Ok(());
        };
        // The reference forward reads every parameter: the last step's gathers must be in.
        self.finish_param_gather()?;
        let pp = self.pp.clone();
        let logps = self.with_reference(|model| match &pp {
            Some(pp) => super::pipeline_exec::pipeline_logps(model, pp, batches),
            None => batches
                .iter()
                .map(|b| Ok(Some(model.sequence_logps(b)?)))
                .collect(),
        })?;
        for (batch, reference) in batches.iter_mut().zip(logps) {
            // Stages before the last never read the reference: their loss is the last's.
            let reference_logps = reference.unwrap_or_else(|| vec![0.0; batch.micro_batch]);
            batch.objective = Objective::Dpo(DpoTargets {
                beta: dpo.beta,
                label_smoothing: dpo.label_smoothing,
                reference_logps,
            });
        }
        Ok(())
    }

    /// `f` of DPO's reference model: the frozen copy, or this model with its adapters off.
    fn with_reference<T>(&mut self, f: impl FnOnce(&GptModel) -> Result<T>) -> Result<T> {
        if let Some(reference) = &self.dpo_reference {
            return f(reference);
        }
        self.model.set_adapters_enabled(false);
        let out = f(&self.model);
        self.model.set_adapters_enabled(true);
        out
    }

    /// `local` (this rank's sums) summed over the data-parallel ranks. Collective.
    pub(super) fn sum_dpo_stats(&self, local: Option<DpoStats>) -> Result<Option<DpoStats>> {
        let Some(s) = local else {
            return Ok(None);
        };
        let mut v = s.to_array();
        self.dp.sum(&mut v)?;
        // The context-parallel ranks of a data-parallel rank report the same pairs.
        let cp = self.model.context_parallel().map_or(1, |cp| cp.size());
        v.iter_mut().for_each(|x| *x /= cp as f64);
        Ok(Some(DpoStats::from_array(v)))
    }
}
