//! Batched decode throughput of the serving engine (continuous batching over the paged KV
//! cache) on a real HF model directory or GGUF file: B requests of a 32-token prompt, 64 new tokens each,
//! all admitted at once; aggregate output tokens/s of the decode steps (prefill excluded)
//! for B = 1, 4, 8, 16, 32, f32 and bf16 weights, and with `FERROTRON_BENCH_DRAFT` (a draft
//! model: HF directory or GGUF file) each batch again with draft-model speculation, and with
//! `FERROTRON_BENCH_LORA=N` each batch again with LoRA adapters (rank 16 on every linear
//! layer, random), request `i` taking adapter `i mod N` (S-LoRA's many-adapter decode),
//! alternated with runs without adapters and reported as medians and their ratio. Not a
//! test: run with
//! `FERROTRON_BENCH_MODEL=/path/to/smollm2 cargo bench -p ferrotron-infer --bench engine`.

use ferrotron_infer::engine::{
    Engine, EngineConfig, LoraRequest, Request, RequestParams, SchedulerConfig, SpeculativeConfig,
};
use ferrotron_model::{GptModel, InitConfig, LoraConfig};
use ferrotron_tensor::DType;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

mod common;

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
    // A draft model (HF directory or GGUF file with the same tokenizer): each batch also runs
    // with draft-model speculation, 4 tokens per step.
    let draft = std::env::var_os("FERROTRON_BENCH_DRAFT")
        .map(|p| Arc::new(common::load(&PathBuf::from(p), DType::F32)));
    let num_adapters: usize = std::env::var("FERROTRON_BENCH_LORA")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    println!(
        "engine benchmark: {}, prompt {PROMPT}, {NEW} new tokens per request, {} threads",
        dir.display(),
        rayon::current_num_threads()
    );
    ferrotron_tensor::allocator::retain_freed_memory();
    for (label, dtype) in common::variants(&dir) {
        let model = Arc::new(common::load(&dir, dtype));
        let adapters = random_adapters(&model, num_adapters);
        for &b in &batches {
            let (rate, ms) = decode_rate(&model, None, &[], b);
            println!(
                "weights {label:>4} batch {b:>2}: {rate:.1} output tokens/s ({ms:.1} ms per step)"
            );
            if let Some(d) = &draft {
                let (rate, ms) = decode_rate(&model, Some(d.clone()), &[], b);
                println!(
                    "weights {label:>4} batch {b:>2} + draft model: {rate:.1} output tokens/s \
                     ({ms:.1} ms per step)"
                );
            }
            if !adapters.is_empty() {
                lora_overhead(&model, &adapters, b, &label);
            }
        }
    }
}

/// Base and LoRA runs of batch `b` alternated five times (the machine's speed drifts):
/// median tokens/s of each and the median of the per-pair ratios.
fn lora_overhead(model: &Arc<GptModel>, adapters: &[LoraRequest], b: usize, label: &str) {
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let pairs: Vec<(f64, f64)> = (0..5)
        .map(|_| {
            let base = decode_rate(model, None, &[], b).0;
            (base, decode_rate(model, None, adapters, b).0)
        })
        .collect();
    let ratio = median(pairs.iter().map(|(base, lora)| lora / base).collect());
    println!(
        "weights {label:>4} batch {b:>2} + {} LoRA adapters: {:.1} output tokens/s vs {:.1} \
         without (medians of 5 alternated runs), ratio {ratio:.3}",
        adapters.len(),
        median(pairs.iter().map(|p| p.1).collect()),
        median(pairs.iter().map(|p| p.0).collect()),
    );
}

/// `n` LoRA adapters of rank 16 on every linear layer of `model`: `A` Xavier-normal, `B`
/// uniform in ±0.05 (through their PEFT tensors, as a server reads them).
fn random_adapters(model: &GptModel, n: usize) -> Vec<LoraRequest> {
    let lora = LoraConfig {
        target_modules: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
            .map(String::from)
            .to_vec(),
        rank: 16,
        alpha: 16.0,
        dropout: 0.0,
    };
    (0..n as u64)
        .map(|seed| {
            let init = InitConfig {
                seed,
                params_dtype: model.dtype(),
                ..InitConfig::default()
            };
            let adapted = model.clone().with_lora(lora.clone(), &init).expect("LoRA");
            let tensors = adapted.peft_tensors().expect("PEFT tensors");
            let mut x = seed;
            let weights = model
                .lora_weights_from_peft(lora.rank, lora.alpha, |name| {
                    let mut t = tensors.iter().find(|t| t.name == name)?.clone();
                    if name.contains("lora_B") {
                        for v in &mut t.values {
                            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                            *v = ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1;
                        }
                    }
                    Some(t)
                })
                .expect("adapter");
            LoraRequest {
                name: format!("adapter{seed}"),
                id: seed + 1,
                weights: Arc::new(weights),
            }
        })
        .collect()
}

/// Output tokens/s and ms per step of `b` requests decoding together after their prefill,
/// request `i` with `adapters[i % len]` when there are adapters.
fn decode_rate(
    model: &Arc<GptModel>,
    draft: Option<Arc<GptModel>>,
    adapters: &[LoraRequest],
    b: usize,
) -> (f64, f64) {
    let vocab = model.config().vocab_size as u32;
    let models: Vec<&GptModel> = std::iter::once(&**model).chain(draft.as_deref()).collect();
    let config = EngineConfig {
        block_size: 16,
        num_blocks: EngineConfig::blocks_for_memory(&models, 16, 1 << 30),
        scheduler: SchedulerConfig {
            max_num_seqs: b,
            max_num_batched_tokens: b * PROMPT,
        },
        enable_prefix_caching: false,
        speculative: draft.as_ref().map(|_| SpeculativeConfig::DraftModel {
            num_speculative_tokens: 4,
        }),
        speculative_disable_by_batch_size: None,
    };
    let mut engine = Engine::new(model.clone(), config).expect("engine");
    if let Some(d) = draft {
        engine = engine.with_draft_model(d).expect("draft");
    }
    let outputs = Arc::new(AtomicUsize::new(0));
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
            lora: (!adapters.is_empty()).then(|| adapters[i as usize % adapters.len()].clone()),
        };
        let count = outputs.clone();
        let sink = Box::new(move |_| {
            count.fetch_add(1, Ordering::Relaxed);
            ControlFlow::Continue(())
        });
        engine.add_request(request, sink).expect("request");
    }
    engine.step().expect("prefill step");
    let first = outputs.load(Ordering::Relaxed);
    let start = Instant::now();
    let mut steps = 0;
    while engine.has_work() {
        engine.step().expect("step");
        steps += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    let tokens = outputs.load(Ordering::Relaxed) - first;
    (tokens as f64 / secs, 1e3 * secs / steps.max(1) as f64)
}
