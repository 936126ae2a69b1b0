//! Shared by the `ferrotron-nn` benchmarks: the allocator a training run has, reproducible
//! inputs, and the median timing.

use std::time::Instant;

// The allocator a training run has (mimalloc keeping freed memory: see
// `ferrotron_tensor::allocator`), so the passes' buffers are reused, not faulted in anew.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `n` values in `[-scale/2, scale/2)` from an LCG seeded with `seed`.
pub fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
        })
        .collect()
}

fn median(mut t: Vec<f64>) -> f64 {
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// Times `f` `runs` times after one warmup, milliseconds (the median).
pub fn time(runs: usize, mut f: impl FnMut()) -> f64 {
    f();
    median(
        (0..runs)
            .map(|_| {
                let start = Instant::now();
                f();
                start.elapsed().as_secs_f64() * 1e3
            })
            .collect(),
    )
}
