//! [`TrainerOptions`]: the plain settings of the training loop (the CLI maps the TOML run
//! config onto them).

use super::{Result, TrainError};
use ferrotron_optim::offload::OffloadConfig;
use ferrotron_optim::{
    AdamWConfig, DynamicGradScalerConfig, LrDecayStyle, OptimizerConfig, Precision, ScheduleUnit,
    SchedulerConfig,
};

/// Batch sizes, iteration counts, logging/eval cadence and the optimizer + LR schedule of a
/// run, as every rank sees them (Megatron argument names without the dashes).
#[derive(Clone, Debug, PartialEq)]
pub struct TrainerOptions {
    /// Sequences per forward/backward pass (`micro_batch_size`).
    pub micro_batch_size: usize,
    /// Sequences per optimizer step over all data-parallel ranks (`global_batch_size`); a
    /// multiple of `micro_batch_size · data_parallel_size`.
    pub global_batch_size: usize,
    /// Data-parallel ranks sharing each global batch (1 on a single rank); must equal the
    /// size of the trainer's [`DataParallel`](super::DataParallel) group.
    pub data_parallel_size: usize,
    /// Gradient elements per DDP bucket (`ddp_bucket_size`); `None` = Megatron's default
    /// `max(4e7, 1e6 · data_parallel_size)`.
    pub ddp_bucket_size: Option<usize>,
    /// Optimizer steps of the run (`train_iters`).
    pub train_iters: u64,
    /// Iterations per log line (`log_interval`), > 0.
    pub log_interval: u64,
    /// Iterations between validations (`eval_interval`); 0 = never.
    pub eval_interval: u64,
    /// Global batches per validation (`eval_iters`).
    pub eval_iters: usize,
    /// Peak learning rate (`lr`).
    pub lr: f64,
    /// Final learning rate (`min_lr`).
    pub min_lr: f64,
    /// Linear warmup iterations from 0 to `lr` (`lr_warmup_iters`).
    pub lr_warmup_iters: u64,
    /// Iterations of the decay from `lr` to `min_lr` (`lr_decay_iters`); `None` = `train_iters`.
    pub lr_decay_iters: Option<u64>,
    /// Decay shape after warmup (`lr_decay_style`).
    pub lr_decay_style: LrDecayStyle,
    /// Decoupled AdamW weight decay (`weight_decay`); never applied to norms and biases.
    pub weight_decay: f64,
    /// `adam_beta1`.
    pub adam_beta1: f64,
    /// `adam_beta2`.
    pub adam_beta2: f64,
    /// `adam_eps`.
    pub adam_eps: f64,
    /// Max global gradient L2 norm (`clip_grad`); 0 disables clipping.
    pub clip_grad: f64,
    /// Parameter precision (Megatron `--bf16` / `--fp16` / neither): the flat buffer holds
    /// parameters of [`Precision::param_dtype`], gradients, master weights and Adam moments
    /// stay f32. The model's weights must be stored in the same dtype.
    pub precision: Precision,
    /// fp16 only: a constant loss scale (`loss_scale`); `None` = dynamic scaling.
    pub loss_scale: Option<f32>,
    /// fp16 only: the dynamic loss scaler (`initial_loss_scale`, `min_loss_scale`,
    /// `loss_scale_window`, `hysteresis`).
    pub dynamic_loss_scale: DynamicGradScalerConfig,
    /// Stop (after saving, when saving) at the first iteration divisible by this
    /// (`exit_interval`); `None` runs to `train_iters`.
    pub exit_interval: Option<u64>,
    /// Run seed (`seed`). The step itself draws no random numbers yet (no dropout); kept so
    /// the CLI and checkpoints carry it.
    pub seed: u64,
    /// DPO over pairs of rows instead of language modeling (`data.dataset_type = "dpo"`):
    /// each micro-batch's rows `2k` (chosen) and `2k + 1` (rejected) are a pair, so
    /// `micro_batch_size` counts rows and must be even; the loss is the mean over the
    /// global batch's pairs.
    pub dpo: Option<super::DpoOptions>,
    /// A reward model over pairs of rows (`data.dataset_type = "reward"`), as [`Self::dpo`]
    /// counts rows; not with `dpo`.
    pub reward: Option<super::RewardOptions>,
    /// Where the optimizer state lives (`optimizer.optimizer_offload_policy` and friends).
    pub offload: OffloadConfig,
}

