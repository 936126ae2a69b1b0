//! Learning-rate schedule: linear warmup, then cosine / linear / constant /
//! inverse-square-root decay from `lr` to `min_lr` (Megatron-Core
//! megatron/core/optimizer_param_scheduler.py, `get_lr`, formula for formula).
//!
//! The scheduler counts generic *step units*: the caller says what one optimizer step adds
//! ([`ScheduleUnit::increment`]): 1 (iterations), `global_batch_size` (samples; what
//! Megatron's training loop does, converting `lr_warmup_iters` / `lr_decay_iters` to samples)
//! or `global_batch_size * seq_length` (tokens, Pai-Megatron-Patch's `*_TOKENS_OR_ITERS`).
//! Pai's shell scripts themselves turn token budgets into iteration counts by integer division
//! ([`pai_tokens_to_iters`]); both ways are supported.
//!
//! With `num_steps` the units consumed so far (`W` warmup, `D` decay steps):
//! ```text
//! W > 0 and num_steps <= W : init_lr + (lr - init_lr) * num_steps / W
//! constant                 : lr
//! num_steps > D            : min_lr
//! inverse-square-root      : max(min_lr, lr * sqrt(max(W,1)) / sqrt(max(num_steps,1)))
//! otherwise, r = (num_steps - W) / (D - W):
//!   linear                 : min_lr + (lr - min_lr) * (1 - r)
//!   cosine                 : min_lr + (lr - min_lr) * 0.5 * (cos(pi * r) + 1)
//! ```
//! As in Megatron, step the scheduler only after a successful optimizer step; the lr used by
//! iteration `i` (1-based) is the lr at `(i - 1)` steps, so with warmup the first iteration
//! runs at `init_lr` (0 by default). Weight decay: constant only (Megatron's `wd_incr_style
//! = constant`, `start_wd == end_wd`); linear/cosine wd increments are not implemented.

use std::f64::consts::PI;

use serde::{Deserialize, Serialize};

use crate::error::{OptimError, Result, config_err};
use crate::state::{StateDict, Stateful};

/// Decay style after warmup (Megatron `lr_decay_style`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LrDecayStyle {
    /// `lr` forever after warmup.
    Constant,
    /// Linear from `lr` to `min_lr`.
    Linear,
    /// Half cosine from `lr` to `min_lr`.
    Cosine,
    /// `lr * sqrt(warmup) / sqrt(step)`, floored at `min_lr`.
    InverseSquareRoot,
}

impl LrDecayStyle {
    /// Parses Megatron's names: `constant`, `linear`, `cosine`, `inverse-square-root`.
    ///
    /// # Errors
    /// [`OptimError::Config`] naming `lr_decay_style` and the accepted values.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "constant" => Ok(LrDecayStyle::Constant),
            "linear" => Ok(LrDecayStyle::Linear),
            "cosine" => Ok(LrDecayStyle::Cosine),
            "inverse-square-root" => Ok(LrDecayStyle::InverseSquareRoot),
            other => Err(config_err(format!(
                "lr_decay_style `{other}` is not supported (constant, linear, cosine, \
                 inverse-square-root)"
            ))),
        }
    }
}

/// What one schedule step unit is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScheduleUnit {
    /// One optimizer step = 1 unit.
    Iterations,
    /// One optimizer step = `global_batch_size` units.
    Samples,
    /// One optimizer step = `global_batch_size * seq_length` units.
    Tokens,
}

impl ScheduleUnit {
    /// Units one optimizer step adds.
    pub fn increment(self, global_batch_size: u64, seq_length: u64) -> u64 {
        match self {
            ScheduleUnit::Iterations => 1,
            ScheduleUnit::Samples => global_batch_size,
            ScheduleUnit::Tokens => global_batch_size * seq_length,
        }
    }
}

/// Pai-Megatron-Patch's conversion of a token budget into iterations:
/// `tokens / global_batch_size / seq_length` (shell integer division).
pub fn pai_tokens_to_iters(tokens: u64, global_batch_size: u64, seq_length: u64) -> u64 {
    tokens / global_batch_size / seq_length
}

/// Schedule settings. Step counts are in the chosen [`ScheduleUnit`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SchedulerConfig {
    /// Peak learning rate (Megatron `lr` / `max_lr`).
    pub lr: f64,
    /// Final learning rate after decay (`min_lr`), 0 <= min_lr <= lr.
    pub min_lr: f64,
    /// Learning rate at step 0 of warmup (`lr_warmup_init`, default 0).
    pub lr_warmup_init: f64,
    /// Warmup length in units (`lr_warmup_iters` / samples / tokens), < `lr_decay_steps`.
    pub lr_warmup_steps: u64,
    /// End of decay in units (`lr_decay_iters`, usually `train_iters`), > 0.
    pub lr_decay_steps: u64,
    /// Decay style after warmup.
    pub lr_decay_style: LrDecayStyle,
    /// Weight decay (constant schedule).
    pub weight_decay: f64,
    /// What a unit is (recorded in checkpoints; the caller supplies increments).
    pub unit: ScheduleUnit,
}

