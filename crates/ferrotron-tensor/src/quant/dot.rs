//! Dot products of one quantized weight row with quantized activation rows, in integers.
//!
//! Every format is read as 32-value blocks aligned with the activation blocks
//! ([`super::activation`]): block `b` of a weight row gives 32 small integers `w`, a float
//! coefficient `c`, a float min `mn` and, for Q6_K, one integer scale per 16 values, so that
//! the block's contribution is `dx_b · (c · Σ s·w·q + mn · Σq)` with `q` the activation's
//! int8 values. This is ggml's `ggml_vec_dot_*` arithmetic (`ggml/src/ggml-cpu/quants.c`)
//! with the activation scale per 32 values.
//!
//! The portable path ([`dot_scalar`]) is the reference; the AVX512-VNNI path
//! (`vpdpbusd`, four products of bytes per 32-bit lane) computes the same sums in another
//! order (the integer parts are exact in both; the f32 totals agree to rounding).

use super::QuantType;
use super::activation::{Q8Row, QK8};
use super::blocks::{f16_at, scale_min_k4};

/// Weight block `b` of a row decoded for the integer dot: see the module doc.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BlockInts {
    pub w: [i8; QK8],
    pub c: f32,
    pub mn: f32,
    /// Integer scales of values `0..16` and `16..32` (1 except for Q6_K).
    pub s: [i32; 2],
}

/// Block `b` (values `32b..32b + 32`) of the weight row `row` of `ty`, decoded (a K-quant's
/// 256-value block spans 8 of these).
pub(crate) fn block_at(ty: QuantType, row: &[u8], b: usize) -> BlockInts {
    let mut out = BlockInts {
        w: [0; QK8],
        c: 0.0,
        mn: 0.0,
        s: [1, 1],
    };
    let (values, bytes) = ty.block_layout();
    let per = values / QK8;
    let blk = &row[(b / per) * bytes..][..bytes];
    let j = b % per;
    match ty {
        QuantType::Q8_0 => {
            out.c = f16_at(blk, 0);
            for (w, &q) in out.w.iter_mut().zip(&blk[2..34]) {
                *w = q as i8;
            }
        }
        QuantType::Q4_0 | QuantType::Q4_1 => {
            let min = ty == QuantType::Q4_1;
            out.c = f16_at(blk, 0);
            let qs = &blk[if min { 4 } else { 2 }..][..16];
            for (l, w) in out.w.iter_mut().enumerate() {
                let nibble = ((qs[l % 16] >> (4 * (l / 16))) & 0x0F) as i8;
                *w = if min { nibble } else { nibble - 8 };
            }
            out.mn = if min { f16_at(blk, 2) } else { 0.0 };
        }
        QuantType::Q5_0 | QuantType::Q5_1 => {
            let min = ty == QuantType::Q5_1;
            let at = if min { 4 } else { 2 };
            out.c = f16_at(blk, 0);
            let qh = u32::from_le_bytes([blk[at], blk[at + 1], blk[at + 2], blk[at + 3]]);
            let qs = &blk[at + 4..][..16];
            for (l, w) in out.w.iter_mut().enumerate() {
                let nibble = (qs[l % 16] >> (4 * (l / 16))) & 0x0F;
                let q = (nibble | ((((qh >> l) & 1) as u8) << 4)) as i8;
                *w = if min { q } else { q - 16 };
            }
            out.mn = if min { f16_at(blk, 2) } else { 0.0 };
        }
        QuantType::Q4_K => {
            let (sc, m) = scale_min_k4(j, &blk[4..16]);
            out.c = f16_at(blk, 0) * f32::from(sc);
            out.mn = -(f16_at(blk, 2) * f32::from(m));
            let shift = 4 * (j % 2);
            for (w, &q) in out.w.iter_mut().zip(&blk[16 + 32 * (j / 2)..][..32]) {
                *w = ((q >> shift) & 0x0F) as i8;
            }
        }
        QuantType::Q6_K => {
            let (n, t) = (j / 4, j % 4);
            let low = &blk[64 * n + 32 * (t % 2)..][..32];
            let high = &blk[128 + 32 * n..][..32];
            for (l, w) in out.w.iter_mut().enumerate() {
                let q = ((low[l] >> (4 * (t / 2))) & 0x0F) | (((high[l] >> (2 * t)) & 3) << 4);
                *w = q as i8 - 32;
            }
            let sc = &blk[192 + 8 * n + 2 * t..][..2];
            out.s = [i32::from(sc[0] as i8), i32::from(sc[1] as i8)];
            out.c = f16_at(blk, 208);
        }
    }
    out
}

/// `Σ_k w[k]·x[k]` for one weight row `w` of `ty` (`k` values) and one activation row: the
/// portable reference.
pub(crate) fn dot_scalar(ty: QuantType, w: &[u8], x: Q8Row<'_>) -> f32 {
    let mut acc = 0f32;
    for (b, (q, (&dx, &sum))) in
        x.qs.chunks_exact(QK8)
            .zip(x.d.iter().zip(x.sum))
            .enumerate()
    {
        let blk = block_at(ty, w, b);
        let half = |h: usize| -> i32 {
            (16 * h..16 * h + 16)
                .map(|l| i32::from(blk.w[l]) * i32::from(q[l]))
                .sum()
        };
        let isum = blk.s[0] * half(0) + blk.s[1] * half(1);
        acc += dx * (blk.c * isum as f32 + blk.mn * sum as f32);
    }
    acc
}
