//! Corpus preprocessing into Megatron indexed datasets: the library behind
//! `ferrotron preprocess-data`, following Megatron's `tools/preprocess_data.py`.
//!
//! Inputs are JSONL (optionally zstd-compressed: `.jsonl.zst`) or plain text (`.txt`, one
//! document per line or per blank-line-separated block). Each JSON key gets its own output
//! dataset `PREFIX_{key}_document.{bin,idx}` (uint16 tokens when the vocabulary has fewer than
//! 65500 entries, else int32). Worker threads tokenize batches in parallel; a writer restores
//! input order, so the output does not depend on the number of workers. Outputs are written
//! under temporary names and renamed only when every output is complete.
//!
//! The library never prints: progress goes to a callback, results to [`PreprocessReport`].

mod encode;
mod eod;
mod info;
mod input;
mod pipeline;

pub use eod::{EodToken, megatron_eod_id, resolve_eod};
pub use info::{DatasetInfo, LengthStats, dataset_info, document_tokens};
pub use pipeline::preprocess_data;

use crate::indexed::{BuilderError, TokenDtype};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

/// How an input file is parsed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputFormat {
    /// One JSON object per line; the configured keys hold the text.
    Jsonl,
    /// Plain UTF-8 text; see [`TextMode`].
    Text,
}

/// How plain text splits into documents.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TextMode {
    /// Every non-blank line is a document.
    #[default]
    Lines,
    /// Runs of non-blank lines separated by blank lines are documents (joined with `\n`).
    Blocks,
}

/// Settings of one preprocessing run. [`PreprocessConfig::new`] gives Megatron's defaults.
#[derive(Clone, Debug)]
pub struct PreprocessConfig {
    /// Input files, processed in order into the same outputs.
    pub inputs: Vec<PathBuf>,
    /// Output prefix; each key writes `{output_prefix}_{key}_document.{bin,idx}`.
    pub output_prefix: PathBuf,
    /// JSON keys to extract (Megatron's `--json-keys`, default `["text"]`). Text inputs need
    /// exactly one key, which names their output.
    pub json_keys: Vec<String>,
    /// Format of every input; `None` picks by name (`.txt`/`.txt.zst` text, else JSONL).
    pub format: Option<InputFormat>,
    /// Document boundaries for text inputs.
    pub text_mode: TextMode,
    /// Token id appended to every non-empty document (`--append-eod`); see [`resolve_eod`].
    pub append_eod: Option<u32>,
    /// Whether the tokenizer's post-processor adds its special tokens (e.g. a BOS) to every
    /// sentence. Default false, as in current Megatron: `megatron.core.tokenizers`'
    /// `HuggingFaceTokenizer.text_to_ids` adds none unless `--tokenizer-hf-include-special-tokens`
    /// is given (the older `_HuggingFaceTokenizer` called `tokenizer(text).input_ids`, which adds
    /// them: set true to reproduce it).
    pub add_special_tokens: bool,
    /// Tokenizing threads (at least 1).
    pub workers: usize,
    /// Makes a bad record fatal instead of skipped: invalid UTF-8 (any input), and for JSONL
    /// invalid JSON, a non-object line, a missing key, or a value that is not a string or a list
    /// of strings. A line bad for one key is skipped for all keys, keeping outputs aligned.
    pub strict: bool,
    /// Token dtype; `None` picks Megatron's `DType.optimal_dtype(vocab_size)`.
    pub dtype: Option<TokenDtype>,
    /// Set to true from another thread (e.g. on Ctrl-C) to stop with
    /// [`PreprocessError::Cancelled`]; nothing is left under the output names.
    pub cancel: Option<Arc<AtomicBool>>,
}

impl PreprocessConfig {
    /// Key `text`, no EOD, no special tokens, one worker, lenient, automatic format and dtype.
    pub fn new(inputs: Vec<PathBuf>, output_prefix: impl Into<PathBuf>) -> Self {
        PreprocessConfig {
            inputs,
            output_prefix: output_prefix.into(),
            json_keys: vec!["text".into()],
            format: None,
            text_mode: TextMode::Lines,
            append_eod: None,
            add_special_tokens: false,
            workers: 1,
            strict: false,
            dtype: None,
            cancel: None,
        }
    }
}

/// `{prefix}_{key}_document`: the dataset prefix of one key, as `preprocess_data.py` names it.
pub fn output_prefix_for(prefix: &Path, key: &str) -> PathBuf {
    let mut s = prefix.as_os_str().to_owned();
    s.push(format!("_{key}_document"));
    s.into()
}

