//! Loss scaling for fp16 training (Megatron-Core megatron/core/optimizer/grad_scaler.py).
//!
//! The trainer multiplies the loss by [`GradScaler::scale`] before backward; the optimizer
//! unscales the f32 main grads by [`GradScaler::inv_scale`], checks them for inf/NaN and calls
//! [`GradScaler::update`]. A step with inf/NaN is skipped.
//!
//! [`DynamicGradScaler`] mirrors Megatron exactly: on inf/NaN the growth tracker resets and the
//! hysteresis tracker drops by one; once it is <= 0 (and on every further inf/NaN until the
//! next growth) the scale is multiplied by `backoff_factor` (floored at `min_scale`). After
//! `growth_interval` consecutive clean steps the scale is multiplied by `growth_factor` and the
//! hysteresis tracker is refilled. A clean step alone does not refill the hysteresis tracker.
//! The scale is an f32 as in Megatron (a CUDA float tensor there).

use serde::{Deserialize, Serialize};

use crate::error::{OptimError, Result, config_err};
use crate::state::{StateDict, Stateful};

/// Dynamic loss-scale settings; the defaults are Megatron's (`--initial-loss-scale 2**32`,
/// `--min-loss-scale 1`, `--loss-scale-window 1000`, `--hysteresis 2`, growth 2, backoff 0.5).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DynamicGradScalerConfig {
    /// Starting scale, > 0.
    pub initial_scale: f32,
    /// Lower bound of the scale, in (0, initial_scale].
    pub min_scale: f32,
    /// Factor applied after `growth_interval` clean steps, > 1.
    pub growth_factor: f32,
    /// Factor applied on inf/NaN once hysteresis is used up, in (0, 1).
    pub backoff_factor: f32,
    /// Clean steps before growing (Megatron `loss_scale_window`), > 0.
    pub growth_interval: u32,
    /// Consecutive inf/NaN steps tolerated before backing off, > 0.
    pub hysteresis: u32,
}

impl Default for DynamicGradScalerConfig {
    fn default() -> Self {
        DynamicGradScalerConfig {
            initial_scale: 2f32.powi(32),
            min_scale: 1.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 1000,
            hysteresis: 2,
        }
    }
}

impl DynamicGradScalerConfig {
    /// Megatron's asserts, as errors naming the fields.
    ///
    /// # Errors
    /// [`OptimError::Config`].
    pub fn validate(&self) -> Result<()> {
        let c = self;
        if !(c.initial_scale > 0.0) {
            return Err(config_err(format!(
                "initial_loss_scale must be > 0, got {}",
                c.initial_scale
            )));
        }
        if !(c.min_scale > 0.0 && c.min_scale <= c.initial_scale) {
            return Err(config_err(format!(
                "min_loss_scale ({}) must be > 0 and <= initial_loss_scale ({})",
                c.min_scale, c.initial_scale
            )));
        }
        if !(c.growth_factor > 1.0) {
            return Err(config_err(format!(
                "loss scale growth_factor must be > 1, got {}",
                c.growth_factor
            )));
        }
        if !(c.backoff_factor > 0.0 && c.backoff_factor < 1.0) {
            return Err(config_err(format!(
                "loss scale backoff_factor must be in (0, 1), got {}",
                c.backoff_factor
            )));
        }
        if c.growth_interval == 0 {
            return Err(config_err(
                "loss_scale_window (growth_interval) must be > 0",
            ));
        }
        if c.hysteresis == 0 {
            return Err(config_err("hysteresis must be > 0"));
        }
        Ok(())
    }
}

/// Megatron's `DynamicGradScaler`.
#[derive(Debug, Clone, PartialEq)]
pub struct DynamicGradScaler {
    config: DynamicGradScalerConfig,
    scale: f32,
    growth_tracker: u32,
    hysteresis_tracker: i64,
}

impl DynamicGradScaler {
    /// A scaler at `config.initial_scale` with full hysteresis.
    ///
    /// # Errors
    /// [`OptimError::Config`] for invalid settings.
    pub fn new(config: DynamicGradScalerConfig) -> Result<Self> {
        config.validate()?;
        Ok(DynamicGradScaler {
            config,
            scale: config.initial_scale,
            growth_tracker: 0,
            hysteresis_tracker: i64::from(config.hysteresis),
        })
    }

    /// Settings.
    pub fn config(&self) -> &DynamicGradScalerConfig {
        &self.config
    }
    /// The current loss scale.
    pub fn scale(&self) -> f32 {
        self.scale
    }
    /// Clean steps since the last inf/NaN or growth.
    pub fn growth_tracker(&self) -> u32 {
        self.growth_tracker
    }
    /// Remaining inf/NaN steps before a backoff (<= 0: every inf/NaN backs off).
    pub fn hysteresis_tracker(&self) -> i64 {
        self.hysteresis_tracker
    }

