//! Shared by the MoE integration tests (and, for the inputs, the benchmarks): reproducible
//! inputs and a relative comparison.

#![allow(dead_code)] // each test binary uses a different part

use ferrotron_nn::moe::{RouterConfig, ScoreFunction};

/// Mixtral's routing rule: softmax over the top 2 of `num_experts`.
pub fn mixtral_router(num_experts: usize) -> RouterConfig {
    RouterConfig {
        num_experts,
        topk: 2,
        score_function: ScoreFunction::Softmax,
        pre_softmax: false,
        groups: None,
        scaling_factor: None,
    }
}

/// `n` values in `[-scale/2, scale/2)` from an LCG seeded with `seed`.
pub fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
        })
        .collect()
}

/// Asserts every value within `1e-5` relative (absolute below 1) of the reference.
pub fn assert_close(name: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{name}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * w.abs().max(1.0),
            "{name}[{i}]: {g} vs {w}"
        );
    }
}
