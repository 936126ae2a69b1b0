//! Dequantization of ggml blocks to f32, exactly as ggml defines them.
//!
//! Mirrors `dequantize_row_q8_0`, `dequantize_row_q4_0`, `dequantize_row_q4_1` in llama.cpp's
//! `ggml/src/ggml-quants.c` and gguf-py's `gguf/quants.py` (which transformers' GGUF loader uses):
//! the scale `d` (and min `m`) are f16 widened to f32, and each value is computed in f32 as
//! `q * d` or `q * d + m` with no fused multiply-add, so results are bit-identical to gguf-py.
//! Data is row-major with `ne[0]` fastest; a block never crosses a row, so dequantizing blocks in
//! file order yields the row-major `[ne[n-1], ..., ne[0]]` array.

use half::f16;

use super::types::GgmlType;

/// Why a byte buffer could not be dequantized.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DequantError {
    /// The type has no dequantizer here.
    #[error("ggml type {0} is not supported")]
    Unsupported(GgmlType),
    /// `bytes` is not the size `elements` values of this type occupy (or `elements` is not a
    /// whole number of blocks).
    #[error("{bytes} bytes of type {ggml_type} cannot hold exactly {elements} values")]
    Length {
        /// The tensor's type.
        ggml_type: GgmlType,
        /// Bytes given.
        bytes: usize,
        /// Values requested.
        elements: usize,
    },
}