    /// Advances the state machine after a step's inf/NaN check.
    pub fn update(&mut self, found_inf: bool) {
        let c = &self.config;
        if found_inf {
            self.growth_tracker = 0;
            self.hysteresis_tracker -= 1;
            if self.hysteresis_tracker <= 0 {
                self.scale = (self.scale * c.backoff_factor).max(c.min_scale);
            }
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker == c.growth_interval {
                self.growth_tracker = 0;
                self.hysteresis_tracker = i64::from(c.hysteresis);
                self.scale *= c.growth_factor;
            }
        }
    }
}

/// A loss scaler: constant (Megatron `--loss-scale`) or dynamic.
#[derive(Debug, Clone, PartialEq)]
pub enum GradScaler {
    /// Fixed scale; `update` does nothing, inf/NaN steps are still skipped.
    Constant(f32),
    /// Megatron's dynamic scaler.
    Dynamic(DynamicGradScaler),
}

impl GradScaler {
    /// A constant scaler.
    ///
    /// # Errors
    /// [`OptimError::Config`] when `scale <= 0`.
    pub fn constant(scale: f32) -> Result<Self> {
        if !(scale > 0.0) {
            return Err(config_err(format!("loss_scale must be > 0, got {scale}")));
        }
        Ok(GradScaler::Constant(scale))
    }

    /// A dynamic scaler.
    ///
    /// # Errors
    /// [`OptimError::Config`] for invalid settings.
    pub fn dynamic(config: DynamicGradScalerConfig) -> Result<Self> {
        Ok(GradScaler::Dynamic(DynamicGradScaler::new(config)?))
    }

    /// The current loss scale (multiply the loss by it before backward).
    pub fn scale(&self) -> f32 {
        match self {
            GradScaler::Constant(s) => *s,
            GradScaler::Dynamic(d) => d.scale,
        }
    }

    /// `1 / scale` computed in f64 and rounded to f32 (Megatron `inv_scale`).
    pub fn inv_scale(&self) -> f32 {
        (1.0 / f64::from(self.scale())) as f32
    }

    /// Advances the dynamic state machine; no-op for a constant scaler.
    pub fn update(&mut self, found_inf: bool) {
        if let GradScaler::Dynamic(d) = self {
            d.update(found_inf);
        }
    }
}

/// Exported scaler state (Megatron's `state_dict` keys; trackers are 0 for a constant one).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GradScalerState {
    /// `"constant"` or `"dynamic"`.
    pub kind: String,
    /// Current scale.
    pub scale: f32,
    /// Clean steps since the last inf/NaN or growth.
    pub growth_tracker: u32,
    /// Remaining inf/NaN steps before a backoff.
    pub hysteresis_tracker: i64,
}

impl Stateful for GradScaler {
    type Meta = GradScalerState;

    fn export_state(&self) -> Result<StateDict<GradScalerState>> {
        Ok(StateDict::meta_only(self.state()))
    }

    /// Loads scale and trackers (Megatron `load_state_dict`); the settings stay this run's.
    fn import_state(&mut self, state: StateDict<GradScalerState>) -> Result<()> {
        let s = state.meta;
        match self {
            GradScaler::Constant(_) if s.kind == "constant" => Ok(()),
            GradScaler::Dynamic(d) if s.kind == "dynamic" => {
                if !(s.scale > 0.0) {
                    return Err(OptimError::State(format!("loss scale {} <= 0", s.scale)));
                }
                d.scale = s.scale;
                d.growth_tracker = s.growth_tracker;
                d.hysteresis_tracker = s.hysteresis_tracker;
                Ok(())
            }
            _ => Err(OptimError::State(format!(
                "checkpoint has a {} loss scaler, this run uses another kind",
                s.kind
            ))),
        }
    }
}

impl GradScaler {
    /// The scaler's scalars (its whole checkpoint state).
    pub fn state(&self) -> GradScalerState {
        match self {
            GradScaler::Constant(s) => GradScalerState {
                kind: "constant".into(),
                scale: *s,
                growth_tracker: 0,
                hysteresis_tracker: 0,
            },
            GradScaler::Dynamic(d) => GradScalerState {
                kind: "dynamic".into(),
                scale: d.scale,
                growth_tracker: d.growth_tracker,
                hysteresis_tracker: d.hysteresis_tracker,
            },
        }
    }
}
