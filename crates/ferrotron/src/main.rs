//! `ferrotron`: the command line. Parses arguments, wires the crates together and prints;
//! nothing else in the workspace reads argv or the environment.

mod convert;
mod data;
mod generate;
mod model_dir;
mod perplexity;
mod score;
mod serve;
mod sft;
mod train;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Ferrotron: train and run LLaMA-family language models, Megatron-style, in Rust.
#[derive(Parser)]
#[command(name = "ferrotron", version, about, long_about = None)]
struct Cli {
    /// Worker threads for kernels (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Convert model files between formats.
    #[command(subcommand)]
    Convert(convert::ConvertCommand),
    /// Generate text from a prompt (greedy or sampled, KV-cached, streamed).
    Generate(generate::GenerateArgs),
    /// Per-token log-probabilities, mean loss and perplexity of a text.
    Score(score::ScoreArgs),
    /// Perplexity of a long text in windows, as llama.cpp's llama-perplexity measures it.
    Perplexity(perplexity::PerplexityArgs),
    /// Tokenize corpora into Megatron .bin/.idx datasets (tools/preprocess_data.py).
    PreprocessData(data::PreprocessArgs),
    /// Summarize a .bin/.idx dataset and optionally decode its first documents.
    DatasetInfo(data::DatasetInfoArgs),
    /// Concatenate .bin/.idx datasets into one (tools/merge_datasets.py).
    MergeDatasets(data::MergeArgs),
    /// Tokenize alpaca/chat SFT data with answer-only labels into an idxmap dataset (Pai's
    /// build_idxmap_sft_dataset.py).
    PreprocessSft(sft::PreprocessSftArgs),
    /// Serve a model over an OpenAI-compatible HTTP API (continuous batching, paged KV
    /// cache, prefix caching), like `vllm serve`.
    Serve(serve::ServeArgs),
    /// Train (continue-pretrain) a model from a run.toml (Megatron's pretrain_gpt.py).
    Train(train::TrainArgs),
}

/// Exit codes: 0 success, 1 error, 2 bad command line (clap), 3 finished with some bad input
/// lines skipped.
fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(n) = cli.threads
        && let Err(e) = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
    {
        eprintln!("error: --threads {n}: {e}");
        return ExitCode::from(2);
    }
    let result = match cli.command {
        Command::Convert(c) => convert::run(c),
        Command::Generate(a) => generate::run(a),
        Command::Score(a) => score::run(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::PreprocessData(a) => data::preprocess(a),
        Command::DatasetInfo(a) => data::info(a),
        Command::MergeDatasets(a) => data::merge(a),
        Command::PreprocessSft(a) => sft::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Train(a) => train::run(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
