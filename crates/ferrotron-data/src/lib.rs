//! Data for training and inference. Today: the [`Tokenizer`] wrapper over HF `tokenizer.json`
//! (the `tokenizers` crate). Indexed datasets, GPT/SFT datasets and loaders come with the data
//! pipeline issue.

mod tokenizer;

pub use tokenizer::{StreamDecoder, Tokenizer, TokenizerError};
