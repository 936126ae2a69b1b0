//! `ferrotron convert expand-vocab`: tokens added to an HF model's vocabulary (as added
//! tokens or merged into its BPE model), their embedding (and output) rows the mean of their
//! old pieces' rows.

use super::DtypeArg;
use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use ferrotron_checkpoint::{ExpandVocabOptions, VocabMode, expand_vocab};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
pub struct ExpandVocabArgs {
    /// The HF model directory (config.json, safetensors, tokenizer.json).
    #[arg(long)]
    hf: PathBuf,
    /// UTF-8 file of tokens to add, one per line, taken verbatim (spaces count; empty lines
    /// are skipped). As with HF's add_tokens, a token already in the vocabulary keeps its id
    /// and row but is matched as an added token from now on (reported).
    #[arg(long)]
    add_tokens: PathBuf,
    /// How the tokens join tokenizer.json: `added` as HF's tokenizer.add_tokens (matched in
    /// the text before pre-tokenization, any string), or `merged` into the BPE model's vocab
    /// with merges appended after the old ones (produced wherever BPE meets the text inside a
    /// word, as a tokenizer trained on the new text; intermediate strings the merges need
    /// join the vocabulary too; needs a BPE tokenizer and tokens the pre-tokenizer keeps
    /// whole, e.g. no inner spaces).
    #[arg(long, value_enum, default_value_t = ModeArg::Added)]
    mode: ModeArg,
    /// The directory to create (written to a temporary name, renamed when complete).
    #[arg(long)]
    output: PathBuf,
    /// Round vocab_size up to a multiple of this (Megatron pads the vocabulary to
    /// make_vocab_size_divisible_by x tensor-parallel size, e.g. 128).
    #[arg(long, default_value_t = 1)]
    pad_to_multiple_of: usize,
    /// Element type of the output weights [default: the input's torch_dtype].
    #[arg(long, value_enum)]
    dtype: Option<DtypeArg>,
    /// Replace an existing non-empty output directory.
    #[arg(long)]
    force: bool,
}

#[derive(Clone, Copy, ValueEnum)]
enum ModeArg {
    Added,
    Merged,
}

pub fn expand(a: ExpandVocabArgs) -> Result<ExitCode> {
    let text = std::fs::read_to_string(&a.add_tokens)
        .with_context(|| format!("--add-tokens {}: cannot read", a.add_tokens.display()))?;
    let tokens: Vec<String> = text
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect();
    if tokens.is_empty() {
        bail!(
            "--add-tokens {}: no tokens (one per line)",
            a.add_tokens.display()
        );
    }
    if a.pad_to_multiple_of == 0 {
        bail!("--pad-to-multiple-of must be >= 1");
    }
    let opts = ExpandVocabOptions {
        mode: match a.mode {
            ModeArg::Added => VocabMode::Added,
            ModeArg::Merged => VocabMode::Merged,
        },
        pad_to_multiple_of: a.pad_to_multiple_of,
        dtype: a.dtype.map(DtypeArg::output),
        force: a.force,
    };
    let bar = super::spinner(format!("expanding the vocabulary of {}", a.hf.display()));
    let result = expand_vocab(&a.hf, &tokens, &a.output, &opts);
    bar.finish_and_clear();
    let report = result.with_context(|| format!("convert expand-vocab {}", a.hf.display()))?;
    for t in &report.skipped {
        match a.mode {
            ModeArg::Added => eprintln!(
                "already in the vocabulary: {t:?} keeps its id (matched as an added token from now on, as HF's add_tokens does)"
            ),
            ModeArg::Merged => eprintln!("already one token: {t:?} keeps its id"),
        }
    }
    let (old, new) = report.vocab_size;
    println!(
        "wrote {}: {} tokens added (ids {}), vocab_size {old} -> {new}",
        report.output.display(),
        report.added.len(),
        match (report.added.first(), report.added.last()) {
            (Some(f), Some(l)) => format!("{}..={}", f.1.id, l.1.id),
            _ => "none".into(),
        }
    );
    Ok(ExitCode::SUCCESS)
}
