//! Ferrotron's lean tensor core: a contiguous CPU `Tensor` (f32 / bf16 / f16 storage),
//! GEMM through the `gemm` crate (AVX-512 `x86-v4` kernels, runtime-dispatched),
//! memory-bound GEMV kernels for decode, and the fused rayon kernels the transformer needs.
//!
//! Accumulation is always f32. bf16 weights multiply through bf16 × bf16 → f32 GEMM kernels
//! ([`gemm_bf16`]: AMX tiles, AVX512-BF16 `vdpbf16ps`, or the operands widened to f32 where
//! the CPU has neither), dispatched at run time by CPU feature; [`peak`] measures the
//! machine's own f32 and bf16 peaks. f16 is a storage format (widened to f32). [`allocator`]
//! keeps freed memory for reuse in long-running training and serving processes. [`quant`] holds
//! weights in ggml's block formats (GGUF Q8_0 ... Q6_K) with int8 dot kernels (AVX512-VNNI).

pub mod allocator;
mod buffer;
mod dtype;
mod error;
pub mod gemm;
pub mod gemm_bf16;
pub mod gemv;
pub mod ops;
pub mod pages;
pub mod peak;
pub mod quant;
mod storage;
mod tensor;

pub use buffer::Buffer;
pub use dtype::{DType, Element, round_to_bf16_bits};
pub use error::TensorError;
pub use storage::Storage;
pub use tensor::{Device, Tensor, TensorView, convert_slice};

/// Result alias for tensor operations.
pub type Result<T> = std::result::Result<T, TensorError>;
