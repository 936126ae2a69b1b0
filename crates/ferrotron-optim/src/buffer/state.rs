//! Checkpoint state of a `ParamAndGradBuffer`: its layout plus the parameter values.

use serde::{Deserialize, Serialize};

use super::{BufferConfig, ParamAndGradBuffer, ParamInfo};
use crate::error::{OptimError, Result};
use crate::state::{StateArray, StateDict, Stateful};

/// Layout fingerprint of a buffer: configuration and every parameter's placement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BufferMeta {
    /// The layout configuration.
    pub config: BufferConfig,
    /// Every parameter in registration order (name, shape, offset, bucket, flags).
    pub params: Vec<ParamInfo>,
    /// Total buffer elements, padding included.
    pub numel: usize,
}

/// Name of the array holding the whole param buffer as f32 (`numel` elements).
pub const PARAMS_ARRAY: &str = "params";

impl ParamAndGradBuffer {
    /// The layout fingerprint [`Stateful::export_state`] stores (no values: usable while the
    /// param storage is lent out).
    pub fn meta(&self) -> BufferMeta {
        BufferMeta {
            config: self.config.clone(),
            params: self.params.clone(),
            numel: self.numel(),
        }
    }
}

impl Stateful for ParamAndGradBuffer {
    type Meta = BufferMeta;

    /// Exports the layout and the whole param buffer as f32 (exact for bf16/f16). Gradients
    /// are transient (zeroed every iteration) and are not exported.
    fn export_state(&self) -> Result<StateDict<BufferMeta>> {
        let mut state = StateDict::meta_only(self.meta());
        state.arrays.insert(
            PARAMS_ARRAY.to_string(),
            StateArray::F32(self.storage().to_f32_range(0..self.numel())),
        );
        Ok(state)
    }

    /// Restores the parameters (rounding to the param dtype) and zeroes the gradients.
    ///
    /// # Errors
    /// [`OptimError::State`] when the layout differs (another model, dp size, bucket size,
    /// order or padding) or the array is missing.
    fn import_state(&mut self, mut state: StateDict<BufferMeta>) -> Result<()> {
        let meta = &state.meta;
        if meta.config != self.config {
            return Err(OptimError::State(format!(
                "buffer config differs: checkpoint {:?}, this run {:?}",
                meta.config, self.config
            )));
        }
        if meta.numel != self.numel() || meta.params != self.params {
            let first_diff = meta
                .params
                .iter()
                .zip(&self.params)
                .find(|(a, b)| a != b)
                .map(|(a, b)| format!(" (first difference: `{}` vs `{}`)", a.name, b.name))
                .unwrap_or_default();
            return Err(OptimError::State(format!(
                "buffer layout differs: checkpoint has {} params / {} elements, this run {} / {}{}",
                meta.params.len(),
                meta.numel,
                self.params.len(),
                self.numel(),
                first_diff
            )));
        }
        let values = state.take_f32(PARAMS_ARRAY, self.numel())?;
        let n = self.numel();
        self.storage_mut().set_from_f32(0..n, &values);
        self.zero_grad();
        Ok(())
    }
}
