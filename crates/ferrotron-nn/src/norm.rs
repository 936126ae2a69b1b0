use ferrotron_tensor::ops::rms_norm;

/// RMSNorm (Zhang & Sennrich 2019) with a learned `[h]` gain over a borrowed f32 weight, HF
/// `LlamaRMSNorm` semantics.
#[derive(Clone, Copy, Debug)]
pub struct RmsNorm<'a> {
    weight: &'a [f32],
    eps: f32,
}

impl<'a> RmsNorm<'a> {
    /// Views the `[h]` gain; `eps` is added to the mean square.
    pub fn new(weight: &'a [f32], eps: f32) -> RmsNorm<'a> {
        RmsNorm { weight, eps }
    }

    /// The `[h]` gain.
    pub fn weight(&self) -> &'a [f32] {
        self.weight
    }

    /// The epsilon added to the mean square.
    pub fn eps(&self) -> f32 {
        self.eps
    }

    /// `out[rows, h] = norm(x[rows, h])`. Backward needs `x` and the per-row `rstd`.
    pub fn forward(&self, x: &[f32], out: &mut [f32]) {
        rms_norm(x, self.weight, self.eps, out, None);
    }
}
