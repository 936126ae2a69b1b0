//! Inference on a [`ferrotron_model::GptModel`]: token sampling with HF semantics
//! ([`sampler`]), the KV-cached generation loop ([`generate()`]) and
//! per-token scoring ([`score()`]), perplexity in windows as llama.cpp measures it
//! ([`perplexity()`]), and the serving [`engine`] (continuous batching over a paged KV cache
//! with prefix caching, speculative decoding).

pub mod engine;
pub mod generate;
pub mod perplexity;
pub mod sampler;
pub mod score;

pub use generate::{GenerateOptions, Generation, StopReason, generate};
pub use perplexity::{Perplexity, PerplexityOptions, perplexity};
pub use score::{Score, score};