/// Why a record was skipped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SkipReason {
    /// The record's bytes are not UTF-8.
    InvalidUtf8,
    /// The line does not parse as JSON (serde_json's message).
    InvalidJson(String),
    /// The line is JSON but not an object (the JSON type found).
    NotObject(&'static str),
    /// A configured key is absent.
    MissingKey(String),
    /// A key's value is neither a string nor a list of strings.
    NotText { key: String, found: &'static str },
}

impl std::fmt::Display for SkipReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SkipReason::InvalidUtf8 => write!(f, "not valid UTF-8"),
            SkipReason::InvalidJson(e) => write!(f, "invalid JSON: {e}"),
            SkipReason::NotObject(t) => write!(f, "expected a JSON object, found {t}"),
            SkipReason::MissingKey(k) => write!(f, "missing key {k:?}"),
            SkipReason::NotText { key, found } => {
                write!(
                    f,
                    "key {key:?} holds {found}, expected a string or a list of strings"
                )
            }
        }
    }
}

/// A skipped record, for the report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SkippedLine {
    pub path: PathBuf,
    /// 1-based line number (first line of a text block).
    pub line: u64,
    pub reason: SkipReason,
}

/// Running totals passed to the progress callback after every batch written.
#[derive(Clone, Debug, Default)]
pub struct Progress {
    /// Documents written (per key: every key gets each document).
    pub documents: u64,
    /// Tokens written, all keys together.
    pub tokens: u64,
    /// Decompressed input bytes consumed (what MB/s is measured on).
    pub bytes: u64,
    /// Raw input-file bytes consumed (compressed bytes for zstd), comparable to
    /// `input_bytes_total`.
    pub input_bytes: u64,
    /// Sum of the input files' sizes, for a progress bar.
    pub input_bytes_total: u64,
    /// Records skipped so far.
    pub skipped: u64,
    pub elapsed: Duration,
}

/// One output dataset of a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutputDataset {
    pub key: String,
    /// Dataset prefix (`.bin`/`.idx` appended).
    pub prefix: PathBuf,
    pub documents: usize,
    pub sequences: usize,
    pub tokens: u64,
}

/// The first bad records kept in a report.
pub const MAX_SKIP_EXAMPLES: usize = 10;

/// What a finished run did.
#[derive(Clone, Debug)]
pub struct PreprocessReport {
    pub outputs: Vec<OutputDataset>,
    pub dtype: TokenDtype,
    pub eod: Option<u32>,
    /// Records that became documents (each key got one document per record).
    pub documents: u64,
    /// Empty documents written, summed over keys (empty text: Megatron keeps such a document,
    /// with zero sequences).
    pub empty_documents: u64,
    /// Tokens written, all keys together.
    pub tokens: u64,
    /// Decompressed bytes read.
    pub bytes_read: u64,
    /// Raw input-file bytes read.
    pub input_bytes: u64,
    /// Blank lines skipped (not counted as bad).
    pub blank_lines: u64,
    /// Bad records skipped.
    pub skipped: u64,
    /// The first [`MAX_SKIP_EXAMPLES`] skipped records.
    pub skipped_examples: Vec<SkippedLine>,
    pub elapsed: Duration,
}

/// Errors of a preprocessing run; each names the file (and line) concerned. When one is
/// returned, no file exists under the output names (temporary files are removed).
#[derive(Debug, thiserror::Error)]
pub enum PreprocessError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Invalid settings (no inputs, no keys, several keys with a text input, ...).
    #[error("{0}")]
    Config(String),
    /// A bad record in strict mode.
    #[error("{path}:{line}: {reason}")]
    BadLine {
        path: PathBuf,
        line: u64,
        reason: SkipReason,
    },
    /// The tokenizer failed on a record.
    #[error("{path}:{line}: tokenizer: {message}")]
    Tokenize {
        path: PathBuf,
        line: u64,
        message: String,
    },
    /// Resolving the EOD token failed.
    #[error("{path}: {detail}")]
    Eod { path: PathBuf, detail: String },
    /// Writing an output dataset failed (or a token did not fit its dtype).
    #[error(transparent)]
    Build(#[from] BuilderError),
    /// [`PreprocessConfig::cancel`] was set.
    #[error("cancelled")]
    Cancelled,
}
