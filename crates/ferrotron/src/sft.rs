//! `preprocess-sft`: alpaca/chat JSON(L) -> Pai-style idxmap SFT dataset (tokens + labels).

use anyhow::Result;
use clap::{Args, ValueEnum};
use ferrotron_data::sft::{Overlong, SftEncoder, SftFormat, SftOptions, SftReport, write_idxmap};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Args)]
pub struct PreprocessSftArgs {
    /// Input files: JSON arrays or JSONL of alpaca records ({"instruction","input","output"}) or
    /// chats ({"messages": [{"role","content"}, ...]}).
    #[arg(long, num_args = 1.., required = true)]
    input: Vec<PathBuf>,
    /// HF model or tokenizer directory (tokenizer.json; tokenizer_config.json with the chat
    /// template, without one the Stanford alpaca prompt is used).
    #[arg(long)]
    tokenizer: PathBuf,
    /// Output prefix; writes PREFIX_text_document.{bin,idx} (int32: tokens then labels per sequence).
    #[arg(long)]
    output_prefix: PathBuf,
    /// Sequence length of every sample, tokens (Pai --max-padding-length).
    #[arg(long)]
    max_padding_length: usize,
    /// Pack several samples per sequence (position ids and attention reset per sample).
    #[arg(long)]
    pack: bool,
    /// What to do with samples longer than --max-padding-length.
    #[arg(long, value_enum, default_value_t = OverlongArg::Truncate)]
    overlong: OverlongArg,
    /// Input format (auto detects it per file).
    #[arg(long, value_enum, default_value_t = FormatArg::Auto)]
    format: FormatArg,
    /// Padding token id (default: the tokenizer's pad token, else its EOS).
    #[arg(long)]
    pad_id: Option<u32>,
    /// Encoding threads (default: all cores).
    #[arg(long)]
    workers: Option<usize>,
    /// Make the first bad record fatal instead of skipping it.
    #[arg(long)]
    strict: bool,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum OverlongArg {
    /// Keep the head, cut the answer tail.
    Truncate,
    /// Drop the sample.
    Drop,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum FormatArg {
    Auto,
    Alpaca,
    Chat,
}

pub fn run(a: PreprocessSftArgs) -> Result<ExitCode> {
    let encoder = SftEncoder::from_model_dir(&a.tokenizer)?;
    let mut opts = SftOptions::new(a.max_padding_length);
    opts.pack = a.pack;
    opts.overlong = match a.overlong {
        OverlongArg::Truncate => Overlong::Truncate,
        OverlongArg::Drop => Overlong::Drop,
    };
    opts.format = match a.format {
        FormatArg::Auto => SftFormat::Auto,
        FormatArg::Alpaca => SftFormat::Alpaca,
        FormatArg::Chat => SftFormat::Chat,
    };
    opts.pad_id = a.pad_id;
    opts.strict = a.strict;
    opts.workers = a.workers.unwrap_or_else(rayon::current_num_threads);
    let files: Vec<&Path> = a.input.iter().map(PathBuf::as_path).collect();
    let start = std::time::Instant::now();
    let r: SftReport = write_idxmap(&files, &encoder, &opts, &a.output_prefix)?;
    println!(
        "{} records -> {} samples in {} sequences of {} tokens ({} tokens, {} trained) in {:.1} s; \
         truncated {}, dropped overlong {}, dropped without answer {}",
        r.records,
        r.samples,
        r.sequences,
        a.max_padding_length,
        r.tokens,
        r.trained_tokens,
        start.elapsed().as_secs_f64(),
        r.truncated,
        r.dropped_overlong,
        r.dropped_no_answer
    );
    if r.bad_records > 0 {
        eprintln!("skipped {} bad records; first ones:", r.bad_records);
        for e in &r.bad_examples {
            eprintln!("  {e}");
        }
        return Ok(ExitCode::from(3));
    }
    Ok(ExitCode::SUCCESS)
}
