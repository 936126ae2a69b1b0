//! Data for training and inference, Megatron-compatible: the [`Tokenizer`] wrapper over HF
//! `tokenizer.json`, HF chat templates ([`chat`]), Megatron `.bin/.idx` indexed datasets
//! ([`indexed`]) and corpus preprocessing ([`preprocess`]), pretraining datasets with
//! Megatron-exact indices ([`gpt_dataset`], [`blended`]), SFT datasets ([`sft`]), and the
//! prefetching data-parallel [`loader`].

pub mod blended;
pub mod chat;
pub mod dpo;
pub mod epochs;
pub mod gpt_dataset;
pub mod indexed;
pub mod loader;
pub mod preprocess;
pub mod sft;
mod tokenizer;

pub use blended::{Blend, BlendedDataset, BuiltDataset, build_gpt_datasets, parse_blend};
pub use epochs::{EpochDataset, build_epoch_splits};
pub use gpt_dataset::{DatasetError, GptDataset, GptDatasetConfig, GptSample, Split};
pub use loader::{DataLoader, Dataset, LoaderConfig, MicroBatch, PretrainingSampler};
pub use tokenizer::{StreamDecoder, Tokenizer, TokenizerError};
