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
        self.import_meta(&state.meta)?;
        let n = self.owned.local_len();
        for name in state.meta.array_names() {
            let values = state.take_f32(name, n)?;
            self.write_array(name, &values)?;
        }
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
    /// Checks `meta` fits this state (the same owned ranges, master weights exactly when
    /// this run has them) and takes its step count; the arrays follow with
    /// [`AdamW::write_array`] (one at a time: an offloaded state never comes into RAM whole).
    ///
    /// # Errors
    /// [`OptimError::State`] naming what differs.
    pub fn import_meta(&mut self, meta: &AdamWMeta) -> Result<()> {
        if meta.owned != self.owned {
            return Err(OptimError::State(format!(
                "optimizer shard differs: checkpoint owns {:?}, this run {:?}",
                meta.owned.ranges(),
                self.owned.ranges()
            )));
        }
        if meta.has_master != self.has_master {
            let has = |b: bool| if b { "has" } else { "has no" };
            let needs = if self.has_master {
                "needs them"
            } else {
                "does not"
            };
            return Err(OptimError::State(format!(
                "checkpoint {} fp32 master weights, this run {needs} (precision changed?)",
                has(meta.has_master)
            )));
        }
        self.step = meta.step;
        Ok(())
    }

    /// Overwrites the array `name` ([`AdamWMeta::array_names`]) with `values` (local
    /// indexing over the owned ranges).
    ///
    /// # Errors
    /// [`OptimError::State`] for a name this state does not hold, [`OptimError::Length`] for
    /// the wrong length, [`OptimError::Offload`] when writing offloaded chunks fails.
    pub fn write_array(&mut self, name: &str, values: &[f32]) -> Result<()> {
        match name {
            EXP_AVG => self.write_plane(0, values),
            EXP_AVG_SQ => self.write_plane(1, values),
            MASTER if self.has_master => self.write_plane(2, values),
            other => Err(OptimError::State(format!("no optimizer array `{other}`"))),
        }
    }

    /// One array of [`Stateful::export_state`] by its name ([`AdamWMeta::array_names`]),
    /// alone (the others stay where they are).
    ///
    /// # Errors
    /// [`OptimError::State`] for a name this state does not export, [`OptimError::Offload`]
    /// when reading offloaded chunks fails.
    pub fn state_array(&self, name: &str) -> Result<Vec<f32>> {
        match name {
            EXP_AVG => self.exp_avg(),
            EXP_AVG_SQ => self.exp_avg_sq(),
            MASTER => self
                .master_weights()?
                .ok_or_else(|| OptimError::State("no master weights with f32 params".into())),
            other => Err(OptimError::State(format!("no optimizer array `{other}`"))),
        }
    }

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
        let adam = state.meta.adam.clone();
        self.import_meta(state.meta)?;
        self.adam.import_state(StateDict {
            meta: adam,
            arrays: state.arrays,
        })
    }
}

impl Optimizer {
    /// Checks and takes the scalars of a state (precision, loss scaler, skip counter, Adam's
    /// step: [`AdamW::import_meta`]); the arrays follow with [`AdamW::write_array`].
    ///
    /// # Errors
    /// [`OptimError::State`] naming what differs.
    pub fn import_meta(&mut self, meta: OptimizerMeta) -> Result<()> {
        if meta.precision != self.config.precision {
            return Err(OptimError::State(format!(
                "checkpoint precision {:?}, this run {:?}",
                meta.precision, self.config.precision
            )));
        }
        if self.scaler.is_some() != meta.scaler.is_some() {
            return Err(OptimError::State("loss scaler presence differs".into()));
        }
        self.adam.import_meta(&meta.adam)?;
        if let (Some(s), Some(ss)) = (&mut self.scaler, meta.scaler) {
            s.import_state(StateDict::meta_only(ss))?;
        }
        self.skipped_iterations = meta.skipped_iterations;
        Ok(())
    }

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
