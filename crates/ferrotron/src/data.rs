//! `preprocess-data`, `dataset-info` and `merge-datasets`: Megatron-compatible indexed datasets.

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use ferrotron_data::Tokenizer;
use ferrotron_data::indexed::{IndexedDataset, dataset_prefixes_in_dir, merge_datasets};
use ferrotron_data::preprocess::{
    EodToken, PreprocessConfig, PreprocessReport, TextMode, dataset_info, document_tokens,
    preprocess_data, resolve_eod,
};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

#[derive(Args)]
pub struct PreprocessArgs {
    /// Input files: JSONL (`.jsonl`, `.json`), zstd-compressed JSONL (`.jsonl.zst`) or plain text
    /// (`.txt`: one document per line, or per blank-line-separated block with --text-mode blocks).
    #[arg(long, num_args = 1.., required = true)]
    input: Vec<PathBuf>,
    /// JSON keys holding the text; each key writes PREFIX_{key}_document.{bin,idx}.
    #[arg(long, num_args = 1.., default_value = "text")]
    json_keys: Vec<String>,
    /// HF tokenizer directory (tokenizer.json, tokenizer_config.json).
    #[arg(long)]
    tokenizer: PathBuf,
    /// Output prefix.
    #[arg(long)]
    output_prefix: PathBuf,
    /// Append the end-of-document token to every document (Megatron --append-eod).
    #[arg(long)]
    append_eod: bool,
    /// The EOD token (a token string or an id); default: the tokenizer's eos_token, as Megatron.
    #[arg(long, requires = "append_eod")]
    eod_token: Option<String>,
    /// Tokenizing threads (default: all cores).
    #[arg(long)]
    workers: Option<usize>,
    /// Sentence splitting (Megatron --split-sentences); only `no` is supported.
    #[arg(long, default_value = "no")]
    split_sentences: String,
    /// Document boundaries in .txt inputs.
    #[arg(long, value_enum, default_value_t = TextModeArg::Lines)]
    text_mode: TextModeArg,
    /// Let the tokenizer add its special tokens (e.g. BOS) to every document.
    #[arg(long)]
    add_special_tokens: bool,
    /// Make a bad JSONL line fatal instead of skipping it.
    #[arg(long)]
    strict: bool,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum TextModeArg {
    /// Every non-blank line is a document.
    Lines,
    /// Blank-line-separated blocks are documents.
    Blocks,
}

pub fn preprocess(a: PreprocessArgs) -> Result<ExitCode> {
    if a.split_sentences != "no" {
        bail!(
            "--split-sentences {}: only `no` is supported",
            a.split_sentences
        );
    }
    let tokenizer = Tokenizer::from_dir(&a.tokenizer)?;
    let mut cfg = PreprocessConfig::new(a.input.clone(), &a.output_prefix);
    cfg.json_keys = a.json_keys.clone();
    cfg.text_mode = match a.text_mode {
        TextModeArg::Lines => TextMode::Lines,
        TextModeArg::Blocks => TextMode::Blocks,
    };
    cfg.add_special_tokens = a.add_special_tokens;
    cfg.strict = a.strict;
    cfg.workers = a.workers.unwrap_or_else(rayon::current_num_threads);
    if a.append_eod {
        let choice = match &a.eod_token {
            None => EodToken::TokenizerEos,
            Some(t) => match t.parse::<u32>() {
                Ok(id) => EodToken::Id(id),
                Err(_) => EodToken::Token(t.clone()),
            },
        };
        cfg.append_eod = Some(resolve_eod(&choice, &tokenizer, &a.tokenizer)?);
    }
    // Ctrl-C stops the run cleanly: the library removes its temporary files and nothing appears
    // under the output names.
    let cancel = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&cancel);
    ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))
        .context("installing the Ctrl-C handler")?;
    cfg.cancel = Some(cancel);
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template(
            "{bar:30} {bytes}/{total_bytes} [{elapsed_precise}<{eta_precise}] {msg}",
        )
        .expect("valid template"),
    );
    let report = preprocess_data(&cfg, &tokenizer, &mut |p| {
        bar.set_length(p.input_bytes_total);
        bar.set_position(p.input_bytes);
        let secs = p.elapsed.as_secs_f64().max(1e-9);
        bar.set_message(format!(
            "{} docs ({:.0}/s), {} tokens ({:.0}/s)",
            p.documents,
            p.documents as f64 / secs,
            p.tokens,
            p.tokens as f64 / secs
        ));
    });
    bar.finish_and_clear();
    Ok(print_preprocess_report(&report?))
}