impl SchedulerConfig {
    /// Megatron's asserts, as errors naming the fields.
    ///
    /// # Errors
    /// [`OptimError::Config`], e.g. `min_lr (0.1) must be <= lr (0.01)`.
    pub fn validate(&self) -> Result<()> {
        let c = self;
        if !(c.min_lr >= 0.0) {
            return Err(config_err(format!("min_lr must be >= 0, got {}", c.min_lr)));
        }
        if !(c.lr >= c.min_lr) {
            return Err(config_err(format!(
                "min_lr ({}) must be <= lr ({})",
                c.min_lr, c.lr
            )));
        }
        if !(c.lr_warmup_init >= 0.0 && c.lr_warmup_init <= c.lr) {
            return Err(config_err(format!(
                "lr_warmup_init ({}) must be in [0, lr ({})]",
                c.lr_warmup_init, c.lr
            )));
        }
        if c.lr_decay_steps == 0 {
            return Err(config_err("lr_decay_iters (lr_decay_steps) must be > 0"));
        }
        if c.lr_warmup_steps >= c.lr_decay_steps {
            return Err(config_err(format!(
                "lr_warmup_iters ({}) must be < lr_decay_iters ({}) (in {:?})",
                c.lr_warmup_steps, c.lr_decay_steps, c.unit
            )));
        }
        if !(c.weight_decay >= 0.0) {
            return Err(config_err(format!(
                "weight_decay must be >= 0, got {}",
                c.weight_decay
            )));
        }
        Ok(())
    }
}

/// Megatron's `OptimizerParamScheduler` (learning rate + constant weight decay).
#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerParamScheduler {
    config: SchedulerConfig,
    num_steps: u64,
}

impl OptimizerParamScheduler {
    /// A schedule at step 0.
    ///
    /// # Errors
    /// [`OptimError::Config`] for invalid settings.
    pub fn new(config: SchedulerConfig) -> Result<Self> {
        config.validate()?;
        Ok(OptimizerParamScheduler {
            config,
            num_steps: 0,
        })
    }

    /// Settings.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }
    /// Units consumed so far.
    pub fn num_steps(&self) -> u64 {
        self.num_steps
    }
    /// Advances by `increment` units (after a successful optimizer step).
    pub fn step(&mut self, increment: u64) {
        self.num_steps += increment;
    }

    /// The learning rate at the current step (Megatron `get_lr`).
    pub fn lr(&self) -> f64 {
        lr_at(&self.config, self.num_steps)
    }

    /// The weight decay at the current step (constant).
    pub fn weight_decay(&self) -> f64 {
        self.config.weight_decay
    }
}

/// Megatron's `get_lr` at `num_steps` units (see the module docs).
pub fn lr_at(c: &SchedulerConfig, num_steps: u64) -> f64 {
    let (max_lr, min_lr) = (c.lr, c.min_lr);
    let (warmup, decay) = (c.lr_warmup_steps, c.lr_decay_steps);
    if warmup > 0 && num_steps <= warmup {
        return c.lr_warmup_init + (max_lr - c.lr_warmup_init) * num_steps as f64 / warmup as f64;
    }
    if c.lr_decay_style == LrDecayStyle::Constant {
        return max_lr;
    }
    if num_steps > decay {
        return min_lr;
    }
    if c.lr_decay_style == LrDecayStyle::InverseSquareRoot {
        let w = warmup.max(1) as f64;
        let n = num_steps.max(1) as f64;
        return min_lr.max(max_lr * w.sqrt() / n.sqrt());
    }
    let decay_ratio = (num_steps - warmup) as f64 / (decay - warmup) as f64;
    let coeff = match c.lr_decay_style {
        LrDecayStyle::Linear => 1.0 - decay_ratio,
        _ => 0.5 * ((PI * decay_ratio).cos() + 1.0),
    };
    min_lr + coeff * (max_lr - min_lr)
}

/// Exported scheduler state (Megatron's `state_dict` keys plus the unit and init lr).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SchedulerState {
    /// Peak lr.
    pub max_lr: f64,
    /// Final lr.
    pub min_lr: f64,
    /// Warmup start lr.
    pub lr_warmup_init: f64,
    /// Warmup units.
    pub lr_warmup_steps: u64,
    /// Decay end in units.
    pub lr_decay_steps: u64,
    /// Decay style.
    pub lr_decay_style: LrDecayStyle,
    /// Units consumed.
    pub num_steps: u64,
    /// Weight decay at the start of the schedule (== `end_wd`: constant).
    pub start_wd: f64,
    /// Weight decay at the end.
    pub end_wd: f64,
    /// Always `"constant"`.
    pub wd_incr_style: String,
    /// Unit of the step counts.
    pub unit: ScheduleUnit,
}

