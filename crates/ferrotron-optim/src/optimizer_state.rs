//! Checkpoint state of [`AdamW`] and [`Optimizer`].
//!
//! Arrays (local indexing over the owned ranges, see [`OwnedRanges`]): `exp_avg`,
//! `exp_avg_sq` and, for bf16/f16 params, `master` (fp32 master weights). For fp32 params the
//! weights live in the [`ParamAndGradBuffer`](crate::ParamAndGradBuffer) state instead.
//! Hyperparameters (betas, eps, multipliers) stay this run's on import; the owned ranges and
//! the presence of master weights must match.

use serde::{Deserialize, Serialize};

use crate::adamw::{AdamW, AdamWConfig, ParamHyper};
use crate::error::{OptimError, Result};
use crate::grad_scaler::{GradScaler, GradScalerState};
use crate::optimizer::{Optimizer, Precision};
use crate::shard::OwnedRanges;
use crate::state::{StateArray, StateDict, Stateful};

/// Array names.
pub const EXP_AVG: &str = "exp_avg";
/// Array names.
pub const EXP_AVG_SQ: &str = "exp_avg_sq";
/// Array names.
pub const MASTER: &str = "master";

/// Scalars and layout of an [`AdamW`] state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdamWMeta {
    /// Hyperparameters at export (informational).
    pub config: AdamWConfig,
    /// Completed steps (bias correction).
    pub step: u64,
    /// Owned flat ranges.
    pub owned: OwnedRanges,
    /// Whether `master` is present.
    pub has_master: bool,
    /// Per-parameter multipliers at export (informational).
    pub hyper: Vec<ParamHyper>,
}

impl Stateful for AdamW {
    type Meta = AdamWMeta;

    fn export_state(&self) -> Result<StateDict<AdamWMeta>> {
        let mut state = StateDict::meta_only(self.meta());
        let a = &mut state.arrays;
        a.insert(EXP_AVG.into(), StateArray::F32(self.exp_avg()?));
        a.insert(EXP_AVG_SQ.into(), StateArray::F32(self.exp_avg_sq()?));
        if let Some(m) = self.master_weights()? {
            a.insert(MASTER.into(), StateArray::F32(m));
        }
        Ok(state)
    }

    fn import_state(&mut self, mut state: StateDict<AdamWMeta>) -> Result<()> {
        if state.meta.owned != self.owned {
            return Err(OptimError::State(format!(
                "optimizer shard differs: checkpoint owns {:?}, this run {:?}",
                state.meta.owned.ranges(),
                self.owned.ranges()
            )));
        }
        if state.meta.has_master != self.has_master {
            return Err(OptimError::State(format!(
                "checkpoint {} fp32 master weights, this run {} (precision changed?)",
                if state.meta.has_master {
                    "has"
                } else {
                    "has no"
                },
                if self.has_master {
                    "needs them"
                } else {
                    "does not"
                }
            )));
        }
        let n = self.owned.local_len();
        let m = state.take_f32(EXP_AVG, n)?;
        let v = state.take_f32(EXP_AVG_SQ, n)?;
        let master = if self.has_master {
            Some(state.take_f32(MASTER, n)?)
        } else {
            None
        };
        self.write_state(&m, &v, master.as_deref())?;
        self.step = state.meta.step;
        Ok(())
    }
}

impl AdamWMeta {
    /// The arrays [`Stateful::export_state`] exports for this state: `exp_avg`,
    /// `exp_avg_sq` and, with master weights, `master`.
    pub fn array_names(&self) -> Vec<&'static str> {
        let mut names = vec![EXP_AVG, EXP_AVG_SQ];
        if self.has_master {
            names.push(MASTER);
        }
        names
    }
}

impl AdamW {
    /// The scalars and layout of [`Stateful::export_state`] without the arrays.
    pub fn meta(&self) -> AdamWMeta {
        AdamWMeta {
            config: self.config,
            step: self.step,
            owned: self.owned.clone(),
            has_master: self.has_master,
            hyper: self.hyper.clone(),
        }
    }
}

/// Scalars of an [`Optimizer`] state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerMeta {
    /// Precision at export; must match on import.
    pub precision: Precision,
    /// AdamW scalars and layout.
    pub adam: AdamWMeta,
    /// Loss scaler (fp16).
    pub scaler: Option<GradScalerState>,
    /// Steps skipped for inf/NaN.
    pub skipped_iterations: u64,
}

impl Stateful for Optimizer {
    type Meta = OptimizerMeta;

    fn export_state(&self) -> Result<StateDict<OptimizerMeta>> {
        let adam = self.adam.export_state()?;
        Ok(StateDict {
            meta: self.meta_with(adam.meta),
            arrays: adam.arrays,
        })
    }

    fn import_state(&mut self, state: StateDict<OptimizerMeta>) -> Result<()> {
        let meta = state.meta;
        if meta.precision != self.config.precision {
            return Err(OptimError::State(format!(
                "checkpoint precision {:?}, this run {:?}",
                meta.precision, self.config.precision
            )));
        }
        if self.scaler.is_some() != meta.scaler.is_some() {
            return Err(OptimError::State("loss scaler presence differs".into()));
        }
        self.adam.import_state(StateDict {
            meta: meta.adam,
            arrays: state.arrays,
        })?;
        if let (Some(s), Some(ss)) = (&mut self.scaler, meta.scaler) {
            s.import_state(StateDict::meta_only(ss))?;
        }
        self.skipped_iterations = meta.skipped_iterations;
        Ok(())
    }
}

impl Optimizer {
    /// The scalars of [`Stateful::export_state`] without the arrays (no offloaded chunk is
    /// read).
    pub fn meta(&self) -> OptimizerMeta {
        self.meta_with(self.adam.meta())
    }

    fn meta_with(&self, adam: AdamWMeta) -> OptimizerMeta {
        OptimizerMeta {
            precision: self.config.precision,
            adam,
            scaler: self.scaler.as_ref().map(GradScaler::state),
            skipped_iterations: self.skipped_iterations,
        }
    }
}