/// Prints what `preprocess` wrote and its throughput, and the skipped lines; exit code 3 when
/// some lines were skipped.
fn print_preprocess_report(r: &PreprocessReport) -> ExitCode {
    let secs = r.elapsed.as_secs_f64().max(1e-9);
    for o in &r.outputs {
        println!(
            "wrote {}.{{bin,idx}}: {} documents, {} tokens ({})",
            o.prefix.display(),
            o.documents,
            o.tokens,
            r.dtype.name()
        );
    }
    println!(
        "{} documents, {} tokens from {:.1} MB in {:.1} s ({:.1} MB/s, {:.0} tokens/s); eod {:?}",
        r.documents,
        r.tokens,
        r.bytes_read as f64 / 1e6,
        secs,
        r.bytes_read as f64 / 1e6 / secs,
        r.tokens as f64 / secs,
        r.eod
    );
    if r.skipped > 0 {
        eprintln!("skipped {} bad lines; first ones:", r.skipped);
        for s in &r.skipped_examples {
            eprintln!("  {}:{}: {}", s.path.display(), s.line, s.reason);
        }
        return ExitCode::from(3);
    }
    ExitCode::SUCCESS
}

#[derive(Args)]
pub struct DatasetInfoArgs {
    /// Dataset prefix (PREFIX.bin / PREFIX.idx).
    #[arg(long)]
    prefix: PathBuf,
    /// Decode and print the first N documents (needs --tokenizer).
    #[arg(long, default_value_t = 0, requires = "tokenizer")]
    show: usize,
    /// HF tokenizer directory, to decode documents.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
}

pub fn info(a: DatasetInfoArgs) -> Result<ExitCode> {
    let i = dataset_info(&a.prefix)?;
    println!("prefix     {}", i.prefix.display());
    println!("dtype      {}", i.dtype.name());
    println!("documents  {} ({} empty)", i.documents, i.empty_documents);
    println!("sequences  {}", i.sequences);
    println!("tokens     {}", i.tokens);
    println!("bytes      .bin {}  .idx {}", i.bin_bytes, i.idx_bytes);
    let l = &i.document_length;
    println!(
        "doc length min {} / mean {:.1} / max {}",
        l.min, l.mean, l.max
    );
    if let Some(dir) = &a.tokenizer {
        let tok = Tokenizer::from_dir(dir)?;
        let ds = IndexedDataset::open(&a.prefix)?;
        for d in 0..a.show.min(i.documents) {
            let ids = document_tokens(&ds, d).context("document index past the end")?;
            println!(
                "--- document {d} ({} tokens)\n{}",
                ids.len(),
                tok.decode(&ids, false)?
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Args)]
pub struct MergeArgs {
    /// Input prefixes, in order, or one directory whose every NAME.bin/NAME.idx pair is merged
    /// (sorted by name, like Megatron's tools/merge_datasets.py --input DIR).
    #[arg(long, num_args = 1.., required = true)]
    input: Vec<PathBuf>,
    /// Output prefix.
    #[arg(long)]
    output_prefix: PathBuf,
}

pub fn merge(a: MergeArgs) -> Result<ExitCode> {
    let inputs = match a.input.as_slice() {
        [dir] if dir.is_dir() => dataset_prefixes_in_dir(dir)?,
        many => many.to_vec(),
    };
    let s = merge_datasets(&inputs, &a.output_prefix)?;
    println!(
        "merged {} datasets into {}: {s:?}",
        inputs.len(),
        a.output_prefix.display()
    );
    Ok(ExitCode::SUCCESS)
}
