//! Data for training and inference. Today: the [`Tokenizer`] wrapper over HF `tokenizer.json`
//! (the `tokenizers` crate) and HF chat templates ([`chat`]). Indexed datasets, GPT/SFT datasets and loaders come with the data
//! pipeline issue.

pub mod chat;
pub mod indexed;
mod tokenizer;

pub use tokenizer::{StreamDecoder, Tokenizer, TokenizerError};
