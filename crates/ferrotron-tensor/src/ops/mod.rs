//! Fused, rayon-parallel CPU kernels for the transformer's non-GEMM work, each forward with its
//! backward in the same file. Every kernel works on row-major f32 slices; shapes, and which
//! outputs are overwritten or accumulated, are given in each function's docs.

mod math;

mod activation;
mod cross_entropy;
mod elementwise;
mod embedding;
mod gelu;
mod layer_norm;
mod norm;
mod reduce;
mod rope;
mod softmax;
mod tile;
pub mod tile_bf16;

pub use activation::{
    ActivationFunc, activation, activation_backward, glu_packed, glu_packed_backward, swiglu,
    swiglu_backward, swiglu_packed, swiglu_packed_backward,
};
pub use cross_entropy::{
    IGNORE_INDEX, VocabShard, cross_entropy_backward, cross_entropy_backward_inplace,
    cross_entropy_forward, cross_entropy_fused_inplace,
};
pub use elementwise::{add_bias, add_bias_backward, add_inplace};
pub use embedding::{embedding_backward, embedding_lookup};
pub use layer_norm::{layer_norm, layer_norm_backward};
pub use math::{dot, exp_in_place_normalizer, fast_exp, has_avx2_fma, has_avx512};
pub use norm::{rms_norm, rms_norm_backward};
pub use reduce::{argmax, top_k};
pub use rope::{RopeScaling, RopeTable, RotaryLayout, YarnScaling};
pub use softmax::{softmax_rows, softmax_rows_backward};
pub use tile::{tile_rows_product, tile_update};
