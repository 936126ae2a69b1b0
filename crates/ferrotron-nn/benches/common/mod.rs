//! Shared by the `ferrotron-nn` benchmarks: the allocator a training run has, the integration
//! tests' reproducible inputs, and the median timing.

use std::time::Instant;

// The allocator a training run has (mimalloc keeping freed memory: see
// `ferrotron_tensor::allocator`), so the passes' buffers are reused, not faulted in anew.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

// The integration tests' reproducible inputs.
#[path = "../../tests/common/mod.rs"]
mod inputs;
pub use inputs::values;

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
