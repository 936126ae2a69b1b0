//! The mixed-precision optimizer step: unscale + inf check, clip, AdamW, copy to params.
//!
//! Mirrors Megatron-Core's `MixedPrecisionOptimizer.step` / `FP32Optimizer.step`
//! (megatron/core/optimizer/optimizer.py):
//! 1. fp16 only: unscale the f32 main grads by `1/scale`, check for inf/NaN (all-reduced MAX),
//!    update the loss scaler; on inf/NaN skip the step (no AdamW, step count unchanged).
//! 2. Global grad L2 norm (all-reduced SUM of squares) and clipping when `clip_grad > 0`.
//! 3. AdamW over the owned ranges, then master -> params (rounded to bf16/f16).
//!
//! Differences from Megatron, on purpose: the grad norm is computed even when
//! `clip_grad == 0` (for the log line; Megatron reports 0.0), and in bf16/fp32 a non-finite
//! grad norm skips the update (counted) instead of aborting, so the trainer decides. The clip
//! coefficient multiplies the gradients inside AdamW's pass (the same f32 products, the same
//! update) rather than in a pass of its own, so after [`Optimizer::step_with`] the buffer
//! holds the unclipped gradients ([`Optimizer::clip_grad_norm`] scales them in place).
//!
//! Ranks slot in through [`GradStatsReduce`] (the two all-reduces) and
//! [`Optimizer::new_sharded`] (the distributed optimizer's owned shard ranges).

use std::ops::Range;

use ferrotron_tensor::DType;
use serde::{Deserialize, Serialize};

use crate::adamw::{AdamW, AdamWConfig};
use crate::buffer::ParamAndGradBuffer;
use crate::clip;
use crate::error::{OptimError, Result, config_err};
use crate::grad_scaler::{DynamicGradScalerConfig, GradScaler};
use crate::offload::OffloadConfig;

/// Training precision (Megatron `--bf16` / `--fp16` / neither).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Precision {
    /// fp32 params and grads; the params are their own master weights.
    Fp32,
    /// bf16 params (and activations), fp32 grads and fp32 master weights; no loss scaling.
    Bf16,
    /// fp16 params, fp32 grads and master weights, loss scaling (dynamic by default).
    Fp16,
}

impl Precision {
    /// The param buffer dtype this precision needs.
    pub fn param_dtype(self) -> DType {
        match self {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::Fp16 => DType::F16,
        }
    }

    /// Parses `fp32`/`f32`, `bf16`, `fp16`/`f16`.
    pub fn parse(name: &str) -> Option<Self> {
        match DType::parse(name)? {
            DType::F32 => Some(Precision::Fp32),
            DType::BF16 => Some(Precision::Bf16),
            DType::F16 => Some(Precision::Fp16),
        }
    }
}

/// Optimizer settings (Megatron names; Megatron defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerConfig {
    /// Param precision; must match the buffer's `param_dtype`.
    pub precision: Precision,
    /// AdamW hyperparameters.
    pub adam: AdamWConfig,
    /// Max global grad L2 norm (`clip_grad`, default 1.0); 0 disables clipping.
    pub clip_grad: f64,
    /// fp16: a constant loss scale (`loss_scale`); `None` = dynamic scaling.
    pub loss_scale: Option<f32>,
    /// fp16 dynamic loss-scaler settings.
    pub dynamic_loss_scale: DynamicGradScalerConfig,
    /// Where the optimizer state lives (RAM, or chunks offloaded to a directory).
    #[serde(default)]
    pub offload: OffloadConfig,
}