/// Dequantizes `data` (stored as `ty`) into `out`, one f32 per element.
///
/// `out.len()` is the element count; it must be a multiple of the type's block size and
/// `data.len()` must be exactly `out.len() / block * block_bytes`.
///
/// # Errors
/// [`DequantError::Unsupported`] for types other than F32, F16, BF16 and the block formats of
/// [`ferrotron_tensor::quant::QuantType`] (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K);
/// [`DequantError::Length`] when the sizes disagree.
pub fn dequantize(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<(), DequantError> {
    if !ty.is_dequantizable() {
        return Err(DequantError::Unsupported(ty));
    }
    let (block, block_bytes) = ty.block_layout();
    let (block, block_bytes) = (block as usize, block_bytes as usize);
    let len_err = DequantError::Length {
        ggml_type: ty,
        bytes: data.len(),
        elements: out.len(),
    };
    if !out.len().is_multiple_of(block)
        || (out.len() / block).checked_mul(block_bytes) != Some(data.len())
    {
        return Err(len_err);
    }
    let blocks = data
        .chunks_exact(block_bytes)
        .zip(out.chunks_exact_mut(block));
    match ty {
        GgmlType::F32 => {
            blocks.for_each(|(b, y)| y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        }
        GgmlType::F16 => blocks.for_each(|(b, y)| y[0] = f16_at(b, 0)),
        GgmlType::BF16 => {
            blocks.for_each(|(b, y)| y[0] = bf16_to_f32(u16::from_le_bytes([b[0], b[1]])))
        }
        _ => match ty.quant_type() {
            Some(q) => ferrotron_tensor::quant::dequantize(q, data, out),
            None => return Err(DequantError::Unsupported(ty)),
        },
    }
    Ok(())
}

/// The little-endian f16 at byte `at` of `b`, widened to f32 (exact).
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// bf16 bits widened to f32 (exact: bf16 is the top half of an f32).
fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_bits().to_le_bytes()
    }

    #[test]
    fn f32_f16_bf16() {
        let mut out = [0f32; 3];
        let data: Vec<u8> = [1.5f32, -2.25, 1e-30]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        dequantize(GgmlType::F32, &data, &mut out).unwrap();
        assert_eq!(out, [1.5, -2.25, 1e-30]);

        let data: Vec<u8> = [h(0.5), h(-65504.0), [0x01, 0x00]].concat();
        dequantize(GgmlType::F16, &data, &mut out).unwrap();
        assert_eq!(out, [0.5, -65504.0, 2f32.powi(-24)]); // smallest subnormal f16

        // bf16 0x3FC0 = 1.5, 0xC080 = -4.0, 0x7F80 = +inf
        let data = [0xC0, 0x3F, 0x80, 0xC0, 0x80, 0x7F];
        dequantize(GgmlType::BF16, &data, &mut out).unwrap();
        assert_eq!(out, [1.5, -4.0, f32::INFINITY]);
    }

    #[test]
    fn q8_0_block() {
        let mut block = h(0.25).to_vec();
        let qs: Vec<i8> = (0..32).map(|i| (i as i8 - 16) * 8).collect(); // -128..=120
        block.extend(qs.iter().map(|&q| q as u8));
        let mut out = [0f32; 32];
        dequantize(GgmlType::Q8_0, &block, &mut out).unwrap();
        for i in 0..32 {
            assert_eq!(out[i], qs[i] as f32 * 0.25, "element {i}");
        }
        assert_eq!(out[0], -32.0);
        assert_eq!(out[31], 30.0);
    }

    #[test]
    fn q4_0_block() {
        // byte j holds element j (low nibble) and element j + 16 (high nibble).
        let mut block = h(2.0).to_vec();
        block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut out = [0f32; 32];
        dequantize(GgmlType::Q4_0, &block, &mut out).unwrap();
        for j in 0..16 {
            assert_eq!(out[j], (j as f32 - 8.0) * 2.0, "low {j}");
            assert_eq!(out[j + 16], ((15 - j) as f32 - 8.0) * 2.0, "high {j}");
        }
        assert_eq!(out[0], -16.0);
        assert_eq!(out[16], 14.0);
    }

    #[test]
    fn q4_1_block() {
        let mut block = [h(0.5), h(-3.0)].concat();
        block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut out = [0f32; 32];
        dequantize(GgmlType::Q4_1, &block, &mut out).unwrap();
        for j in 0..16 {
            assert_eq!(out[j], j as f32 * 0.5 - 3.0, "low {j}");
            assert_eq!(out[j + 16], (15 - j) as f32 * 0.5 - 3.0, "high {j}");
        }
        assert_eq!(out[15], 4.5);
        assert_eq!(out[16], 4.5);
    }

    #[test]
    fn q4_1_is_not_fused() {
        // d * q rounds before + m: with d = 1 + 2^-10, q = 15, m = -15 the unfused result is
        // the f32 rounding of 15 + 15 * 2^-10 minus 15; ggml and gguf-py compute it this way.
        let d = 1.0 + 2f32.powi(-10);
        let mut block = [h(d), h(-15.0)].concat();
        block.extend([0xFFu8; 16]);
        let mut out = [0f32; 32];
        dequantize(GgmlType::Q4_1, &block, &mut out).unwrap();
        let expect = (15.0f32 * d) + -15.0;
        assert!(out.iter().all(|&v| v == expect));
    }

    #[test]
    fn multiple_blocks_are_in_order() {
        let mut data = Vec::new();
        for k in 0..3 {
            data.extend(h(k as f32 + 1.0));
            data.extend([1u8; 32]);
        }
        let mut out = vec![0f32; 96];
        dequantize(GgmlType::Q8_0, &data, &mut out).unwrap();
        assert_eq!(&out[..32], &[1.0; 32]);
        assert_eq!(&out[32..64], &[2.0; 32]);
        assert_eq!(&out[64..], &[3.0; 32]);
    }

    #[test]
    fn errors() {
        let mut out = [0f32; 32];
        assert_eq!(
            dequantize(GgmlType::Q2_K, &[0; 84], &mut out),
            Err(DequantError::Unsupported(GgmlType::Q2_K))
        );
        assert!(matches!(
            dequantize(GgmlType::Q8_0, &[0; 33], &mut out),
            Err(DequantError::Length { .. })
        ));
        let mut out = [0f32; 31];
        assert!(matches!(
            dequantize(GgmlType::Q8_0, &[0; 34], &mut out),
            Err(DequantError::Length { .. })
        ));
    }
}
