//! Model-state memory per data-parallel rank, measured, against Megatron's formula.
//!
//! Megatron-Core's "distributed optimizer" docs count the bytes per parameter each rank holds
//! for the model state: bf16 params (2) + f32 grads (4) + f32 master weights and Adam moments
//! (12) = **18**, or **6 + 12/dp** when the distributed optimizer shards the last 12 over `dp`
//! ranks; in fp32 16, or 8 + 8/dp.
//!
//! This example loads an HF model on `--data-parallel-size` in-process ranks (each rank its
//! own copy, as separate processes would), builds a [`Trainer`] on each and runs one step
//! (so every gradient, master weight and moment has been written), and measures the **live
//! heap bytes** with a counting global allocator: those in use with every rank's trainer
//! alive minus those in use before the first model was loaded, divided by the ranks. So the
//! measurement includes everything a rank keeps (model, buffers, optimizer, communicator,
//! config) and nothing the step freed (activations). It prints one JSON line: the measured
//! bytes per parameter per rank, what [`Trainer::model_state_bytes`] counts from the
//! allocations, and the formula; plus the peak live bytes per rank during the step and the
//! process's `VmRSS`.
//!
//! ZeRO-2/3 (`--data-parallel-sharding-strategy optim_grads | optim_grads_params`) keep
//! full-size gradient and parameter buffers whose pages they give back to the system, so
//! the heap count does not see what they save: `resident_bytes_per_param_per_rank` measures
//! the resident pages ([`Trainer::resident_model_state_bytes`]) against Megatron-FSDP's
//! formula, `2 + (4 + 12)/dp` and `(2 + 4 + 12)/dp` with bf16 params.
//!
//! With `--lora-rank R` the model trains LoRA adapters (rank R, alpha R, on all four linear
//! layers) and its frozen base holds only its weights: the formula is then
//! `frozen · param_bytes + trainable · (param_bytes + 4 + optimizer/dp)`.
//!
//! `cargo run --release -p ferrotron-train --example model_state_memory -- MODEL_DIR \
//!   --precision bf16 --data-parallel-size 2 --use-distributed-optimizer [--lora-rank 16]`
//! (or `--data-parallel-sharding-strategy optim_grads_params`)

use anyhow::{Context, Result, anyhow, bail};
use clap::Parser;
use ferrotron_comm::run_local;
use ferrotron_data::MicroBatch;
use ferrotron_model::families::load_hf_model;
use ferrotron_model::{InitConfig, LoraConfig};
use ferrotron_optim::Precision;
use ferrotron_tensor::DType;
use ferrotron_train::trainer::{DataParallel, ShardingStrategy, Trainer, TrainerOptions};
use serde_json::json;
use std::alloc::{GlobalAlloc, Layout, System};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator, counting the bytes in use and their high-water mark.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

/// Counts `size` bytes as allocated when the allocation `p` succeeded; returns `p`.
fn counted(p: *mut u8, size: usize) -> *mut u8 {
    if !p.is_null() {
        let now = LIVE.fetch_add(size, Ordering::Relaxed) + size;
        PEAK.fetch_max(now, Ordering::Relaxed);
    }
    p
}