impl OptimizerConfig {
    /// Megatron defaults for `precision`.
    pub fn new(precision: Precision) -> Self {
        OptimizerConfig {
            precision,
            adam: AdamWConfig::default(),
            clip_grad: 1.0,
            loss_scale: None,
            dynamic_loss_scale: DynamicGradScalerConfig::default(),
            offload: OffloadConfig::default(),
        }
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`OptimError::Config`] naming the field.
    pub fn validate(&self) -> Result<()> {
        self.adam.validate()?;
        self.offload.validate()?;
        if !(self.clip_grad >= 0.0) {
            return Err(config_err(format!(
                "clip_grad must be >= 0 (0 disables clipping), got {}",
                self.clip_grad
            )));
        }
        if self.loss_scale.is_some() && self.precision != Precision::Fp16 {
            return Err(config_err(format!(
                "loss_scale is only used with fp16 precision, but precision is {:?}",
                self.precision
            )));
        }
        if self.precision == Precision::Fp16 && self.loss_scale.is_none() {
            self.dynamic_loss_scale.validate()?;
        }
        Ok(())
    }
}

/// The cross-rank reductions of one step. Identity on a single rank ([`NoReduce`]).
///
/// # Errors
/// Both methods fail with [`OptimError::Comm`] when the communication fails.
pub trait GradStatsReduce {
    /// All-reduce SUM of a local partial (sum of squared grads).
    fn all_reduce_sum(&mut self, local: f64) -> Result<f64>;
    /// All-reduce MAX of a local flag/value (found-inf as 0.0 / 1.0).
    fn all_reduce_max(&mut self, local: f64) -> Result<f64>;
}

/// Single-rank reduction: returns the local value.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoReduce;

impl GradStatsReduce for NoReduce {
    fn all_reduce_sum(&mut self, local: f64) -> Result<f64> {
        Ok(local)
    }
    fn all_reduce_max(&mut self, local: f64) -> Result<f64> {
        Ok(local)
    }
}

/// What one call to [`Optimizer::step`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutcome {
    /// False when the step was skipped (inf/NaN grads).
    pub update_successful: bool,
    /// Global grad L2 norm before clipping; `None` when fp16 found inf/NaN.
    pub grad_norm: Option<f64>,
    /// The loss scale the grads of this step were computed with (1 without scaling).
    pub loss_scale: f32,
    /// Inf/NaN found in the grads (fp16 check or non-finite norm).
    pub found_inf: bool,
}

/// AdamW with mixed precision, loss scaling and clipping over one [`ParamAndGradBuffer`].
#[derive(Debug)]
pub struct Optimizer {
    pub(crate) config: OptimizerConfig,
    pub(crate) adam: AdamW,
    pub(crate) scaler: Option<GradScaler>,
    pub(crate) skipped_iterations: u64,
}

impl Optimizer {
    /// An optimizer owning the whole buffer. Master weights are copied from the buffer, so
    /// load the weights first (or call [`reload_model_params`](Self::reload_model_params)).
    ///
    /// # Errors
    /// [`OptimError::Config`] for invalid settings or when the buffer's dtype does not match
    /// `config.precision`.
    #[allow(clippy::single_range_in_vec_init)] // one owned range: the whole buffer
    pub fn new(config: OptimizerConfig, buffer: &ParamAndGradBuffer) -> Result<Self> {
        Self::new_sharded(config, buffer, vec![0..buffer.numel()])
    }

    /// An optimizer owning only `owned` (see [`OwnedRanges`](crate::OwnedRanges)): the
    /// distributed optimizer's shard. Grads outside are neither read nor modified.
    ///
    /// # Errors
    /// As [`new`](Self::new), plus [`OptimError::Range`] for invalid ranges.
    pub fn new_sharded(
        config: OptimizerConfig,
        buffer: &ParamAndGradBuffer,
        owned: Vec<Range<usize>>,
    ) -> Result<Self> {
        config.validate()?;
        if buffer.param_dtype() != config.precision.param_dtype() {
            return Err(config_err(format!(
                "precision {:?} needs {} params, but the ParamAndGradBuffer holds {}",
                config.precision,
                config.precision.param_dtype(),
                buffer.param_dtype()
            )));
        }
        let scaler = match (config.precision, config.loss_scale) {
            (Precision::Fp16, Some(s)) => Some(GradScaler::constant(s)?),
            (Precision::Fp16, None) => Some(GradScaler::dynamic(config.dynamic_loss_scale)?),
            _ => None,
        };
        Ok(Optimizer {
            adam: AdamW::new_offloaded(config.adam, buffer, owned, &config.offload)?,
            config,
            scaler,
            skipped_iterations: 0,
        })
    }

