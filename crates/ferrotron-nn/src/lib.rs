//! Transformer layers as explicit forward functions over f32 activations; every forward
//! states what its backward needs, and the backward kernels sit beside their forwards
//! (`ferrotron_tensor::ops`, [`attention`], [`tensor_parallel`], [`context_parallel`]).
//!
//! Activations follow Megatron's `[s, b, h]` order, flattened to rows `s·b`. Layers are views
//! over borrowed parameters ([`ferrotron_tensor::Tensor`]s in HF orientation, `[out, in]` for
//! linear weights, in any storage dtype) that the model's parameter table owns; compute is f32.

pub mod attention;
pub mod context_parallel;
mod embedding;
mod error;
mod linear;
pub mod lora;
pub mod moe;
pub mod tensor_parallel;

pub use attention::{AttentionMask, core_attention};
pub use context_parallel::{ContextParallel, CpCommType};
pub use embedding::Embedding;
pub use error::NnError;
pub use linear::Linear;
pub use lora::{LoraAdapter, LoraDropout, TransposedLoraAdapter};
pub use tensor_parallel::TensorParallel;

/// Result alias for layer construction and forward passes.
pub type Result<T> = std::result::Result<T, NnError>;
