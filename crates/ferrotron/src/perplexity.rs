//! `ferrotron perplexity`: llama.cpp's `llama-perplexity` protocol on our model code (see
//! [`ferrotron_infer::perplexity`]), so a GGUF file's numbers compare with llama.cpp's.

use crate::model_dir::{LoadedModel, WeightDtype};
use anyhow::{Context, Result};
use clap::Args;
use ferrotron_infer::{PerplexityOptions, perplexity};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
pub struct PerplexityArgs {
    /// HF model directory, or a GGUF file (quantized weights stay quantized).
    #[arg(long)]
    model: PathBuf,
    /// Plain text file to score (llama-perplexity's -f), tokenized whole with the model's
    /// tokenizer, special tokens added as HF does.
    #[arg(long)]
    file: PathBuf,
    /// Tokens per window (llama-perplexity's -c); the second half of each window is scored.
    #[arg(long, default_value_t = 512)]
    ctx_size: usize,
    /// Tokens per forward pass inside a window (llama-perplexity's -ub; default: the whole
    /// window). A quantized model runs 16 or fewer with its int8 decode kernels and more
    /// with its weights dequantized block by block for the f32 GEMM.
    #[arg(long)]
    ubatch_size: Option<usize>,
    /// Score at most this many windows (default: all).
    #[arg(long)]
    chunks: Option<usize>,
    /// Weight storage in memory of the weights that are not quantized.
    #[arg(long, value_enum, default_value_t = WeightDtype::F32)]
    dtype: WeightDtype,
    /// Print one JSON object instead of the log lines.
    #[arg(long)]
    json: bool,
}

pub fn run(args: PerplexityArgs) -> Result<ExitCode> {
    let loaded = LoadedModel::load(&args.model, args.dtype)?;
    let tok = &loaded.tokenizer;
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("--file {}: cannot read", args.file.display()))?;
    let mut ids = tok.encode(&text, true)?;
    // The tokenizer adds a BOS when encoding with special tokens adds a leading token.
    let (with, without) = (tok.encode("a", true)?, tok.encode("a", false)?);
    let bos = (with.len() > without.len()).then(|| with[0]);
    let n_ctx = args.ctx_size;
    if let Some(c) = args.chunks {
        ids.truncate(c.saturating_mul(n_ctx).max(2 * n_ctx));
    }
    let opts = PerplexityOptions {
        n_ctx,
        ubatch: args.ubatch_size.unwrap_or(n_ctx),
        bos,
    };
    let chunks = ids.len() / n_ctx.max(1);
    eprintln!(
        "perplexity: {} tokens, {chunks} windows of {n_ctx}, {} tokens per pass",
        ids.len(),
        opts.ubatch
    );
    let bar = ProgressBar::new(chunks as u64).with_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} windows, {msg} [{elapsed} < {eta}]")
            .expect("template"),
    );
    let started = std::time::Instant::now();
    let p = perplexity(&loaded.model, &ids, opts, |i, run| {
        bar.set_position(i as u64 + 1);
        bar.set_message(format!("PPL {:.4}", run.ppl));
    })
    .context("--ctx-size / --ubatch-size")?;
    bar.finish_and_clear();
    let seconds = started.elapsed().as_secs_f64();
    if args.json {
        let mut v = serde_json::to_value(&p)?;
        v["seconds"] = seconds.into();
        v["tokens_per_second"] = ((p.chunks * n_ctx) as f64 / seconds).into();
        println!("{v}");
    } else {
        let running: Vec<String> = p
            .ppl_after_chunk
            .iter()
            .enumerate()
            .map(|(i, x)| format!("[{}]{x:.4}", i + 1))
            .collect();
        println!("{}", running.join(","));
        println!(
            "Final estimate: PPL = {:.4} +/- {:.5} ({} tokens scored, {:.1} tokens/s)",
            p.ppl,
            p.ppl_stderr,
            p.tokens,
            (p.chunks * n_ctx) as f64 / seconds
        );
    }
    Ok(ExitCode::SUCCESS)
}
