//! Supervised fine-tuning (SFT) datasets, after Pai-Megatron-Patch's
//! `megatron_patch/data/json_sft.py` (`JSONSFTDataset`, `MP_DATASET_TYPE=raw`),
//! `toolkits/sft_data_preprocessing/build_idxmap_sft_dataset.py` (the idxmap SFT form,
//! `MP_DATASET_TYPE=mmap`) and `megatron_patch/data/utils.py`
//! (`get_batch_on_this_tp_rank_original` / `_idxmap_sft`, which shift and mask the labels).
//!
//! # Inputs ([`source`])
//! JSON (one array of records) or JSONL (one record per line) files, each in one of two formats,
//! detected per file from its first record unless [`SftFormat`] forces one:
//! - **alpaca**: `{"instruction", "input" (optional), "output"}` (Pai's aliases `query` for
//!   `instruction` and `response` for `output` are accepted);
//! - **chat**: `{"messages": [{"role", "content"}, ...]}` with at least one `assistant` turn.
//!
//! Bad records (invalid JSON, missing or non-string fields, templates that fail) are skipped and
//! counted with `file:line` in the [`SftReport`]; [`SftOptions::strict`] makes the first one fatal.
//!
//! # Rendering and loss mask ([`encode`])
//! Chat records go through the tokenizer's chat template. Alpaca records become
//! `[user: instruction (+ "\n\n" + input when non-empty), assistant: output]` through the
//! chat template when the tokenizer has one, else the plain Stanford-alpaca prompt
//! ([`ALPACA_PROMPT_INPUT`], [`ALPACA_PROMPT_NO_INPUT`]) followed by `output` and the EOS token.
//! Loss is on assistant answers only: every assistant turn's content and the end-of-turn token
//! that closes it (e.g. `<|im_end|>`) are trained; system/user turns, the generation prompt
//! (`<|im_start|>assistant\n`), template glue after the end token (ChatML's `\n`) and padding
//! are masked. See [`encode`] for how spans are found and verified.
//!
//! # Sequences ([`pack`])
//! Every [`SftSample`] is `max_padding_length` (= `seq_length`, `s`) positions long: one encoded
//! sample padded, or several packed back to back (greedy, in input order) and padded, with
//! `position_ids` restarting at 0 and `sample_ids` counting up per packed sample. Overlong samples
//! are truncated (head kept, answer tail cut, as Pai does) or dropped ([`Overlong`]).
//!
//! # Stored forms
//! [`RawSftDataset`] encodes files in memory (quick runs); [`IdxmapSftDataset`] memory-maps the
//! preprocessed Megatron `.bin/.idx` form written by [`write_idxmap`] (large sets; layout in
//! [`idxmap`]). Both give identical [`SftSample`]s through `len()` / `get(i)`, and implement the
//! loader's [`Dataset`](crate::loader::Dataset) (samples converted to
//! [`GptSample`](crate::gpt_dataset::GptSample): masked labels 0, `segment_ids = sample_ids`).

mod dataset;
pub mod encode;
pub mod idxmap;
pub mod pack;
mod pipeline;
mod raw;
mod record;
pub mod source;
mod spans;

use std::path::PathBuf;

pub use encode::{
    ALPACA_PROMPT_INPUT, ALPACA_PROMPT_NO_INPUT, EncodedSample, SftEncoder, SpecialTokens,
};
pub use idxmap::{IdxmapSftDataset, idxmap_prefix, write_idxmap};
pub use pack::{Overlong, Packer, build_sequence};
pub use raw::RawSftDataset;
pub use source::{Conversation, Record, SftFormat};

use crate::TokenizerError;
use crate::chat::ChatError;
use crate::indexed::{BuilderError, IndexedDatasetError};

/// Label value of positions that carry no loss (PyTorch's `ignore_index`, Megatron's `-100`).
pub const IGNORE_INDEX: i32 = -100;

/// One training sequence of `s` positions (`s` = `max_padding_length`). All vectors are `[s]`.
///
/// `labels` are already shifted: `labels[i]` is the token the model must predict after reading
/// `tokens[..=i]` (that is `tokens[i + 1]` of the same packed sample when it is an answer token),
/// else [`IGNORE_INDEX`]. `loss_mask[i]` is `1.0` exactly where `labels[i] != IGNORE_INDEX`.
#[derive(Debug, Clone, PartialEq)]
pub struct SftSample {
    /// Input token ids `[s]`; padding positions hold the pad id.
    pub tokens: Vec<u32>,
    /// Shifted targets `[s]`, [`IGNORE_INDEX`] where masked.
    pub labels: Vec<i32>,
    /// `[s]`, 1.0 on answer targets, 0.0 on prompt, sample ends and padding.
    pub loss_mask: Vec<f32>,
    /// `[s]`, position within the packed sample (restarts at 0 per sample and for padding).
    pub position_ids: Vec<u32>,
    /// `[s]`, index of the packed sample each position belongs to (0, 1, ...); trailing padding
    /// is a segment of its own with id = number of real samples. Attention must not cross ids.
    pub sample_ids: Vec<u32>,
}

