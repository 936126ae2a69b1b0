//! How a training pass keeps an activation for the backward: f32, or bf16 when the model
//! trains in bf16 (its weights are bf16), as PyTorch autocast keeps the bf16 inputs of its
//! matmuls and attention. A narrowed activation is rounded **before** the forward uses it
//! ([`round_to_bf16`]), so the backward differentiates exactly what the forward computed,
//! and a recomputed activation rounds the same way (recompute stays bit-identical).
//!
//! What is narrowed (see `forward::layer_forward`): the inputs of the linear layers
//! (`norm1`, core attention's output, `norm2`, the SwiGLU output), `q`/`k`/`v` and the
//! `linear_fc1` output. The residual stream, the norms' `1/rms` and the softmax statistics
//! stay f32. Compute is f32 throughout.

use std::borrow::Cow;

use ferrotron_tensor::DType;
use half::bf16;
use rayon::prelude::*;

use crate::GptModel;

impl GptModel {
    /// The dtype the training pass keeps activations in: bf16 for a model with bf16
    /// weights (bf16 training), f32 otherwise (f32, and fp16 whose range is too narrow for
    /// activations).
    pub fn activation_dtype(&self) -> DType {
        match self.embedding.weight().dtype() {
            DType::BF16 => DType::BF16,
            _ => DType::F32,
        }
    }
}

/// A saved activation.
pub(crate) enum Stored {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

impl Stored {
    /// Keeps `x`: as bf16 when `narrow` (`x` must already be rounded by [`round_to_bf16`],
    /// so the conversion is exact), as is otherwise.
    pub(crate) fn keep(x: Vec<f32>, narrow: bool) -> Stored {
        if !narrow {
            return Stored::F32(x);
        }
        let mut out = vec![bf16::ZERO; x.len()];
        out.par_chunks_mut(1 << 14)
            .zip(x.par_chunks(1 << 14))
            .for_each(|(o, i)| {
                o.iter_mut()
                    .zip(i)
                    .for_each(|(o, &v)| *o = bf16::from_f32(v))
            });
        Stored::Bf16(out)
    }

    /// The values as f32 (borrowed when kept in f32, widened otherwise).
    pub(crate) fn f32(&self) -> Cow<'_, [f32]> {
        match self {
            Stored::F32(v) => Cow::Borrowed(v),
            Stored::Bf16(v) => {
                let mut out = vec![0f32; v.len()];
                out.par_chunks_mut(1 << 14)
                    .zip(v.par_chunks(1 << 14))
                    .for_each(|(o, i)| o.iter_mut().zip(i).for_each(|(o, v)| *o = v.to_f32()));
                Cow::Owned(out)
            }
        }
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> u128 {
        match self {
            Stored::F32(v) => std::mem::size_of_val(v.as_slice()) as u128,
            Stored::Bf16(v) => std::mem::size_of_val(v.as_slice()) as u128,
        }
    }
}

/// Rounds every value of `x` to the nearest bf16 (ties to even) in place when `narrow`.
pub(crate) fn round_to_bf16(x: &mut [f32], narrow: bool) {
    if narrow {
        x.par_chunks_mut(1 << 14)
            .for_each(|c| c.iter_mut().for_each(|v| *v = bf16::from_f32(*v).to_f32()));
    }
}

/// Bytes per element of a narrowed activation.
pub(crate) fn element_bytes(narrow: bool) -> u128 {
    if narrow { 2 } else { 4 }
}
