use crate::{Result, error::check_shape};
use ferrotron_tensor::{Tensor, ops::rms_norm};

/// RMSNorm (Zhang & Sennrich 2019) with a learned `[h]` gain, HF `LlamaRMSNorm` semantics.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    weight: Vec<f32>,
    eps: f32,
}

impl RmsNorm {
    /// `weight: [h]` (kept in f32 whatever its storage dtype), `eps` added to the mean square.
    pub fn new(name: &str, weight: Tensor, h: usize, eps: f32) -> Result<RmsNorm> {
        check_shape(name, weight.shape(), &[h])?;
        Ok(RmsNorm {
            weight: weight.to_f32_vec(),
            eps,
        })
    }

    /// The `[h]` gain.
    pub fn weight(&self) -> &[f32] {
        &self.weight
    }

    /// The `[h]` gain, mutable (training writes updated values).
    pub fn weight_mut(&mut self) -> &mut [f32] {
        &mut self.weight
    }

    /// The epsilon added to the mean square.
    pub fn eps(&self) -> f32 {
        self.eps
    }

    /// `out[rows, h] = norm(x[rows, h])`. Backward needs `x` and the per-row `rstd`.
    pub fn forward(&self, x: &[f32], out: &mut [f32]) {
        rms_norm(x, &self.weight, self.eps, out, None);
    }
}
