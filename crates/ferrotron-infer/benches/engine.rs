//! Batched decode throughput of the serving engine (continuous batching over the paged KV
//! cache) on a real HF model directory: B requests of a 32-token prompt, 64 new tokens each,
//! all admitted at once; aggregate output tokens/s of the decode steps (prefill excluded)
//! for B = 1, 4, 8, 16, 32, f32 and bf16 weights. Not a test: run with
//! `FERROTRON_BENCH_MODEL=/path/to/smollm2 cargo bench -p ferrotron-infer --bench engine`.

use ferrotron_infer::engine::{Engine, EngineConfig, Request, RequestParams, SchedulerConfig};
use ferrotron_model::families::load_hf_model;
use ferrotron_tensor::DType;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const PROMPT: usize = 32;
const NEW: usize = 64;

fn main() {
    let Some(dir) = std::env::var_os("FERROTRON_BENCH_MODEL").map(PathBuf::from) else {
        eprintln!("set FERROTRON_BENCH_MODEL to an HF model directory (e.g. converted SmolLM2)");
        std::process::exit(2);
    };
    let batches: Vec<usize> = std::env::var("FERROTRON_BENCH_BATCHES")
        .ok()
        .map(|v| v.split(',').filter_map(|b| b.parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 4, 8, 16, 32]);
    println!(
        "engine benchmark: {}, prompt {PROMPT}, {NEW} new tokens per request, {} threads",
        dir.display(),
        rayon::current_num_threads()
    );
    ferrotron_tensor::allocator::retain_freed_memory();
    for dtype in [DType::F32, DType::BF16] {
        let model = Arc::new(load_hf_model(&dir, dtype).expect("load model").0);
        let vocab = model.config().vocab_size as u32;
        for &b in &batches {
            let config = EngineConfig {
                block_size: 16,
                num_blocks: EngineConfig::blocks_for_memory(&model, 16, 1 << 30),
                scheduler: SchedulerConfig {
                    max_num_seqs: b,
                    max_num_batched_tokens: b * PROMPT,
                },
                enable_prefix_caching: false,
                speculative: None,
            };
            let mut engine = Engine::new(model.clone(), config).expect("engine");
            for i in 0..b as u32 {
                let prompt = (0..PROMPT as u32)
                    .map(|t| (i * 7919 + t * 104_729) % vocab)
                    .collect();
                let params = RequestParams {
                    max_tokens: NEW,
                    ..RequestParams::default()
                };
                let request = Request {
                    id: i as u64,
                    prompt,
                    params,
                };
                engine
                    .add_request(request, Box::new(|_| ControlFlow::Continue(())))
                    .expect("request");
            }
            engine.step().expect("prefill step");
            let start = Instant::now();
            let mut tokens = 0;
            while engine.has_work() {
                tokens += engine.step().expect("step");
            }
            let secs = start.elapsed().as_secs_f64();
            println!(
                "weights {dtype:>4} batch {b:>2}: {:.1} output tokens/s ({:.1} ms per step)",
                tokens as f64 / secs,
                1e3 * secs / (NEW - 1) as f64
            );
        }
    }
}
