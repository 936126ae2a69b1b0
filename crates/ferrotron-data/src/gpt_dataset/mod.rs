//! Megatron-Core's GPT pretraining dataset (`megatron/core/datasets/gpt_dataset.py`, with
//! `helpers.cpp: build_sample_idx`, the split logic of `blended_megatron_dataset_config.py` /
//! `blended_megatron_dataset_builder.py`, and the cache layout of both).
//!
//! A [`GptDataset`] turns one split of an [`IndexedDataset`](crate::indexed::IndexedDataset)
//! into fixed-length samples of `seq_length + 1` tokens (`+ 0` without
//! `add_extra_token_to_sequence`) cut from the concatenation of its documents:
//!
//! 1. **split**: the split string (`"969,30,1"`) is normalized ([`parse_and_normalize_split`])
//!    into bookends; the split's documents are the sequence range
//!    `round(start * n)..round(end * n)` of the `n` sequences (Megatron splits GPT data by
//!    sequence, which is one document per sequence for data made without `--split-sentences`).
//! 2. **epochs**: the fewest epochs whose tokens cover `num_samples * seq_length + 1`
//!    ([`plan_epochs`]); `num_samples = None` means one epoch.
//! 3. **document index** `[epochs * documents]`: the documents repeated per epoch and shuffled by
//!    NumPy's `RandomState(seed)`; when the final epoch contributes fewer than 80% of an epoch's
//!    samples it is shuffled separately (so the partial last epoch is a uniform subset).
//! 4. **sample index** `[samples + 1, 2]`: (position in the document index, token offset) where
//!    each sample starts; consecutive samples share one boundary token (the label of the last
//!    position is the first input token of the next sample).
//! 5. **shuffle index** `[samples]`: a permutation of the samples (two independent permutations,
//!    before and within the final epoch, when it is separate).
//!
//! Indices are cached under `path_to_cache` (see [`cache`]) keyed by a hash of every input that
//! shapes them, and rebuilt when the cache is missing, stale or corrupt.
//!
//! # What matches Megatron exactly
//! The document, sample and shuffle indices are identical to Megatron-Core 0.16.1's, element for
//! element: [`numpy_rng::RandomState`] reimplements NumPy's legacy MT19937 `RandomState` and its
//! `shuffle` (masked-rejection `random_interval`), and the index builders are line-by-line ports.
//! `tests/gpt_dataset_parity.rs` checks this against indices and samples produced by
//! megatron-core itself on tiny datasets written by its own `IndexedDatasetBuilder`
//! (`tools/make_gpt_index_fixture.py` -> `fixtures/gpt_dataset/`), including a separately
//! shuffled final epoch, several seeds, `add_extra_token_to_sequence = false`, a kept partial
//! validation sample, EOD masks/resets and NumPy shuffles of up to 70,000 elements. Samples
//! (tokens, labels, loss mask, position ids, attention blocks) match `GPTDataset.__getitem__`.
//!
//! # Differences from Megatron
//! * The attention mask is returned as per-position segment ids ([`GptSample::segment_ids`]),
//!   not a `[1, s, s]` boolean tensor; the two are equivalent.
//! * Cache: files are keyed by SHA-256 of our own description JSON (Megatron: MD5 of its
//!   `unique_description`), so the two never share cache files; the description also records the
//!   dataset's sequence count, token count and a hash of its sequence lengths, so a changed
//!   dataset under the same path invalidates the cache (Megatron keys on the path only). Array
//!   files carry checksums; corrupt ones are rebuilt rather than loaded. There is no default
//!   cache folder next to the data: `path_to_cache = None` builds in memory.
//! * Padding uses Megatron's no-pad-token behaviour (pad id -1, mapped to token/label 0 with loss
//!   mask 0); a tokenizer pad id is not looked up, so real tokens equal to it are never masked.
//! * Stricter validation: bad split strings (`"1,x"`, negative, all-zero), an empty split, or
//!   samples requested from a split without tokens are errors (Megatron silently reinterprets
//!   the string, or asserts / loops forever). The index types are `u32` (Megatron switches to
//!   int64 past 2^31 entries): larger indices are reported as errors.
//! * In the corner case of a kept partial validation sample ending on an empty last document,
//!   Megatron stores offset -1; we store 0 (the sample's tokens are the same).
//! * Only the `blend` (single distribution + split string) path of the builder is ported; not
//!   `blend_per_split`, mock datasets, S3/object storage, `fast_cache_load`, multimodal data.

mod builder;
pub mod cache;
mod config;
mod dataset;
mod error;
pub mod indices;
pub mod numpy_rng;
mod sample;

pub use builder::{BuiltDataset, build_gpt_datasets};
pub use cache::CacheStatus;
pub use config::{
    DEFAULT_SPLIT, GptDatasetConfig, Split, parse_and_normalize_split, split_matrix, split_range,
};
pub use dataset::GptDataset;
pub use error::DatasetError;
pub use indices::{EpochPlan, plan_epochs};
pub use sample::GptSample;
