//! The preprocessed SFT form (Pai's idxmap SFT dataset, `MP_DATASET_TYPE=mmap`), written like
//! `toolkits/sft_data_preprocessing/build_idxmap_sft_dataset.py` and read like
//! `get_batch_on_this_tp_rank_idxmap_sft` in `megatron_patch/data/utils.py`.
//!
//! # Layout
//! One Megatron indexed dataset `OUTPUT_PREFIX_text_document.{bin,idx}` (byte-compatible with
//! Megatron-Core's `IndexedDataset`). Every training sequence of `s` positions is one document
//! holding one sequence of `2 s` **int32** values:
//! - `[0, s)`: the input tokens, except that the last token of each packed sample is stored as
//!   `-1 - id` (Pai's sample-end marker, from which position ids and attention boundaries are
//!   rebuilt); positions after the last marker are padding;
//! - `[s, 2 s)`: the shifted labels, `-100` where masked (so `loss_mask = labels != -100`).
//!
//! Pai picks the token dtype with `DType.optimal_dtype(vocab_size)`, which cannot hold `-100`
//! or the markers below 65,500 entries; we always write int32 (the dtype code is in the header,
//! so Megatron's reader still opens the files). `s` is not stored: it is half of every
//! sequence's length, and all sequences must agree.

use std::path::{Path, PathBuf};

use super::encode::SftEncoder;
use super::pack::build_sequence;
use super::pipeline::for_each_group;
use super::{IGNORE_INDEX, SftError, SftOptions, SftReport, SftSample};
use crate::indexed::{IndexedDataset, IndexedDatasetBuilder, TokenDtype};

/// `OUTPUT_PREFIX_text_document`: the dataset prefix [`write_idxmap`] writes (pass it to
/// [`IdxmapSftDataset::open`], as Megatron's `--data-path` takes it).
pub fn idxmap_prefix(output_prefix: &Path) -> PathBuf {
    let mut p = output_prefix.as_os_str().to_owned();
    p.push("_text_document");
    p.into()
}

/// Encodes `files` exactly as [`RawSftDataset::load`](super::RawSftDataset::load) does and
/// writes the sequences to `idxmap_prefix(output_prefix)` `.bin/.idx` (temp names renamed at the
/// end: a failed run leaves no dataset under the final name). Returns the counts.
///
/// Errors: those of `RawSftDataset::load`, and I/O errors writing the dataset.
pub fn write_idxmap(
    files: &[&Path],
    encoder: &SftEncoder,
    opts: &SftOptions,
    output_prefix: &Path,
) -> Result<SftReport, SftError> {
    let prefix = idxmap_prefix(output_prefix);
    let mut builder = IndexedDatasetBuilder::create(&prefix, TokenDtype::I32)?;
    let s = opts.max_padding_length;
    let pad_id = opts.pad_id.unwrap_or_else(|| encoder.default_pad_id());
    let mut report = SftReport::default();
    let mut values = Vec::with_capacity(2 * s);
    for_each_group(files, encoder, opts, &mut report, &mut |group| {
        encode_sequence(&build_sequence(&group, s, pad_id), group.len(), &mut values);
        builder.add_document(&values, &[values.len()])?;
        Ok(())
    })?;
    builder.finalize()?;
    Ok(report)
}

/// The `2 s` stored values of `sample` (layout in the module docs) into `out` (cleared first);
/// `num_samples` is the number of packed samples (positions with a larger `sample_ids` entry are
/// padding).
fn encode_sequence(sample: &SftSample, num_samples: usize, out: &mut Vec<i32>) {
    out.clear();
    let s = sample.len();
    for i in 0..s {
        let id = sample.sample_ids[i];
        let t = sample.tokens[i] as i32;
        let is_pad = id as usize >= num_samples;
        let last_of_sample = i + 1 == s || sample.sample_ids[i + 1] != id;
        out.push(if last_of_sample && !is_pad { -1 - t } else { t });
    }
    out.extend_from_slice(&sample.labels);
}