    /// Settings.
    pub fn config(&self) -> &OptimizerConfig {
        &self.config
    }
    /// The AdamW state.
    pub fn adam(&self) -> &AdamW {
        &self.adam
    }
    /// The AdamW state, mutable (per-param multipliers).
    pub fn adam_mut(&mut self) -> &mut AdamW {
        &mut self.adam
    }
    /// The loss scaler (fp16 only).
    pub fn grad_scaler(&self) -> Option<&GradScaler> {
        self.scaler.as_ref()
    }
    /// Scale to multiply the loss by before backward (1 without loss scaling).
    pub fn loss_scale(&self) -> f32 {
        self.scaler.as_ref().map_or(1.0, GradScaler::scale)
    }
    /// Steps skipped so far because of inf/NaN grads.
    pub fn skipped_iterations(&self) -> u64 {
        self.skipped_iterations
    }
    /// Copies the buffer's params into the fp32 master weights (after loading weights).
    ///
    /// # Errors
    /// [`OptimError::Offload`] when writing offloaded state fails.
    pub fn reload_model_params(&mut self, buffer: &ParamAndGradBuffer) -> Result<()> {
        self.adam.reload_model_params(buffer)
    }

    /// Sets the fp32 master weights over this rank's owned ranges from `source(range, out)`
    /// (the f32 values of the buffer's flat `range`), which may hold more precision than the
    /// bf16/f16 params rounded from them: a run that starts from f32 weights (an f32 HF checkpoint, a dequantized GGUF)
    /// keeps them exactly, as PyTorch mixed precision keeps its f32 weights, instead of
    /// starting the masters from the rounded params, whose first updates (smaller than half
    /// a bf16 ulp) would all round back to the same values. No-op for fp32 params.
    ///
    /// # Errors
    /// As [`AdamW::set_master_weights`].
    pub fn set_master_weights(
        &mut self,
        source: impl FnMut(Range<usize>, &mut [f32]),
    ) -> Result<()> {
        self.adam.set_master_weights(source)
    }

    /// Local sum of squared grads over the owned ranges, leaving out params flagged
    /// `exclude_from_grad_norm` (the partial to all-reduce across ranks).
    pub fn local_grad_sq_sum(&self, buffer: &ParamAndGradBuffer) -> f64 {
        let grads = buffer.grads();
        let mut sum = 0.0;
        for range in self.adam.owned().ranges() {
            for &id in buffer.buffer_order() {
                let info = buffer.info(id);
                let (a, b) = (
                    info.offset.max(range.start),
                    (info.offset + info.numel).min(range.end),
                );
                if a < b && !info.flags.exclude_from_grad_norm {
                    sum += clip::grad_sq_sum(&grads[a..b]);
                }
            }
        }
        sum
    }

    /// Unscales the owned grads by `1/scale`, checks them for inf/NaN (reduced MAX across
    /// ranks) and updates the scaler (Megatron `prepare_grads`). Returns `found_inf`; always
    /// false without a scaler.
    ///
    /// # Errors
    /// The reduction failed.
    pub fn prepare_grads(
        &mut self,
        buffer: &mut ParamAndGradBuffer,
        reduce: &mut dyn GradStatsReduce,
    ) -> Result<bool> {
        let Some(scaler) = &mut self.scaler else {
            return Ok(false);
        };
        let inv = scaler.inv_scale();
        let grads = buffer.grads_mut();
        let mut found = false;
        for range in self.adam.owned().ranges() {
            found |= clip::unscale_and_check_finite(&mut grads[range.clone()], inv);
        }
        let found_inf = reduce.all_reduce_max(if found { 1.0 } else { 0.0 })? > 0.0;
        scaler.update(found_inf);
        Ok(found_inf)
    }