impl Default for TrainerOptions {
    /// Megatron's defaults where it has them (`adam_beta2` 0.999, `weight_decay` 0.01,
    /// `clip_grad` 1.0, `log_interval` 100, `eval_interval` 1000, `eval_iters` 100), with a
    /// cosine schedule and one sequence per step.
    fn default() -> Self {
        TrainerOptions {
            micro_batch_size: 1,
            global_batch_size: 1,
            data_parallel_size: 1,
            ddp_bucket_size: None,
            train_iters: 1,
            log_interval: 100,
            eval_interval: 1000,
            eval_iters: 100,
            lr: 3e-4,
            min_lr: 0.0,
            lr_warmup_iters: 0,
            lr_decay_iters: None,
            lr_decay_style: LrDecayStyle::Cosine,
            weight_decay: 0.01,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_eps: 1e-8,
            clip_grad: 1.0,
            precision: Precision::Fp32,
            loss_scale: None,
            dynamic_loss_scale: DynamicGradScalerConfig::default(),
            exit_interval: None,
            dpo: None,
            reward: None,
            seed: 1234,
            offload: OffloadConfig::default(),
        }
    }
}

impl TrainerOptions {
    /// Micro-batches per optimizer step, `global_batch_size / micro_batch_size` (valid
    /// options only).
    pub fn num_microbatches(&self) -> usize {
        self.global_batch_size / (self.micro_batch_size * self.data_parallel_size).max(1)
    }

    /// Checks the batch sizes and cadences here and the optimizer and schedule settings
    /// through their own validation, listing every problem found.
    ///
    /// # Errors
    /// [`TrainError::Config`] with one line per problem.
    pub fn validate(&self) -> Result<()> {
        let mut problems = Vec::new();
        let per_step = self.micro_batch_size * self.data_parallel_size;
        if self.micro_batch_size == 0 || self.data_parallel_size == 0 {
            problems.push("micro_batch_size and data_parallel_size must be > 0".to_string());
        } else if self.global_batch_size == 0 || !self.global_batch_size.is_multiple_of(per_step) {
            problems.push(format!(
                "global_batch_size {} is not a positive multiple of micro_batch_size {} x \
                 data_parallel_size {}",
                self.global_batch_size, self.micro_batch_size, self.data_parallel_size
            ));
        }
        let pairwise = self.dpo.is_some() || self.reward.is_some();
        if pairwise && !self.micro_batch_size.is_multiple_of(2) {
            problems.push(format!(
                "micro_batch_size {} rows do not form (chosen, rejected) pairs",
                self.micro_batch_size
            ));
        }
        if self.dpo.is_some() && self.reward.is_some() {
            problems.push("dpo and reward are two objectives: set one".to_string());
        }
        if self.ddp_bucket_size == Some(0) {
            problems.push("ddp_bucket_size must be > 0".into());
        }
        if self.train_iters == 0 {
            problems.push("train_iters must be > 0".into());
        }
        if self.exit_interval == Some(0) {
            problems.push("exit_interval must be > 0".into());
        }
        if self.log_interval == 0 {
            problems.push("log_interval must be > 0".into());
        }
        if self.eval_interval > 0 && self.eval_iters == 0 {
            problems.push("eval_iters must be > 0 when eval_interval > 0".into());
        }
        if let Err(e) = self.optimizer_config().validate() {
            problems.push(e.to_string());
        }
        if let Err(e) = self.scheduler_config().validate() {
            problems.push(e.to_string());
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(TrainError::Config(problems.join("; ")))
        }
    }

    /// The AdamW optimizer settings (fp32 master weights; loss scaling for fp16).
    pub fn optimizer_config(&self) -> OptimizerConfig {
        OptimizerConfig {
            adam: AdamWConfig {
                beta1: self.adam_beta1,
                beta2: self.adam_beta2,
                eps: self.adam_eps,
                weight_decay: self.weight_decay,
                decay_norm_and_bias: false,
            },
            clip_grad: self.clip_grad,
            loss_scale: self
                .loss_scale
                .filter(|_| self.precision == Precision::Fp16),
            dynamic_loss_scale: self.dynamic_loss_scale,
            offload: self.offload.clone(),
            ..OptimizerConfig::new(self.precision)
        }
    }

    /// The LR schedule in iterations (warmup from 0, constant weight decay).
    pub fn scheduler_config(&self) -> SchedulerConfig {
        SchedulerConfig {
            lr: self.lr,
            min_lr: self.min_lr,
            lr_warmup_init: 0.0,
            lr_warmup_steps: self.lr_warmup_iters,
            lr_decay_steps: self.lr_decay_iters.unwrap_or(self.train_iters),
            lr_decay_style: self.lr_decay_style,
            weight_decay: self.weight_decay,
            unit: ScheduleUnit::Iterations,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_sizes_are_checked() {
        let ok = TrainerOptions {
            micro_batch_size: 2,
            global_batch_size: 8,
            ..TrainerOptions::default()
        };
        ok.validate().unwrap();
        assert_eq!(ok.num_microbatches(), 4);
        let bad = TrainerOptions {
            global_batch_size: 7,
            log_interval: 0,
            ..ok
        };
        let msg = bad.validate().unwrap_err().to_string();
        assert!(msg.contains("global_batch_size 7"), "{msg}");
        assert!(msg.contains("log_interval"), "{msg}");
    }
}
