//! Benchmark: one `forward_backward` on SmolLM2-135M (b=1, s=512, f32), the model read from
//! `FERROTRON_BENCH_MODEL` (default `.cache/smollm2-hf`, written by scripts/quickstart.sh):
//! `cargo bench -p ferrotron-model --bench train_step`. Prints the median over 4 runs.

use ferrotron_model::TrainBatch;
use ferrotron_model::families::load_hf_model;
use ferrotron_tensor::DType;
use std::path::PathBuf;
use std::time::Instant;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let dir = std::env::var_os("FERROTRON_BENCH_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.cache/smollm2-hf")
        });
    if !dir.exists() {
        eprintln!(
            "{} not found: set FERROTRON_BENCH_MODEL to an HF model directory",
            dir.display()
        );
        std::process::exit(2);
    }
    let (model, _) = load_hf_model(&dir, DType::F32).unwrap();
    let (b, s) = (1, 512);
    let v = model.config().vocab_size as u64;
    let mut x = 12345u64;
    let tokens: Vec<u32> = (0..b * s)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % v) as u32
        })
        .collect();
    let labels: Vec<i64> = (0..b * s)
        .map(|i| {
            if i + 1 < b * s {
                tokens[i + 1] as i64
            } else {
                -100
            }
        })
        .collect();
    let batch = TrainBatch::from_batch_major(&tokens, &labels, None, b, s);
    let mut grads: Vec<Vec<f32>> = model.zero_grads();
    let mut times = Vec::new();
    for _ in 0..4 {
        let mut views: Vec<&mut [f32]> = grads.iter_mut().map(|g| g.as_mut_slice()).collect();
        let t = Instant::now();
        let stats = model.forward_backward(&batch, &mut views, 1.0).unwrap();
        times.push(t.elapsed().as_secs_f64());
        eprintln!("loss {:.4}, {:.3} s", stats.loss, times.last().unwrap());
    }
    times.sort_by(f64::total_cmp);
    eprintln!(
        "SmolLM2-135M b={b} s={s}: median {:.3} s per forward_backward, {:.0} tokens/s",
        times[times.len() / 2],
        (b * s) as f64 / times[times.len() / 2]
    );
}