/// How [`OptimizerParamScheduler::import_with`] treats settings that differ from the
/// checkpoint (Megatron `--override-opt_param-scheduler` /
/// `--use-checkpoint-opt_param-scheduler`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SchedulerLoadPolicy {
    /// Any difference is an error (Megatron's default: neither flag set).
    #[default]
    RequireMatch,
    /// Take the checkpoint's settings.
    UseCheckpoint,
    /// Keep this run's settings, take only the step count.
    Override,
}

impl OptimizerParamScheduler {
    /// Imports `state` under `policy`.
    ///
    /// # Errors
    /// [`OptimError::State`] naming every differing field under `RequireMatch`, or for a
    /// checkpointed schedule that does not validate under `UseCheckpoint`.
    pub fn import_with(
        &mut self,
        state: SchedulerState,
        policy: SchedulerLoadPolicy,
    ) -> Result<()> {
        let ckpt = SchedulerConfig {
            lr: state.max_lr,
            min_lr: state.min_lr,
            lr_warmup_init: state.lr_warmup_init,
            lr_warmup_steps: state.lr_warmup_steps,
            lr_decay_steps: state.lr_decay_steps,
            lr_decay_style: state.lr_decay_style,
            weight_decay: state.end_wd,
            unit: state.unit,
        };
        match policy {
            SchedulerLoadPolicy::Override => {}
            SchedulerLoadPolicy::UseCheckpoint => {
                ckpt.validate()
                    .map_err(|e| OptimError::State(format!("checkpointed schedule: {e}")))?;
                self.config = ckpt;
            }
            SchedulerLoadPolicy::RequireMatch => {
                let diffs = config_diffs(&self.config, &ckpt);
                if !diffs.is_empty() {
                    return Err(OptimError::State(format!(
                        "LR schedule differs from the checkpoint ({}); pass the same values, or \
                         choose override / use-checkpoint",
                        diffs.join(", ")
                    )));
                }
            }
        }
        self.num_steps = state.num_steps;
        Ok(())
    }
}

fn config_diffs(run: &SchedulerConfig, ckpt: &SchedulerConfig) -> Vec<String> {
    let mut d = Vec::new();
    let mut cmp = |name: &str, a: String, b: String| {
        if a != b {
            d.push(format!("{name}: run {a}, checkpoint {b}"));
        }
    };
    cmp("lr", run.lr.to_string(), ckpt.lr.to_string());
    cmp("min_lr", run.min_lr.to_string(), ckpt.min_lr.to_string());
    cmp(
        "lr_warmup_init",
        run.lr_warmup_init.to_string(),
        ckpt.lr_warmup_init.to_string(),
    );
    cmp(
        "lr_warmup_steps",
        run.lr_warmup_steps.to_string(),
        ckpt.lr_warmup_steps.to_string(),
    );
    cmp(
        "lr_decay_steps",
        run.lr_decay_steps.to_string(),
        ckpt.lr_decay_steps.to_string(),
    );
    cmp(
        "lr_decay_style",
        format!("{:?}", run.lr_decay_style),
        format!("{:?}", ckpt.lr_decay_style),
    );
    cmp(
        "weight_decay",
        run.weight_decay.to_string(),
        ckpt.weight_decay.to_string(),
    );
    cmp(
        "unit",
        format!("{:?}", run.unit),
        format!("{:?}", ckpt.unit),
    );
    d
}

impl Stateful for OptimizerParamScheduler {
    type Meta = SchedulerState;

    fn export_state(&self) -> Result<StateDict<SchedulerState>> {
        Ok(StateDict::meta_only(self.state()))
    }

    /// [`import_with`](OptimizerParamScheduler::import_with) and
    /// [`SchedulerLoadPolicy::RequireMatch`].
    fn import_state(&mut self, state: StateDict<SchedulerState>) -> Result<()> {
        self.import_with(state.meta, SchedulerLoadPolicy::RequireMatch)
    }
}

impl OptimizerParamScheduler {
    /// The schedule's scalars (its whole checkpoint state).
    pub fn state(&self) -> SchedulerState {
        let c = &self.config;
        SchedulerState {
            max_lr: c.lr,
            min_lr: c.min_lr,
            lr_warmup_init: c.lr_warmup_init,
            lr_warmup_steps: c.lr_warmup_steps,
            lr_decay_steps: c.lr_decay_steps,
            lr_decay_style: c.lr_decay_style,
            num_steps: self.num_steps,
            start_wd: c.weight_decay,
            end_wd: c.weight_decay,
            wd_incr_style: "constant".into(),
            unit: c.unit,
        }
    }
}
