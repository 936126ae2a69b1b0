//! How a training pass keeps an activation for the backward: f32, or bf16 when the model
//! trains in bf16 (its weights are bf16), as PyTorch autocast keeps the bf16 inputs of its
//! matmuls and attention. A narrowed activation is rounded **before** the forward uses it
//! ([`Kept`]), so the backward differentiates exactly what the forward computed,
//! and a recomputed activation rounds the same way (recompute stays bit-identical).
//!
//! What is narrowed (see `forward::layer_forward`): the inputs of the linear layers
//! (`norm1`, core attention's output, `norm2`, the SwiGLU output), `q`/`k`/`v` and the
//! `linear_fc1` output. The residual stream, the norms' `1/rms` and the softmax statistics
//! stay f32. The weight-gradient GEMMs read the bf16 copies directly ([`Stored::operand`]);
//! core attention multiplies the (widened) q/k/v in bf16 with f32 accumulation
//! (`AttentionPrecision::Bf16`, as PyTorch's flash attention under autocast).

use std::borrow::Cow;

use ferrotron_tensor::gemm_bf16::{Operand, narrow_to_bf16_in_place};
use ferrotron_tensor::{Buffer, DType};
use half::bf16;

use crate::GptModel;

impl GptModel {
    /// The dtype the training pass keeps activations in: bf16 for a model with bf16
    /// weights (bf16 training), f32 otherwise (f32, and fp16 whose range is too narrow for
    /// activations).
    pub fn activation_dtype(&self) -> DType {
        match self.dtype() {
            DType::BF16 => DType::BF16,
            _ => DType::F32,
        }
    }
}

/// An activation the forward goes on computing with and keeps for the backward: under
/// `narrow` rounded to bf16 once, the rounded f32 values in hand and the bf16 copy kept; in
/// f32 the one vector serves both.
pub(crate) struct Kept {
    pub stored: Stored,
    /// The rounded values (empty when `stored` is f32).
    wide: Buffer<f32>,
}

impl Kept {
    /// Rounds (under `narrow`) and keeps `x`.
    pub(crate) fn new(mut x: Buffer<f32>, narrow: bool) -> Kept {
        if !narrow {
            return Kept {
                stored: Stored::F32(x),
                wide: Buffer::default(),
            };
        }
        let narrowed = narrow_to_bf16_in_place(x.host_mut());
        Kept {
            stored: Stored::Bf16(Buffer::from_host(narrowed)),
            wide: x,
        }
    }

    /// The values the forward computes with.
    pub(crate) fn values(&self) -> &[f32] {
        match &self.stored {
            Stored::F32(v) => v.host(),
            Stored::Bf16(_) => self.wide.host(),
        }
    }
}

/// A saved activation.
pub(crate) enum Stored {
    F32(Buffer<f32>),
    Bf16(Buffer<bf16>),
}

impl Stored {
    /// The values as a GEMM operand, as kept (no copy): a bf16 activation feeds the bf16 GEMM
    /// of its weight gradient directly.
    pub(crate) fn operand(&self) -> Operand<'_> {
        match self {
            Stored::F32(v) => Operand::F32(v.host()),
            Stored::Bf16(v) => Operand::Bf16(v.host()),
        }
    }

    /// The values as f32 (borrowed when kept in f32, widened otherwise).
    pub(crate) fn f32(&self) -> Cow<'_, [f32]> {
        self.operand().to_f32()
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> u128 {
        match self {
            Stored::F32(v) => v.bytes(),
            Stored::Bf16(v) => v.bytes(),
        }
    }
}

/// Bytes per element of a narrowed activation.
pub(crate) fn element_bytes(narrow: bool) -> u128 {
    if narrow { 2 } else { 4 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_agrees_with_half() {
        let specials = [
            0.0f32,
            -0.0,
            1.0,
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 512.0,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        let x: Vec<f32> = specials
            .into_iter()
            .chain((0..100_000).map(|i| ((i as f32) * 0.7311).sin() * 10f32.powi(i % 20 - 10)))
            .collect();
        let want: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
        let kept = Kept::new(Buffer::from_host(x.clone()), true);
        let Stored::Bf16(b) = &kept.stored else {
            panic!("not narrowed")
        };
        assert_eq!(
            b.host().iter().map(|b| b.to_bits()).collect::<Vec<_>>(),
            want
        );
        let rounded = kept.values();
        assert!(
            rounded
                .iter()
                .zip(&want)
                .all(|(v, w)| v.to_bits() == u32::from(*w) << 16)
        );
        assert_eq!(kept.stored.f32().as_ref(), rounded);
        let wide = Kept::new(Buffer::from_host(x.clone()), false);
        assert!(matches!(wide.stored, Stored::F32(_)));
        assert!(ferrotron_tensor::round_to_bf16_bits(f32::NAN) & 0x7fc0 == 0x7fc0);
    }
}