// SAFETY: every call is forwarded to `System` unchanged; the counters are only statistics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is `System::alloc`'s.
        counted(unsafe { System.alloc(layout) }, layout.size())
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        counted(unsafe { System.alloc_zeroed(layout) }, layout.size())
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Measures the model state one data-parallel rank holds (see the module doc).
#[derive(Parser)]
struct Args {
    /// HF model directory (config.json + safetensors).
    model_dir: PathBuf,
    /// Training precision: `bf16` (or `fp16`) params with f32 grads, master weights and Adam
    /// moments, or `fp32` throughout.
    #[arg(long, default_value = "bf16", value_parser = parse_precision)]
    precision: Precision,
    /// In-process data-parallel ranks.
    #[arg(long, default_value_t = 1)]
    data_parallel_size: usize,
    /// Shard the master weights and Adam moments over the ranks (ZeRO-1).
    #[arg(long)]
    use_distributed_optimizer: bool,
    /// What the ranks shard: no_shard, optim (ZeRO-1), optim_grads (ZeRO-2) or
    /// optim_grads_params (ZeRO-3). Default: optim with --use-distributed-optimizer, else
    /// no_shard.
    #[arg(long, value_parser = parse_strategy)]
    data_parallel_sharding_strategy: Option<ShardingStrategy>,
    /// Tokens per sequence of the one training step (one sequence per rank).
    #[arg(long, default_value_t = 64)]
    seq: usize,
    /// Train LoRA adapters of this rank (alpha = rank, NeMo's four targets) on the frozen
    /// model instead of the whole model.
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
    let dp = a.data_parallel_size;
    if dp == 0 || a.seq == 0 {
        bail!("--data-parallel-size and --seq must be >= 1");
    }
    let precision = a.precision;
    let strategy = (a.data_parallel_sharding_strategy).unwrap_or(
        ShardingStrategy::from_distributed_optimizer(a.use_distributed_optimizer),
    );
    let dtype = precision.param_dtype();
    let trained = megatron_bytes_per_param(dtype, strategy, dp);
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let trainers = run_local(dp, |comm| -> Result<Trainer> {
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
            model = model.with_lora(lora, &init)?;
        }
        let vocab = model.config().vocab_size as u64;
        let options = TrainerOptions {
            micro_batch_size: 1,
            global_batch_size: dp,
            data_parallel_size: dp,
            train_iters: 1,
            precision,
            ..TrainerOptions::default()
        };
        let group = DataParallel::new(Arc::new(comm), false).with_sharding_strategy(strategy)?;
        let mut trainer = Trainer::new_data_parallel(model, options, group)?;
        let s = a.seq;
        let tokens: Vec<u32> = (0..=s as u64).map(|i| (i * 7919 % vocab) as u32).collect();
        let batch = MicroBatch {
            micro_batch_size: 1,
            seq_length: s,
            tokens: tokens[..s].to_vec(),
            labels: tokens[1..].to_vec(),
            loss_mask: vec![1.0; s],
            position_ids: (0..s as u32).collect(),
            segment_ids: vec![0; s],
            margins: vec![0.0],
            sample_indices: vec![0],
            consumed_samples: 1,
        };
        trainer.train_step(&[batch])?;
        Ok(trainer)
    })
    .map_err(|e| anyhow!("{e}"))?;
    let live = LIVE.load(Ordering::Relaxed) - before;
    let peak = PEAK.load(Ordering::Relaxed) - before;
    let infos = trainers[0].model().parameters();
    let numel: usize = infos.iter().map(|p| p.numel()).sum();
    let trainable: usize = infos.iter().filter(|p| !p.frozen).map(|p| p.numel()).sum();
    // Frozen parameters hold their weights only.
    let formula_bytes =
        (numel - trainable) as f64 * dtype.size_in_bytes() as f64 + trainable as f64 * trained;
    let formula = formula_bytes / numel as f64;
    let per_param = |bytes: usize| bytes as f64 / (dp * numel) as f64;
    let counted: usize = trainers.iter().map(Trainer::model_state_bytes).sum();
    let resident: usize = (trainers.iter())
        .map(Trainer::resident_model_state_bytes)
        .sum();
    let line = json!({
        "mode": dtype.to_string(),
        "data_parallel_size": dp,
        "data_parallel_sharding_strategy": strategy.name(),
        "parameters": numel,
        "lora_rank": a.lora_rank,
        "trainable_parameters": trainable,
        "measured_bytes_per_param_per_rank": round(per_param(live)),
        "counted_bytes_per_param_per_rank": round(per_param(counted)),
        "resident_bytes_per_param_per_rank": round(per_param(resident)),
        "formula_bytes_per_param": round(formula),
        "measured_mib_per_rank": round(live as f64 / dp as f64 / (1 << 20) as f64),
        "peak_live_mib_per_rank": round(peak as f64 / dp as f64 / (1 << 20) as f64),
        "vm_rss_mib": vm_rss_mib(),
    });
    println!("{line}");
    Ok(())
}

/// Megatron-Core's model state per parameter and rank: params in `dtype`, f32 grads, Adam's
/// two f32 moments plus f32 master weights when the params are 16-bit; what `strategy`
/// shards divided over the `dp` ranks.
fn megatron_bytes_per_param(dtype: DType, strategy: ShardingStrategy, dp: usize) -> f64 {
    let param = dtype.size_in_bytes() as f64;
    let optimizer = (8 + if param < 4.0 { 4 } else { 0 }) as f64;
    let over = |sharded: bool| if sharded { dp as f64 } else { 1.0 };
    param / over(strategy.shards_params())
        + 4.0 / over(strategy.shards_grads())
        + optimizer / over(strategy.shards_optimizer())
}

fn parse_precision(name: &str) -> Result<Precision, String> {
    Precision::parse(name).ok_or_else(|| format!("`{name}`: expected fp32, bf16 or fp16"))
}

fn parse_strategy(name: &str) -> Result<ShardingStrategy, String> {
    ShardingStrategy::parse(name).ok_or_else(|| {
        format!("`{name}`: expected no_shard, optim, optim_grads or optim_grads_params")
    })
}

fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// The process's resident set (`VmRSS` of `/proc/self/status`) in MiB, where readable.
fn vm_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(round(kib / 1024.0))
}
