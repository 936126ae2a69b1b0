use crate::Linear;
use ferrotron_tensor::ops::swiglu_packed;

/// The gated MLP of LLaMA-family models: `fc2(silu(x·Wgᵀ) ⊙ (x·Wuᵀ))`.
///
/// `linear_fc1: [2f, h]` packs gate rows then up rows (Megatron's `linear_fc1` with
/// `gated_linear_unit`); `linear_fc2: [h, f]`.
#[derive(Clone, Debug)]
pub struct SwiGluMlp {
    pub linear_fc1: Linear,
    pub linear_fc2: Linear,
}

impl SwiGluMlp {
    /// FFN hidden size `f`.
    pub fn ffn_hidden_size(&self) -> usize {
        self.linear_fc2.in_features()
    }

    /// `out[rows, h] = mlp(x[rows, h])`, using `fc1_out: [rows, 2f]` and `act: [rows, f]` as
    /// scratch (both are what backward saves).
    pub fn forward(&self, x: &[f32], fc1_out: &mut [f32], act: &mut [f32], out: &mut [f32]) {
        self.linear_fc1.forward(x, fc1_out);
        swiglu_packed(fc1_out, act, self.ffn_hidden_size());
        self.linear_fc2.forward(act, out);
    }
}
