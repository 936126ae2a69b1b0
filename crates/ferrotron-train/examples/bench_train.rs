//! Training-speed benchmark, Ferrotron side of `scripts/bench-train.sh` (the PyTorch side is
//! `tools/bench_train_torch.py`, which documents the shared protocol).
//!
//! One configuration per process: an HF model directory loaded with
//! [`load_hf_model`] (f32 or bf16 weights), a [`Trainer`] with `micro_batch_size = global_batch_size = b`
//! (one forward/backward and one optimizer step per iteration: global-norm clipping + AdamW,
//! constant lr 1e-5, betas 0.9/0.999, eps 1e-8, weight decay 0.01 except norms and biases),
//! `--warmup` untimed then `--steps` timed [`Trainer::train_step`] calls on `--threads` rayon
//! threads. Tokens: the 64-bit LCG stream of `--seed` (token `(x >> 33) % vocab`) or a Megatron
//! `.bin` file (`--tokens`, uint16 ids when vocab < 65500 else int32), read cyclically; sample
//! `k = step·b + row` is items `k·(s+1) .. k·(s+1)+s+1`, inputs the first `s`, labels the
//! last `s`, every label counted.
//!
//! Prints one JSON line on stdout (tokens/s = `b·s` / median step time, ms/step, peak RSS from
//! `/proc/self/status` `VmHWM` in MiB, first/last loss; the model FLOPs per step by Megatron's
//! count ([`num_floating_point_operations`]), the achieved GFLOP/s, the machine's measured f32
//! FMA and bf16 dot peaks after the timed steps ([`ferrotron_tensor::peak`]) and the MFU
//! against each). `--precision bf16` trains as `ferrotron train` with `precision.bf16`: bf16
//! weights, f32 gradients, master weights and Adam moments, matmuls on bf16 operands with f32
//! accumulation ([`ferrotron_tensor::gemm_bf16`]).
//!
//! `cargo run --release -p ferrotron-train --example bench_train -- MODEL_DIR --micro-batch 1`

