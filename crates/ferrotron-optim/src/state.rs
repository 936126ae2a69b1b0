//! Exportable state for checkpoints: named flat arrays plus a small serde struct per object.
//!
//! Every stateful object of this crate (the [`ParamAndGradBuffer`](crate::ParamAndGradBuffer),
//! [`AdamW`](crate::AdamW), [`Optimizer`](crate::Optimizer), [`GradScaler`](crate::GradScaler),
//! [`OptimizerParamScheduler`](crate::OptimizerParamScheduler)) implements [`Stateful`]: it
//! exports a [`StateDict`] whose `meta` is a serde-serializable struct (scalars, layout
//! fingerprint) and whose `arrays` are named flat `f32` / `u64` vectors (weights, Adam moments).
//! The checkpoint crate decides how to write them (JSON for `meta`, safetensors for `arrays`);
//! this crate does no file I/O.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{OptimError, Result};

/// One named flat array of a [`StateDict`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum StateArray {
    /// 32-bit floats (weights, master weights, Adam moments).
    F32(Vec<f32>),
    /// Unsigned integers (counters, offsets).
    U64(Vec<u64>),
}

impl StateArray {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            StateArray::F32(v) => v.len(),
            StateArray::U64(v) => v.len(),
        }
    }

    /// True when the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The exported state of one object: `meta` (small, serde) and named flat `arrays`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateDict<M> {
    /// Scalars and layout description; serialize with any serde format.
    pub meta: M,
    /// Named flat arrays, sorted by name.
    pub arrays: BTreeMap<String, StateArray>,
}

impl<M> StateDict<M> {
    /// A state dict with no arrays.
    pub fn meta_only(meta: M) -> Self {
        StateDict {
            meta,
            arrays: BTreeMap::new(),
        }
    }

    /// Takes the `f32` array `name` out of the dict, checking its length.
    ///
    /// # Errors
    /// [`OptimError::State`] when the array is missing, is not `f32`, or has another length.
    pub fn take_f32(&mut self, name: &str, expected_len: usize) -> Result<Vec<f32>> {
        match self.arrays.remove(name) {
            Some(StateArray::F32(v)) if v.len() == expected_len => Ok(v),
            Some(StateArray::F32(v)) => Err(OptimError::State(format!(
                "array `{name}` has {} elements, expected {expected_len}",
                v.len()
            ))),
            Some(StateArray::U64(_)) => Err(OptimError::State(format!(
                "array `{name}` is u64, expected f32"
            ))),
            None => Err(OptimError::State(format!("array `{name}` is missing"))),
        }
    }
}

/// An object whose state can be exported for a checkpoint and imported on resume.
pub trait Stateful {
    /// The serde struct holding scalars and the layout fingerprint.
    type Meta: Serialize + for<'de> Deserialize<'de> + Clone;

    /// Exports the full state (copies the arrays).
    ///
    /// # Errors
    /// Reading state kept outside RAM failed ([`OptimError::Offload`]).
    fn export_state(&self) -> Result<StateDict<Self::Meta>>;

    /// Imports state exported by [`Stateful::export_state`] of an identically configured
    /// object.
    ///
    /// # Errors
    /// [`OptimError::State`] when the layout or configuration recorded in `meta` does not
    /// match this object, or an array is missing or has the wrong length.
    fn import_state(&mut self, state: StateDict<Self::Meta>) -> Result<()>;
}