impl SftSample {
    /// Sequence length `s`.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// True for a zero-length sequence (never produced by this module).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Segment boundaries like flash-attention's `cu_seqlens`: `[0, end_0, end_1, ..., s]`, one
    /// segment per packed sample plus one for trailing padding if any.
    pub fn cu_seqlens(&self) -> Vec<usize> {
        let mut cu = vec![0];
        for i in 1..self.sample_ids.len() {
            if self.sample_ids[i] != self.sample_ids[i - 1] {
                cu.push(i);
            }
        }
        if !self.sample_ids.is_empty() {
            cu.push(self.sample_ids.len());
        }
        cu
    }
}

/// Which stored form to read, Pai's `MP_DATASET_TYPE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SftDatasetType {
    /// JSON/JSONL encoded at load time ([`RawSftDataset`]).
    Raw,
    /// Preprocessed `.bin/.idx` ([`IdxmapSftDataset`]).
    Mmap,
}

impl std::str::FromStr for SftDatasetType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "raw" => Ok(SftDatasetType::Raw),
            "mmap" | "idxmap" => Ok(SftDatasetType::Mmap),
            _ => Err(format!("unknown SFT dataset type {s:?} (raw or mmap)")),
        }
    }
}

/// How SFT files become sequences (shared by the raw and the preprocessed forms).
#[derive(Debug, Clone, PartialEq)]
pub struct SftOptions {
    /// Sequence length `s` of every [`SftSample`] (Pai's `--max-padding-length` /
    /// `--seq-length`), in tokens; must be at least 2.
    pub max_padding_length: usize,
    /// Padding token id; `None` uses [`SftEncoder::default_pad_id`] (pad token, else EOS).
    pub pad_id: Option<u32>,
    /// Input format; [`SftFormat::Auto`] detects it per file.
    pub format: SftFormat,
    /// Pack several samples per sequence instead of one sample per sequence.
    pub pack: bool,
    /// What to do with samples longer than `max_padding_length`.
    pub overlong: Overlong,
    /// Make the first bad record an error instead of skipping it.
    pub strict: bool,
    /// Threads encoding records (rendering + tokenization); the output is the same for any
    /// count. 0 and 1 both mean the calling thread only.
    pub workers: usize,
}

impl SftOptions {
    /// Defaults: no packing, truncate, auto format, not strict, default pad id, 1 worker.
    pub fn new(max_padding_length: usize) -> Self {
        SftOptions {
            max_padding_length,
            pad_id: None,
            format: SftFormat::Auto,
            pack: false,
            overlong: Overlong::Truncate,
            strict: false,
            workers: 1,
        }
    }
}

/// Counts from reading, encoding and packing SFT files.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SftReport {
    /// Records read and encoded successfully.
    pub records: usize,
    /// Records skipped as bad (invalid JSON, bad fields, template or span failures).
    pub bad_records: usize,
    /// The first few bad records as `file:line: reason`.
    pub bad_examples: Vec<String>,
    /// Samples cut to `max_padding_length` ([`Overlong::Truncate`]).
    pub truncated: usize,
    /// Samples dropped for being longer than `max_padding_length` ([`Overlong::Drop`]).
    pub dropped_overlong: usize,
    /// Samples dropped because no answer token fits in `max_padding_length` (prompt too long).
    pub dropped_no_answer: usize,
    /// Samples placed into sequences.
    pub samples: usize,
    /// Sequences ([`SftSample`]s) produced.
    pub sequences: usize,
    /// Real (non-padding) tokens placed into sequences.
    pub tokens: usize,
    /// Positions with loss (`loss_mask == 1`).
    pub trained_tokens: usize,
}

/// How many bad records [`SftReport::bad_examples`] keeps.
pub const MAX_BAD_EXAMPLES: usize = 10;

/// Errors from SFT datasets; each names the file (and line or sample) involved.
#[derive(Debug, thiserror::Error)]
pub enum SftError {
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A bad record in strict mode (`line` is 1-based).
    #[error("{}:{line}: {message}", path.display())]
    BadRecord {
        path: PathBuf,
        line: usize,
        message: String,
    },
    /// Model directory problems (missing EOS for the alpaca template, unknown tokens, ...).
    #[error("{}: {message}", path.display())]
    Model { path: PathBuf, message: String },
    /// Invalid options (e.g. `max_padding_length < 2`).
    #[error("invalid SFT options: {0}")]
    Options(String),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Chat(#[from] ChatError),
    #[error(transparent)]
    Indexed(#[from] IndexedDatasetError),
    /// Writing the preprocessed dataset failed.
    #[error(transparent)]
    Build(#[from] BuilderError),
    /// A preprocessed sequence breaks the idxmap layout.
    #[error("{}: sequence {sequence}: {message}", path.display())]
    Corrupt {
        path: PathBuf,
        sequence: usize,
        message: String,
    },
    /// `get(i)` past the end.
    #[error("SFT sample {index} out of range (dataset has {len})")]
    OutOfRange { index: usize, len: usize },
}