use anyhow::{Context, Result, bail};
use clap::{Parser, ValueEnum};
use ferrotron_data::MicroBatch;
use ferrotron_model::families::load_hf_model;
use ferrotron_model::{InitConfig, LoraConfig};
use ferrotron_optim::{LrDecayStyle, Precision as OptimPrecision};
use ferrotron_tensor::DType;
use ferrotron_tensor::gemm_bf16::Bf16Kernel;
use ferrotron_tensor::peak;
use ferrotron_train::trainer::{
    FlopsModel, Trainer, TrainerOptions, num_floating_point_operations,
};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The LCG multiplier and increment (Knuth's MMIX constants), shared with the torch script.
const LCG_MUL: u64 = 6364136223846793005;
const LCG_INC: u64 = 1442695040888963407;

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Precision {
    F32,
    Bf16,
}

/// Times `Trainer::train_step` on one configuration and prints a JSON line.
#[derive(Parser)]
struct Args {
    /// HF model directory (config.json + safetensors).
    model_dir: PathBuf,
    /// Training precision.
    #[arg(long, value_enum, default_value = "f32")]
    precision: Precision,
    /// Sequences per step (`b`).
    #[arg(long, default_value_t = 1)]
    micro_batch: usize,
    /// Tokens per sequence (`s`).
    #[arg(long, default_value_t = 512)]
    seq: usize,
    /// Untimed steps before the timed ones.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Rayon worker threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Learning rate (constant).
    #[arg(long, default_value_t = 1e-5)]
    lr: f64,
    /// AdamW decoupled weight decay (not applied to norms and biases).
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f64,
    /// Max global gradient norm; 0 disables clipping.
    #[arg(long, default_value_t = 1.0)]
    clip_grad: f64,
    /// Seed of the random token stream.
    #[arg(long, default_value_t = 12345)]
    seed: u64,
    /// Megatron .bin token file instead of random tokens.
    #[arg(long)]
    tokens: Option<PathBuf>,
    /// Train LoRA adapters of this rank (alpha = rank, on linear_qkv, linear_proj,
    /// linear_fc1, linear_fc2) on the frozen model instead of the whole model (the model
    /// FLOPs then leave out the base's weight-gradient GEMMs).
    #[arg(long)]
    lora_rank: Option<usize>,
}

fn main() -> ExitCode {
    match run(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(a: &Args) -> Result<()> {
    for (name, v) in [
        ("--micro-batch", a.micro_batch),
        ("--seq", a.seq),
        ("--steps", a.steps),
        ("--threads", a.threads),
    ] {
        if v == 0 {
            bail!("{name} must be >= 1");
        }
    }
    let (b, s) = (a.micro_batch, a.seq);
    rayon::ThreadPoolBuilder::new()
        .num_threads(a.threads)
        .build_global()
        .context("--threads: building the rayon pool")?;

    let (dtype, precision, mode) = match a.precision {
        Precision::F32 => (DType::F32, OptimPrecision::Fp32, "f32"),
        Precision::Bf16 => (DType::BF16, OptimPrecision::Bf16, "bf16"),
    };
    let (mut model, _) = load_hf_model(&a.model_dir, dtype)
        .with_context(|| format!("loading {}", a.model_dir.display()))?;
    if let Some(rank) = a.lora_rank {
        let lora = LoraConfig {
            rank,
            alpha: rank as f32,
            ..LoraConfig::default()
        };
        let init = InitConfig {
            params_dtype: dtype,
            ..InitConfig::default()
        };
        model = model.with_lora(lora, &init).context("--lora-rank")?;
    }
    // The model's FLOPs (a frozen base runs no weight-gradient GEMMs).
    let flops_per_step =
        num_floating_point_operations(&FlopsModel::from(model.config()), b as u64, s as u64);
    let vocab = model.config().vocab_size;
    let total = a.warmup + a.steps;
    let stream = match &a.tokens {
        Some(path) => file_tokens(path, vocab)?,
        None => lcg_tokens(a.seed, total * b * (s + 1), vocab),
    };
    if stream.len() < s + 1 {
        bail!(
            "token stream of {} ids is shorter than seq + 1 = {}",
            stream.len(),
            s + 1
        );
    }
    let steps: Vec<MicroBatch> = (0..total)
        .map(|i| micro_batch(&stream, i * b, b, s))
        .collect();

    let options = TrainerOptions {
        micro_batch_size: b,
        global_batch_size: b,
        train_iters: total as u64,
        log_interval: 1,
        eval_interval: 0,
        lr: a.lr,
        min_lr: a.lr,
        lr_warmup_iters: 0,
        lr_decay_style: LrDecayStyle::Constant,
        weight_decay: a.weight_decay,
        clip_grad: a.clip_grad,
        precision,
        ..TrainerOptions::default()
    };
    let mut trainer = Trainer::new(model, options).context("building the trainer")?;
    // As `ferrotron train` does once everything is built (see ferrotron_train::allocator).
    ferrotron_tensor::allocator::retain_freed_memory();
    let (mut times, mut losses) = (Vec::new(), Vec::new());
    for (i, mb) in steps.iter().enumerate() {
        let t = Instant::now();
        let stats = trainer
            .train_step(std::slice::from_ref(mb))
            .with_context(|| format!("train step {}", i + 1))?;
        let dt = t.elapsed().as_secs_f64();
        let kind = if i < a.warmup { "warmup" } else { "timed" };
        eprintln!(
            "ferrotron {mode} b={b} step {}/{total} ({kind}): {:.0} ms, loss {:.4}",
            i + 1,
            dt * 1e3,
            stats.loss
        );
        losses.push(stats.loss);
        if i >= a.warmup {
            times.push(dt);
        }
    }
    let med = median(&mut times);
    let peaks = Peaks::measure();
    let gflops = flops_per_step / med / 1e9;
    let mfu = |peak: Option<f64>| peak.map(|p| round(gflops / p, 4));
    let line = json!({
        "impl": "ferrotron",
        "mode": mode,
        "micro_batch": b,
        "seq": s,
        "threads": a.threads,
        "warmup": a.warmup,
        "steps": a.steps,
        "tokens_per_s": round((b * s) as f64 / med, 2),
        "ms_per_step": round(med * 1e3, 1),
        "ms_per_step_min": round(times[0] * 1e3, 1),
        "ms_per_step_max": round(times[times.len() - 1] * 1e3, 1),
        "peak_rss_mib": peak_rss_mib().map(|m| round(m, 1)),
        "loss_first": round(losses[0], 5),
        "loss_last": round(losses[losses.len() - 1], 5),
        "lora_rank": a.lora_rank,
        "model_flops_per_step": flops_per_step,
        "model_gflops_per_s": round(gflops, 1),
        "bf16_kernel": peaks.bf16_kernel,
        "peak_f32_gflops": peaks.f32_fma.map(|p| round(p, 1)),
        "peak_bf16_gflops": peaks.bf16_dot.map(|p| round(p, 1)),
        "mfu_f32_peak": mfu(peaks.f32_fma),
        "mfu_bf16_peak": mfu(peaks.bf16_dot),
    });
    println!("{line}");
    Ok(())
}

/// The machine's measured arithmetic peaks on the bench's thread pool
/// ([`ferrotron_tensor::peak`]), in GFLOP/s: the f32 FMA peak and the bf16 dot-product peak of
/// the kernel the bf16 GEMMs dispatch to (none where that kernel is the widened f32 one).
struct Peaks {
    f32_fma: Option<f64>,
    bf16_dot: Option<f64>,
    bf16_kernel: &'static str,
}

impl Peaks {
    fn measure() -> Peaks {
        let kernel = Bf16Kernel::detect();
        Peaks {
            f32_fma: peak::f32_fma().map(|p| p.gflops),
            bf16_dot: peak::bf16_dot(kernel).map(|p| p.gflops),
            bf16_kernel: kernel.name(),
        }
    }
}

/// The first `n` ids of the LCG stream from `seed`: `x ← x·LCG_MUL + LCG_INC (mod 2^64)`,
/// id `(x >> 33) mod vocab`.
fn lcg_tokens(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(LCG_MUL).wrapping_add(LCG_INC);
            ((x >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// Every id of a Megatron `.bin` data file: little-endian uint16 when `vocab < 65500`, else
/// int32 (Megatron's `DType.optimal_dtype`).
///
/// # Errors
/// Unreadable file, a partial trailing id, or an id outside `[0, vocab)`.
fn file_tokens(path: &Path, vocab: usize) -> Result<Vec<u32>> {
    let bytes = std::fs::read(path).with_context(|| format!("--tokens {}", path.display()))?;
    let width = if vocab < 65500 { 2 } else { 4 };
    if bytes.len() % width != 0 {
        bail!(
            "--tokens {}: {} bytes is not a whole number of {width}-byte ids",
            path.display(),
            bytes.len()
        );
    }
    let ids: Vec<i64> = bytes
        .chunks_exact(width)
        .map(|c| match c {
            [lo, hi] => i64::from(u16::from_le_bytes([*lo, *hi])),
            _ => i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        })
        .collect();
    if let Some(bad) = ids.iter().find(|&&id| id < 0 || id >= vocab as i64) {
        bail!("--tokens {}: id {bad} outside [0, {vocab})", path.display());
    }
    Ok(ids.into_iter().map(|id| id as u32).collect())
}

/// Samples `first .. first + b` of the cyclic `stream` as a `[b, s]` loader micro-batch
/// (labels = inputs shifted by one, all counted, default positions, one segment per row).
fn micro_batch(stream: &[u32], first: usize, b: usize, s: usize) -> MicroBatch {
    let row = |k: usize, offset: usize| {
        (0..s).map(move |t| stream[(k * (s + 1) + t + offset) % stream.len()])
    };
    let samples = first..first + b;
    MicroBatch {
        micro_batch_size: b,
        seq_length: s,
        tokens: samples.clone().flat_map(|k| row(k, 0)).collect(),
        labels: samples.clone().flat_map(|k| row(k, 1)).collect(),
        loss_mask: vec![1.0; b * s],
        position_ids: (0..b).flat_map(|_| 0..s as u32).collect(),
        segment_ids: vec![0; b * s],
        margins: vec![0.0; b],
        sample_indices: samples.collect(),
        consumed_samples: first + b,
    }
}

/// Median of `v` (mean of the two middle values when even, as Python's `statistics.median`);
/// sorts `v`. `v` is non-empty (`--steps >= 1`).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// `VmHWM` (peak resident set) of this process in MiB; `None` off Linux.
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

fn round(x: f64, digits: i32) -> f64 {
    let p = 10f64.powi(digits);
    (x * p).round() / p
}
