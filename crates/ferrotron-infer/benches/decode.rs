//! Greedy decode throughput (batch 1, KV cache) on a real HF model directory (f32 and bf16
//! weights) or GGUF file (its quantized weights kept quantized), and prefill throughput of a
//! 512-token prompt (llama-bench's pp512 / tg128). Not a test: run with
//! `FERROTRON_BENCH_MODEL=/path/to/smollm2[.gguf] cargo bench -p ferrotron-infer --bench decode`.
//! Prints the median tokens/s of 128 new tokens after a fixed prompt, and of the 512-token
//! prefill, over several runs.

use ferrotron_infer::sampler::SamplingParams;
use ferrotron_infer::{GenerateOptions, generate};
use std::ops::ControlFlow;
use std::path::PathBuf;

mod common;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Prints the median (and range) of `rates` after dropping the first (warm-up) run.
fn report(label: &str, mut rates: Vec<f64>) {
    rates.remove(0);
    rates.sort_by(f64::total_cmp);
    println!(
        "{label}: median {:.1} tokens/s (min {:.1}, max {:.1})",
        rates[rates.len() / 2],
        rates[0],
        rates[rates.len() - 1]
    );
}

fn main() {
    let Some(dir) = std::env::var_os("FERROTRON_BENCH_MODEL").map(PathBuf::from) else {
        eprintln!("set FERROTRON_BENCH_MODEL to an HF model directory (e.g. converted SmolLM2)");
        std::process::exit(2);
    };
    let runs: usize = std::env::var("FERROTRON_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let new_tokens = 128;
    // "The capital of France is" in the SmolLM2 vocabulary; any ids < vocab work.
    let prompt: Vec<u32> = vec![504, 3575, 282, 4649, 314];
    println!(
        "decode benchmark: {}, batch 1, {new_tokens} new tokens, {} threads, {runs} runs",
        dir.display(),
        rayon::current_num_threads()
    );
    for (weights, dtype) in common::variants(&dir) {
        let model = common::load(&dir, dtype);
        let options = GenerateOptions {
            max_new_tokens: new_tokens,
            sampling: SamplingParams::greedy(),
            stop_token_ids: vec![], // never stop early: time exactly `new_tokens` tokens
            lora: None,
        };
        let mut rates = Vec::new();
        for _ in 0..runs + 1 {
            let g = generate(
                &model,
                &prompt,
                &options,
                &mut |_| ControlFlow::Continue(()),
            )
            .expect("generate");
            rates.push((g.generated_ids.len() - 1) as f64 / g.decode_seconds);
        }
        report(&format!("weights {weights:>4} tg{new_tokens}"), rates);
        // pp512: a 512-token prompt (any ids < vocab), one new token.
        let vocab = model.config().vocab_size as u32;
        let long: Vec<u32> = (0..512u32).map(|i| (i * 7919 + 13) % vocab).collect();
        let one = GenerateOptions {
            max_new_tokens: 1,
            ..options.clone()
        };
        let mut rates = Vec::new();
        for _ in 0..runs + 1 {
            let g = generate(&model, &long, &one, &mut |_| ControlFlow::Continue(()))
                .expect("generate");
            rates.push(long.len() as f64 / g.prefill_seconds);
        }
        report(&format!("weights {weights:>4} pp512"), rates);
    }
}
