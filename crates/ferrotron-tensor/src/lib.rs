//! Ferrotron's lean tensor core: a contiguous CPU `Tensor` (f32 / bf16 / f16 storage),
//! GEMM through the `gemm` crate (AVX-512 `x86-v4` kernels, runtime-dispatched),
//! memory-bound GEMV kernels for decode, and the fused rayon kernels the transformer needs.
//!
//! Compute is always f32 (design.md: on this CPU the bf16 dot-product peak is half the f32
//! FMA peak); bf16/f16 are storage formats that halve memory traffic.

mod buffer;
mod dtype;
mod error;
pub mod gemm;
pub mod gemm_bf16;
pub mod gemv;
pub mod ops;
pub mod peak;
mod tensor;

pub use buffer::Buffer;
pub use dtype::{DType, Element, round_to_bf16_bits};
pub use error::TensorError;
pub use tensor::{Device, Storage, Tensor, convert_slice};

/// Result alias for tensor operations.
pub type Result<T> = std::result::Result<T, TensorError>;