    /// The global grad norm (the reduced SUM of squares' root) and the clip coefficient the
    /// owned grads are to be multiplied by: `clip_grad / (norm + 1e-6)` when `clip_grad > 0`
    /// and that is < 1, else 1.
    ///
    /// # Errors
    /// The reduction failed.
    pub fn grad_norm_and_clip_coeff(
        &self,
        buffer: &ParamAndGradBuffer,
        reduce: &mut dyn GradStatsReduce,
    ) -> Result<(f64, f32)> {
        let total_norm = reduce
            .all_reduce_sum(self.local_grad_sq_sum(buffer))?
            .sqrt();
        let coeff = clip::clip_coeff(self.config.clip_grad, total_norm);
        let clipping = self.config.clip_grad > 0.0 && coeff < 1.0;
        Ok((total_norm, if clipping { coeff as f32 } else { 1.0 }))
    }

    /// Computes the global grad norm and, when `clip_grad > 0`, scales the owned grads in
    /// place by `clip_grad / (norm + 1e-6)` if that is < 1 (Megatron's `clip_grad_norm_fp32`;
    /// [`step_with`](Self::step_with) folds the same factor into the update instead). Returns
    /// the norm before clipping.
    ///
    /// # Errors
    /// The reduction failed.
    pub fn clip_grad_norm(
        &mut self,
        buffer: &mut ParamAndGradBuffer,
        reduce: &mut dyn GradStatsReduce,
    ) -> Result<f64> {
        let (total_norm, coeff) = self.grad_norm_and_clip_coeff(buffer, reduce)?;
        if coeff < 1.0 {
            let grads = buffer.grads_mut();
            for range in self.adam.owned().ranges() {
                clip::scale_in_place(&mut grads[range.clone()], coeff);
            }
        }
        Ok(total_norm)
    }

    /// One optimizer step on a single rank: [`step_with`](Self::step_with) and [`NoReduce`].
    ///
    /// # Errors
    /// As [`step_with`](Self::step_with).
    pub fn step(
        &mut self,
        buffer: &mut ParamAndGradBuffer,
        lr: f64,
        weight_decay: f64,
    ) -> Result<StepOutcome> {
        self.step_with(buffer, lr, weight_decay, &mut NoReduce)
    }

    /// One optimizer step with the step's `lr` and `weight_decay` (from the scheduler):
    /// unscale/check (fp16), clip, AdamW over the owned ranges, master -> params. Step the
    /// LR scheduler only when `update_successful` (Megatron does the same).
    ///
    /// # Errors
    /// [`OptimError::Range`] when the buffer is not the one this optimizer was built for;
    /// [`OptimError::Comm`] when a reduction failed.
    pub fn step_with(
        &mut self,
        buffer: &mut ParamAndGradBuffer,
        lr: f64,
        weight_decay: f64,
        reduce: &mut dyn GradStatsReduce,
    ) -> Result<StepOutcome> {
        if let Some(last) = self.adam.owned().ranges().last()
            && last.end > buffer.numel()
        {
            return Err(OptimError::Range {
                start: last.start,
                end: last.end,
                reason: format!("the buffer has only {} elements", buffer.numel()),
            });
        }
        let loss_scale = self.loss_scale();
        let mut outcome = StepOutcome {
            update_successful: false,
            grad_norm: None,
            loss_scale,
            found_inf: false,
        };
        if self.prepare_grads(buffer, reduce)? {
            self.skipped_iterations += 1;
            outcome.found_inf = true;
            return Ok(outcome);
        }
        let (norm, clip_coeff) = self.grad_norm_and_clip_coeff(buffer, reduce)?;
        outcome.grad_norm = Some(norm);
        if !norm.is_finite() {
            self.skipped_iterations += 1;
            outcome.found_inf = true;
            return Ok(outcome);
        }
        self.adam.step(buffer, lr, weight_decay, clip_coeff)?;
        outcome.update_successful = true;
        Ok(outcome)
    }
}
