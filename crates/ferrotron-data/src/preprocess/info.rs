//! Summaries of an indexed dataset, for `ferrotron dataset-info`.

use crate::indexed::{IndexedDataset, IndexedDatasetError, TokenDtype, data_paths};
use std::path::{Path, PathBuf};

/// Minimum, mean and maximum of a set of lengths in tokens (all zero when the set is empty).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LengthStats {
    pub min: u64,
    pub mean: f64,
    pub max: u64,
}

impl LengthStats {
    fn of(lengths: impl Iterator<Item = u64>) -> LengthStats {
        let (mut min, mut max, mut sum, mut n) = (u64::MAX, 0, 0u128, 0u64);
        for l in lengths {
            min = min.min(l);
            max = max.max(l);
            sum += l as u128;
            n += 1;
        }
        if n == 0 {
            return LengthStats::default();
        }
        LengthStats {
            min,
            mean: sum as f64 / n as f64,
            max,
        }
    }
}

/// What `dataset-info` prints about a `.bin/.idx` pair.
#[derive(Clone, Debug, PartialEq)]
pub struct DatasetInfo {
    pub prefix: PathBuf,
    pub dtype: TokenDtype,
    pub sequences: usize,
    pub documents: usize,
    /// Documents with no tokens.
    pub empty_documents: usize,
    pub tokens: u64,
    /// File sizes in bytes.
    pub bin_bytes: u64,
    pub idx_bytes: u64,
    /// Tokens per sequence.
    pub sequence_length: LengthStats,
    /// Tokens per document (all its sequences).
    pub document_length: LengthStats,
}

/// Opens the dataset at `prefix` (validating it like [`IndexedDataset::open`]) and summarizes
/// it.
///
/// Errors: those of [`IndexedDataset::open`] (missing, truncated or corrupt files).
pub fn dataset_info(prefix: &Path) -> Result<DatasetInfo, IndexedDatasetError> {
    let ds = IndexedDataset::open(prefix)?;
    let (bin, idx) = data_paths(prefix);
    let size = |p: &Path| {
        std::fs::metadata(p)
            .map(|m| m.len())
            .map_err(|source| IndexedDatasetError::Io {
                path: p.to_path_buf(),
                source,
            })
    };
    let lens = ds.sequence_lengths();
    let doc_len = |w: &[u64]| {
        lens[w[0] as usize..w[1] as usize]
            .iter()
            .map(|&l| l as u64)
            .sum::<u64>()
    };
    let docs = ds.document_indices();
    Ok(DatasetInfo {
        prefix: prefix.to_path_buf(),
        dtype: ds.dtype(),
        sequences: ds.len(),
        documents: ds.num_documents(),
        empty_documents: docs.windows(2).filter(|w| doc_len(w) == 0).count(),
        tokens: ds.num_tokens(),
        bin_bytes: size(&bin)?,
        idx_bytes: size(&idx)?,
        sequence_length: LengthStats::of(lens.iter().map(|&l| l as u64)),
        document_length: LengthStats::of(docs.windows(2).map(doc_len)),
    })
}

/// All tokens of document `doc` (its sequences concatenated), e.g. to decode and show it;
/// `None` when `doc` is not below the document count.
pub fn document_tokens(ds: &IndexedDataset, doc: usize) -> Option<Vec<u32>> {
    let docs = ds.document_indices();
    let (&first, &end) = (docs.get(doc)?, docs.get(doc + 1)?);
    let mut out = Vec::new();
    for i in first as usize..end as usize {
        let len = ds.sequence_lengths()[i] as usize;
        // Cannot fail: open() checked that every sequence lies inside .bin.
        ds.read_into(i, 0, len, &mut out).ok()?;
    }
    Some(out)
}
