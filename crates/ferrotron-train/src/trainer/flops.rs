//! Megatron's model FLOPs count per training iteration (`num_floating_point_operations` in
//! `megatron/training/training.py`, dense transformer, no MoE / MLA / MTP), used for the
//! `throughput per GPU (TFLOP/s/GPU)` of the log line.

use ferrotron_model::TransformerConfig;

/// The sizes the FLOPs formula looks at (Megatron argument names).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlopsModel {
    /// `num_layers`.
    pub num_layers: u64,
    /// `hidden_size` `h`.
    pub hidden_size: u64,
    /// `ffn_hidden_size`.
    pub ffn_hidden_size: u64,
    /// `num_attention_heads`.
    pub num_attention_heads: u64,
    /// `num_query_groups` (= heads without GQA).
    pub num_query_groups: u64,
    /// `kv_channels` (head dim).
    pub kv_channels: u64,
    /// `padded_vocab_size`.
    pub vocab_size: u64,
    /// Gated MLP (SwiGLU: three `h x ffn` GEMMs instead of two).
    pub swiglu: bool,
}

impl From<&TransformerConfig> for FlopsModel {
    /// Every family Ferrotron builds (LLaMA, Mistral, Qwen2) uses SwiGLU.
    fn from(c: &TransformerConfig) -> Self {
        FlopsModel {
            num_layers: c.num_layers as u64,
            hidden_size: c.hidden_size as u64,
            ffn_hidden_size: c.ffn_hidden_size as u64,
            num_attention_heads: c.num_attention_heads as u64,
            num_query_groups: c.num_query_groups as u64,
            kv_channels: c.kv_channels as u64,
            vocab_size: c.vocab_size as u64,
            swiglu: true,
        }
    }
}

/// FLOPs of one training iteration (forward + backward) over `batch_size` sequences of
/// `seq_length` tokens, Megatron's formula:
///
/// `12·b·s·L·h² · ( (1 + g/n + s/h)·(d·n/h) + (ffn/h)·(3/2 if swiglu) + V/(2·L·h) )`
///
/// with `g` query groups, `n` heads, `d` kv channels, `V` vocabulary. The 12 is 3 (forward,
/// weight-gradient and data-gradient GEMMs) x 2 (GEMMs come in pairs, e.g. `h->ffn`,
/// `ffn->h`) x 2 (a multiply-add is two FLOPs). Attention counts the full `s x s` score
/// matrix (no causal halving), as Megatron does; norms, softmax and element-wise ops are
/// not counted. Returns f64 (the count exceeds u64 range only for absurd sizes, but f64
/// keeps the fractional terms exact enough).
pub fn num_floating_point_operations(m: &FlopsModel, batch_size: u64, seq_length: u64) -> f64 {
    let h = m.hidden_size as f64;
    let s = seq_length as f64;
    let n = m.num_attention_heads as f64;
    let query_projection_to_hidden_size_ratio = (m.kv_channels as f64 * n) / h;
    let gated_linear_multiplier = if m.swiglu { 1.5 } else { 1.0 };
    let attention =
        (1.0 + m.num_query_groups as f64 / n + s / h) * query_projection_to_hidden_size_ratio;
    let mlp = (m.ffn_hidden_size as f64 / h) * gated_linear_multiplier;
    let logit = m.vocab_size as f64 / (2.0 * m.num_layers as f64 * h);
    let expansion_factor = 3.0 * 2.0 * 2.0;
    expansion_factor
        * batch_size as f64
        * s
        * m.num_layers as f64
        * h
        * h
        * (attention + mlp + logit)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// L=2, h=64, n=4 heads of d=16, g=2 groups, ffn=128, V=256, SwiGLU, b=2, s=32, counted
    /// GEMM by GEMM: per token and layer QKV `2·64·(64+2·32)` = 16384, output projection
    /// `2·64·64` = 8192, scores + context `2·2·32·64` = 8192, MLP `3·2·64·128` = 49152;
    /// two layers 163840, plus logits `2·64·256` = 32768: 196608 forward FLOPs per token,
    /// x3 for the backward, x64 tokens = 37,748,736.
    #[test]
    fn matches_a_hand_count() {
        let m = FlopsModel {
            num_layers: 2,
            hidden_size: 64,
            ffn_hidden_size: 128,
            num_attention_heads: 4,
            num_query_groups: 2,
            kv_channels: 16,
            vocab_size: 256,
            swiglu: true,
        };
        assert_eq!(num_floating_point_operations(&m, 2, 32), 37_748_736.0);
        // Without gating the MLP has two GEMMs: 2·2·64·128 = 32768 instead of 49152 per layer.
        let plain = FlopsModel { swiglu: false, ..m };
        let expect = 37_748_736.0 - 3.0 * 64.0 * 2.0 * (49152.0 - 32768.0);
        assert_eq!(num_floating_point_operations(&plain, 2, 32), expect);
    }
}
