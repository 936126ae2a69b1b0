//! Data for training and inference. Today: the [`Tokenizer`] wrapper over HF `tokenizer.json`
//! (the `tokenizers` crate) and HF chat templates ([`chat`]). Indexed datasets, GPT/SFT datasets and loaders come with the data
//! pipeline issue.

pub mod blended;
pub mod chat;
pub mod gpt_dataset;
pub mod indexed;
pub mod preprocess;
pub mod loader;
pub mod sft;
mod tokenizer;

pub use blended::{Blend, BlendedDataset, BuiltDataset, build_gpt_datasets, parse_blend};
pub use gpt_dataset::{DatasetError, GptDataset, GptDatasetConfig, GptSample, Split};
pub use loader::{DataLoader, Dataset, LoaderConfig, MicroBatch, PretrainingSampler};
pub use tokenizer::{StreamDecoder, Tokenizer, TokenizerError};
