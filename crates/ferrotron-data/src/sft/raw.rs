//! The raw SFT form (Pai's `MP_DATASET_TYPE=raw`, `json_sft.py`): JSON/JSONL files encoded in
//! memory at load time, for quick runs and small sets.

use std::path::{Path, PathBuf};

use super::encode::{EncodedSample, SftEncoder};
use super::pack::build_sequence;
use super::pipeline::for_each_group;
use super::{SftError, SftOptions, SftReport, SftSample};

/// SFT sequences encoded from JSON/JSONL files and held in memory (the encoded samples are kept
/// and laid out into an [`SftSample`] on each `get`).
#[derive(Debug, Clone)]
pub struct RawSftDataset {
    groups: Vec<Vec<EncodedSample>>,
    seq_length: usize,
    pad_id: u32,
    report: SftReport,
    files: Vec<PathBuf>,
    options: SftOptions,
}

impl RawSftDataset {
    /// Reads, encodes and pads/packs `files` in order.
    ///
    /// Errors: unreadable files, invalid options, and in strict mode the first bad record
    /// (`file:line: reason`); otherwise bad records are skipped and counted in
    /// [`report`](Self::report).
    pub fn load(
        files: &[&Path],
        encoder: &SftEncoder,
        opts: &SftOptions,
    ) -> Result<RawSftDataset, SftError> {
        let mut report = SftReport::default();
        let mut groups = Vec::new();
        for_each_group(files, encoder, opts, &mut report, &mut |g| {
            groups.push(g);
            Ok(())
        })?;
        Ok(RawSftDataset {
            groups,
            seq_length: opts.max_padding_length,
            pad_id: opts.pad_id.unwrap_or_else(|| encoder.default_pad_id()),
            report,
            files: files.iter().map(|p| p.to_path_buf()).collect(),
            options: opts.clone(),
        })
    }

    /// Number of sequences.
    pub fn len(&self) -> usize {
        self.groups.len()
    }

    /// True when no sequence was produced.
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// Sequence length `s` of every sample.
    pub fn seq_length(&self) -> usize {
        self.seq_length
    }

    /// Padding token id.
    pub fn pad_id(&self) -> u32 {
        self.pad_id
    }

    /// The files it was loaded from.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// The options it was loaded with.
    pub fn options(&self) -> &SftOptions {
        &self.options
    }

    /// Counts from loading (bad records, truncations, drops, tokens).
    pub fn report(&self) -> &SftReport {
        &self.report
    }

    /// The encoded samples packed into sequence `i`.
    pub fn group(&self, i: usize) -> Option<&[EncodedSample]> {
        self.groups.get(i).map(Vec::as_slice)
    }

    /// Sequence `i` (`[s]` vectors). Errors only when `i >= len()`.
    pub fn get(&self, i: usize) -> Result<SftSample, SftError> {
        let group = self.groups.get(i).ok_or(SftError::OutOfRange {
            index: i,
            len: self.groups.len(),
        })?;
        Ok(build_sequence(group, self.seq_length, self.pad_id))
    }
}
