//! Megatron-Core's memory-mapped indexed dataset: token sequences in `PREFIX.bin` and their index
//! in `PREFIX.idx`, byte-compatible with `megatron/core/datasets/indexed_dataset.py`
//! (`IndexedDataset` / the older `MMapIndexedDataset`).
//!
//! `.idx` layout (little-endian): magic `MMIDIDX\x00\x00` (9 bytes), version `u64 = 1`, dtype code
//! `u8`, `sequence_count u64`, `document_count u64` (documents + 1), then `sequence_lengths:
//! i32[sequence_count]`, `sequence_pointers: i64[sequence_count]` (byte offsets into `.bin`),
//! `document_indices: i64[document_count]` (sequence index where each document starts, first 0,
//! last `sequence_count`).

mod builder;
mod dtype;
mod merge;
mod reader;

pub use builder::{BuildSummary, BuilderError, FinishedDataset, IndexedDatasetBuilder};
pub use dtype::TokenDtype;
pub use merge::{dataset_prefixes_in_dir, merge_datasets};
pub use reader::{IndexedDataset, IndexedDatasetError};

/// The 9-byte magic at the start of every `.idx` file.
pub const INDEX_MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
/// The only `.idx` version Megatron writes.
pub const INDEX_VERSION: u64 = 1;

/// `PREFIX.bin` and `PREFIX.idx` for a dataset prefix.
pub fn data_paths(prefix: &std::path::Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let p = prefix.as_os_str().to_owned();
    let mut bin = p.clone();
    bin.push(".bin");
    let mut idx = p;
    idx.push(".idx");
    (bin.into(), idx.into())
}
