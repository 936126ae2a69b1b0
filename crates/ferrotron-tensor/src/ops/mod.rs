//! Fused, rayon-parallel CPU kernels for the transformer's non-GEMM work. Every kernel works on
//! row-major f32 slices; shapes are given in each function's docs.

mod activation;
mod elementwise;
mod embedding;
mod norm;
mod reduce;
mod rope;
mod softmax;

pub use activation::{swiglu, swiglu_packed};
pub use elementwise::{add_bias, add_inplace};
pub use embedding::embedding_lookup;
pub use norm::rms_norm;
pub use reduce::{argmax, top_k};
pub use rope::{RopeScaling, RopeTable};
pub use softmax::softmax_rows;
