//! Megatron's model FLOPs count per training iteration (`num_floating_point_operations` in
//! `megatron/training/training.py`), used for the `throughput per GPU (TFLOP/s/GPU)` of the
//! log line. The GEMM sizes come from the model's parameter declarations
//! ([`ferrotron_model::ModelLayout`]), so a new module kind is counted without a new term.

use ferrotron_model::TransformerConfig;
use ferrotron_model::module::{ModelLayout, ModelPart};

/// The sizes the FLOPs count looks at.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlopsModel {
    /// Elements of every decoder-layer matmul weight (`[out, in]`): a token costs 2 FLOPs
    /// per element in the forward.
    pub matmul_weights: u64,
    /// `v·h`, the logits' GEMM (the output layer, or the tied embedding).
    pub logit_weights: u64,
    /// `num_layers · a · d`: the width of core attention's `QKᵀ` and `AV` products, summed
    /// over the layers (each costs `2·s·a·d` FLOPs per token and layer).
    pub attention_width: u64,
}

impl From<&TransformerConfig> for FlopsModel {
    fn from(c: &TransformerConfig) -> Self {
        let layout = ModelLayout::new(c, c.vocab_size, &ModelPart::whole(c.num_layers));
        FlopsModel {
            matmul_weights: layout.matmul_weight_elements() as u64,
            logit_weights: (c.vocab_size * c.hidden_size) as u64,
            attention_width: (c.num_layers * c.num_attention_heads * c.kv_channels) as u64,
        }
    }
}

/// FLOPs of one training iteration (forward + backward) over `batch_size` sequences of
/// `seq_length` tokens: per token `3 · (2·W + 2·v·h + 2·2·s·L·a·d)`, `W` the matmul weight
/// elements. This is Megatron's
/// `12·b·s·L·h² · ((1 + g/n + s/h)·(d·n/h) + (ffn/h)·(3/2 if swiglu) + V/(2·L·h))`
/// written per GEMM: 3 for the forward, weight-gradient and data-gradient GEMMs, 2 FLOPs per
/// multiply-add; attention counts the full `s x s` score matrix (no causal halving), as
/// Megatron does; norms, softmax and element-wise ops are not counted.
pub fn num_floating_point_operations(m: &FlopsModel, batch_size: u64, seq_length: u64) -> f64 {
    let s = seq_length as f64;
    let forward_per_token = 2.0 * m.matmul_weights as f64
        + 2.0 * m.logit_weights as f64
        + 4.0 * s * m.attention_width as f64;
    3.0 * forward_per_token * batch_size as f64 * s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// L=2, h=64, n=4 heads of d=16, g=2 groups, ffn=128, V=256, SwiGLU, b=2, s=32, counted
    /// GEMM by GEMM: per token and layer QKV `2·64·(64+2·32)` = 16384, output projection
    /// `2·64·64` = 8192, scores + context `2·2·32·64` = 8192, MLP `3·2·64·128` = 49152;
    /// two layers 163840, plus logits `2·64·256` = 32768: 196608 forward FLOPs per token,
    /// x3 for the backward, x64 tokens = 37,748,736 — Megatron's formula gives the same.
    #[test]
    fn matches_a_hand_count_and_megatrons_formula() {
        let c = TransformerConfig::llama(2, 64, 128, 4, 2, 256, 64).unwrap();
        let m = FlopsModel::from(&c);
        assert_eq!(num_floating_point_operations(&m, 2, 32), 37_748_736.0);
        let (b, s, l, h, n, g, d, ffn, v) = (2.0, 32.0, 2.0, 64.0, 4.0, 2.0, 16.0, 128.0, 256.0);
        let megatron = 12.0
            * b
            * s
            * l
            * h
            * h
            * ((1.0 + g / n + s / h) * (d * n / h) + (ffn / h) * 1.5 + v / (2.0 * l * h));
        assert_eq!(num_floating_point_operations(&m, 2, 32), megatron);
    }
}