/// Rebuilds an [`SftSample`] from its `2 s` stored values; errors describe the broken rule.
pub fn decode_sequence(values: &[i32]) -> Result<SftSample, String> {
    if values.is_empty() || !values.len().is_multiple_of(2) {
        return Err(format!(
            "length {} is not a positive even number",
            values.len()
        ));
    }
    let s = values.len() / 2;
    let (stored, labels) = values.split_at(s);
    let Some(last_marker) = stored.iter().rposition(|&v| v < 0) else {
        return Err("no sample-end marker (negative token): the sequence holds no sample".into());
    };
    let mut out = SftSample {
        tokens: Vec::with_capacity(s),
        labels: labels.to_vec(),
        loss_mask: Vec::with_capacity(s),
        position_ids: Vec::with_capacity(s),
        sample_ids: Vec::with_capacity(s),
    };
    let (mut sample, mut pos) = (0u32, 0u32);
    for (i, &v) in stored.iter().enumerate() {
        out.tokens
            .push(if v < 0 { (-1 - v) as u32 } else { v as u32 });
        out.position_ids.push(pos);
        out.sample_ids.push(sample);
        pos += 1;
        if v < 0 || i == last_marker {
            sample += 1;
            pos = 0;
        }
    }
    for (i, &l) in labels.iter().enumerate() {
        let next_same = i + 1 < s && out.sample_ids[i + 1] == out.sample_ids[i] && i < last_marker;
        let ok = l == IGNORE_INDEX || (next_same && l >= 0 && l as u32 == out.tokens[i + 1]);
        if !ok {
            return Err(format!(
                "label {l} at position {i} is neither -100 nor the next token of its sample"
            ));
        }
        out.loss_mask
            .push(if l == IGNORE_INDEX { 0.0 } else { 1.0 });
    }
    Ok(out)
}

/// A memory-mapped preprocessed SFT dataset (see the module docs for the layout).
pub struct IdxmapSftDataset {
    data: IndexedDataset,
    prefix: PathBuf,
    seq_length: usize,
}

impl IdxmapSftDataset {
    /// Opens `PREFIX.bin/.idx` (`PREFIX` as returned by [`idxmap_prefix`]).
    ///
    /// Errors: missing/corrupt files, a dtype other than int32, sequences of odd or differing
    /// lengths.
    pub fn open(prefix: &Path) -> Result<IdxmapSftDataset, SftError> {
        let data = IndexedDataset::open(prefix)?;
        let corrupt = |sequence, message: String| SftError::Corrupt {
            path: prefix.into(),
            sequence,
            message,
        };
        if data.dtype() != TokenDtype::I32 {
            let msg = format!(
                "dtype {} (an SFT idxmap dataset is int32)",
                data.dtype().name()
            );
            return Err(corrupt(0, msg));
        }
        let lengths = data.sequence_lengths();
        let first = lengths.first().copied().unwrap_or(2) as usize;
        if first == 0 || !first.is_multiple_of(2) {
            return Err(corrupt(
                0,
                format!("length {first} is not a positive even number"),
            ));
        }
        if let Some(i) = lengths.iter().position(|&l| l as usize != first) {
            let msg = format!("length {} differs from sequence 0's {first}", lengths[i]);
            return Err(corrupt(i, msg));
        }
        Ok(IdxmapSftDataset {
            data,
            prefix: prefix.into(),
            seq_length: first / 2,
        })
    }

    /// Number of sequences.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// True when there are no sequences.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The dataset prefix it was opened with.
    pub fn prefix(&self) -> &Path {
        &self.prefix
    }

    /// Sequence length `s` (half the stored length).
    pub fn seq_length(&self) -> usize {
        self.seq_length
    }

    /// Sequence `i` (`[s]` vectors). Errors: `i >= len()`, or a sequence that breaks the layout.
    pub fn get(&self, i: usize) -> Result<SftSample, SftError> {
        if i >= self.len() {
            return Err(SftError::OutOfRange {
                index: i,
                len: self.len(),
            });
        }
        let mut raw = Vec::with_capacity(2 * self.seq_length);
        self.data.read_into(i, 0, 2 * self.seq_length, &mut raw)?;
        let values: Vec<i32> = raw.into_iter().map(|v| v as i32).collect();
        decode_sequence(&values).map_err(|message| SftError::Corrupt {
            path: self.prefix.clone(),
            sequence: i,
            message,
        })
    }
}
