//! Transformer layers as explicit forward functions over f32 activations, each designed so its
//! backward (a later issue) sits beside it: every forward states what it would save.
//!
//! Activations follow Megatron's `[s, b, h]` order, flattened to rows `s·b`. Parameters are
//! [`ferrotron_tensor::Tensor`]s in HF orientation (`[out, in]` for linear weights) in any
//! storage dtype; compute is f32.

pub mod attention;
mod embedding;
mod error;
mod linear;
mod mlp;
mod norm;
pub mod tensor_parallel;

pub use attention::{AttentionMask, core_attention};
pub use embedding::Embedding;
pub use error::NnError;
pub use linear::Linear;
pub use mlp::SwiGluMlp;
pub use norm::RmsNorm;
pub use tensor_parallel::TensorParallel;

/// Result alias for layer construction and forward passes.
pub type Result<T> = std::result::Result<T, NnError>;
