//! AVX512-VNNI dot products of a quantized weight row with up to four activation rows.
//!
//! Each 32-value block is unpacked once into 32 bytes (signed for formats centred on zero,
//! unsigned for those with a min), then multiplied with every activation row by `vpdpbusd`
//! on 256-bit vectors (eight 32-bit lanes, four byte products each). Signed weights use
//! llama.cpp's sign trick (`|w|` unsigned times `x` with `w`'s sign); Q6_K's two 16-value
//! scales multiply the lanes; the block's f32 coefficient scales the lanes into one f32
//! accumulator per row, and a min's `mn·dx·Σq` goes to a scalar one. A row's sums run in the
//! same order whatever the number of rows, so batched decode equals one-row decode bit for
//! bit.

use std::arch::x86_64::*;

use super::QuantType;
use super::activation::{Q8Row, QK8};
use super::blocks::scale_min_k4;

/// Whether this CPU runs these kernels.
pub(crate) fn available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// One unpacked block (see the module doc).
struct Block {
    v: __m256i,
    c: f32,
    mn: f32,
    /// Per-lane integer scales (Q6_K only).
    s: __m256i,
}

/// How a format unpacks.
trait Format {
    /// Values are signed (centred) rather than unsigned with a min.
    const SIGNED: bool;
    /// Blocks carry a min.
    const MIN: bool;
    /// Blocks carry two integer scales.
    const SCALED: bool;
    /// Block `b` (values `32b..32b+32`) of the row at `row`.
    unsafe fn block(row: *const u8, b: usize) -> Block;
}

macro_rules! features {
    ($($item:item)*) => {$(
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        $item
    )*};
}

features! {
    unsafe fn f16_at(p: *const u8) -> f32 {
        // SAFETY: the caller points `p` at two readable bytes.
        let bits = unsafe { (p as *const u16).read_unaligned() };
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
    }

    /// 16 bytes of nibbles at `p` as 32 bytes: the low nibbles, then the high ones.
    unsafe fn nibbles(p: *const u8) -> __m256i {
        // SAFETY: the caller points `p` at 16 readable bytes.
        let lo = unsafe { _mm_loadu_si128(p as *const __m128i) };
        let v = _mm256_set_m128i(_mm_srli_epi16(lo, 4), lo);
        _mm256_and_si256(v, _mm256_set1_epi8(0x0F))
    }

    /// Q5's fifth bits: bit `l` of the little-endian word at `p` as `0x10` in byte `l`.
    unsafe fn fifth_bits(p: *const u8) -> __m256i {
        // SAFETY: the caller points `p` at 4 readable bytes.
        let qh = unsafe { (p as *const u32).read_unaligned() };
        _mm256_maskz_mov_epi8(qh, _mm256_set1_epi8(0x10))
    }

    fn plain(v: __m256i, c: f32, mn: f32) -> Block {
        Block { v, c, mn, s: _mm256_set1_epi32(1) }
    }

    fn hsum(a: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// `out[r] = row · xs[r]` for `N` activation rows. Blocks go round-robin into [`LANES`]
    /// accumulators per row (independent FMA chains), summed in a fixed order at the end.
    unsafe fn dot_n<F: Format, const N: usize>(row: &[u8], xs: &[Q8Row<'_>; N]) -> [f32; N] {
        let mut acc = [[_mm256_setzero_ps(); LANES]; N];
        let mut macc = [0f32; N];
        let blocks = xs[0].d.len();
        let mut b = 0;
        while b + LANES <= blocks {
            for (u, lane) in (b..b + LANES).enumerate() {
                // SAFETY: the caller gives whole rows: block `lane` lies inside `row` and
                // every activation row.
                unsafe { block_dot::<F, N>(row, xs, lane, u, &mut acc, &mut macc) };
            }
            b += LANES;
        }
        for (u, lane) in (b..blocks).enumerate() {
            // SAFETY: as above.
            unsafe { block_dot::<F, N>(row, xs, lane, u, &mut acc, &mut macc) };
        }
        std::array::from_fn(|r| {
            let [a0, a1, a2, a3] = acc[r];
            hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))) + macc[r]
        })
    }

    /// Block `b` of `row` against every activation row, into accumulator `u` of each.
    unsafe fn block_dot<F: Format, const N: usize>(
        row: &[u8],
        xs: &[Q8Row<'_>; N],
        b: usize,
        u: usize,
        acc: &mut [[__m256; LANES]; N],
        macc: &mut [f32; N],
    ) {
        // SAFETY: the caller checks that block b lies inside `row` and the activations.
        let blk = unsafe { F::block(row.as_ptr(), b) };
        let abs = _mm256_abs_epi8(blk.v);
        let zero = _mm256_setzero_si256();
        for r in 0..N {
            // SAFETY: as above.
            let x = unsafe { _mm256_loadu_si256(xs[r].qs.as_ptr().add(b * QK8) as *const __m256i) };
            let p = if F::SIGNED {
                _mm256_dpbusd_epi32(zero, abs, _mm256_sign_epi8(x, blk.v))
            } else {
                _mm256_dpbusd_epi32(zero, blk.v, x)
            };
            let p = if F::SCALED { _mm256_mullo_epi32(p, blk.s) } else { p };
            let dx = xs[r].d[b];
            acc[r][u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(blk.c * dx), acc[r][u]);
            if F::MIN {
                macc[r] += blk.mn * dx * xs[r].sum[b] as f32;
            }
        }
    }
}

/// Row `row` of `ty` dequantized into `out` (its values): the same bits as
/// [`super::dequantize`] (the products and sums in gguf-py's order, no fused multiply-add).
///
/// # Safety
/// The CPU must pass [`available`]; `row` must be one whole row of `out.len()` values.
pub(crate) unsafe fn dequantize_row(ty: QuantType, row: &[u8], out: &mut [f32]) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match ty {
            QuantType::Q8_0 => dequantize_n::<Q8_0>(row, out),
            QuantType::Q4_0 => dequantize_n::<Q4_0>(row, out),
            QuantType::Q4_1 => dequantize_n::<Q4_1>(row, out),
            QuantType::Q5_0 => dequantize_n::<Q5_0>(row, out),
            QuantType::Q5_1 => dequantize_n::<Q5_1>(row, out),
            QuantType::Q4_K => dequantize_n::<Q4_K>(row, out),
            QuantType::Q6_K => dequantize_n::<Q6_K>(row, out),
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn dequantize_n<F: Format>(row: &[u8], out: &mut [f32]) {
    for (b, out) in out.chunks_exact_mut(QK8).enumerate() {
        // SAFETY: the caller gives a whole row: block b lies inside it.
        let blk = unsafe { F::block(row.as_ptr(), b) };
        let (ca, cb) = if F::SCALED {
            let (sa, sb) = (
                _mm256_extract_epi32(blk.s, 0),
                _mm256_extract_epi32(blk.s, 4),
            );
            (blk.c * sa as f32, blk.c * sb as f32)
        } else {
            (blk.c, blk.c)
        };
        let halves = [
            _mm256_castsi256_si128(blk.v),
            _mm256_extracti128_si256(blk.v, 1),
        ];
        for (h, (q, c)) in halves.into_iter().zip([ca, cb]).enumerate() {
            let v = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)),
                _mm512_set1_ps(c),
            );
            let v = if F::MIN {
                _mm512_add_ps(v, _mm512_set1_ps(blk.mn))
            } else {
                v
            };
            // SAFETY: out holds 32 values.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(16 * h), v) };
        }
    }
}

/// [`super::activation`]'s block quantization with AVX-512: the same values (the conversion
/// rounds to nearest-even, as the scalar path does).
///
/// # Safety
/// The CPU must pass [`available`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn quantize_block(x: &[f32; QK8], q: &mut [i8; QK8]) -> (f32, i32) {
    // SAFETY: x holds 32 values, q 32 bytes.
    let (a, b) = unsafe {
        (
            _mm512_loadu_ps(x.as_ptr()),
            _mm512_loadu_ps(x.as_ptr().add(16)),
        )
    };
    let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    let d = amax / 127.0;
    let id = _mm512_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
    let clamp = |v: __m512| {
        let i = _mm512_cvtps_epi32(_mm512_mul_ps(v, id));
        _mm512_max_epi32(
            _mm512_min_epi32(i, _mm512_set1_epi32(127)),
            _mm512_set1_epi32(-127),
        )
    };
    let (qa, qb) = (clamp(a), clamp(b));
    // SAFETY: q holds 32 bytes.
    unsafe {
        _mm_storeu_si128(q.as_mut_ptr() as *mut __m128i, _mm512_cvtepi32_epi8(qa));
        _mm_storeu_si128(
            q.as_mut_ptr().add(16) as *mut __m128i,
            _mm512_cvtepi32_epi8(qb),
        );
    }
    (d, _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)))
}

/// Independent accumulators per row in [`dot_n`].
const LANES: usize = 4;

/// Declares a [`Format`] whose `block` body runs with the kernels' target features.
macro_rules! block_format {
    ($name:ident, signed: $s:expr, min: $m:expr, scaled: $sc:expr, |$row:ident, $b:ident| $body:block) => {
        #[allow(non_camel_case_types)]
        struct $name;
        impl Format for $name {
            const SIGNED: bool = $s;
            const MIN: bool = $m;
            const SCALED: bool = $sc;
            #[inline]
            #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
            unsafe fn block($row: *const u8, $b: usize) -> Block {
                // SAFETY: the caller points `row` at a whole row holding block `b`.
                unsafe { $body }
            }
        }
    };
}

block_format!(Q8_0, signed: true, min: false, scaled: false, |row, b| {
    let p = row.add(b * 34);
    plain(_mm256_loadu_si256(p.add(2) as *const __m256i), f16_at(p), 0.0)
});
block_format!(Q4_0, signed: true, min: false, scaled: false, |row, b| {
    let p = row.add(b * 18);
    plain(_mm256_sub_epi8(nibbles(p.add(2)), _mm256_set1_epi8(8)), f16_at(p), 0.0)
});
block_format!(Q4_1, signed: false, min: true, scaled: false, |row, b| {
    let p = row.add(b * 20);
    plain(nibbles(p.add(4)), f16_at(p), f16_at(p.add(2)))
});
block_format!(Q5_0, signed: true, min: false, scaled: false, |row, b| {
    let p = row.add(b * 22);
    let q = _mm256_or_si256(nibbles(p.add(6)), fifth_bits(p.add(2)));
    plain(_mm256_sub_epi8(q, _mm256_set1_epi8(16)), f16_at(p), 0.0)
});
block_format!(Q5_1, signed: false, min: true, scaled: false, |row, b| {
    let p = row.add(b * 24);
    let q = _mm256_or_si256(nibbles(p.add(8)), fifth_bits(p.add(4)));
    plain(q, f16_at(p), f16_at(p.add(2)))
});
block_format!(Q4_K, signed: false, min: true, scaled: false, |row, b| {
    let (p, j) = (row.add((b / 8) * 144), b % 8);
    let scales = std::slice::from_raw_parts(p.add(4), 12);
    let (sc, m) = scale_min_k4(j, scales);
    let bytes = _mm256_loadu_si256(p.add(16 + 32 * (j / 2)) as *const __m256i);
    let shifted = _mm256_srl_epi16(bytes, _mm_cvtsi32_si128(4 * (j % 2) as i32));
    let v = _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F));
    plain(v, f16_at(p) * f32::from(sc), -(f16_at(p.add(2)) * f32::from(m)))
});
block_format!(Q6_K, signed: true, min: false, scaled: true, |row, b| {
    let (p, j) = (row.add((b / 8) * 210), b % 8);
    let (n, t) = (j / 4, j % 4);
    let low = _mm256_loadu_si256(p.add(64 * n + 32 * (t % 2)) as *const __m256i);
    let low = _mm256_srl_epi16(low, _mm_cvtsi32_si128(4 * (t / 2) as i32));
    let low = _mm256_and_si256(low, _mm256_set1_epi8(0x0F));
    let high = _mm256_loadu_si256(p.add(128 + 32 * n) as *const __m256i);
    let high = _mm256_srl_epi16(high, _mm_cvtsi32_si128(2 * t as i32));
    let high = _mm256_slli_epi16(_mm256_and_si256(high, _mm256_set1_epi8(3)), 4);
    let v = _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
    let (sa, sb) = (i32::from(*p.add(192 + 8 * n + 2 * t) as i8), i32::from(*p.add(193 + 8 * n + 2 * t) as i8));
    Block { v, c: f16_at(p.add(208)), mn: 0.0, s: _mm256_setr_epi32(sa, sa, sa, sa, sb, sb, sb, sb) }
});

/// `out[r] = row · xs[r]` for a weight row of `ty` and `N` activation rows of its length.
///
/// # Safety
/// The CPU must pass [`available`]; `row` must be one whole row of `ty` for the activations'
/// length.
pub(crate) unsafe fn dot_rows<const N: usize>(
    ty: QuantType,
    row: &[u8],
    xs: &[Q8Row<'_>; N],
) -> [f32; N] {
    // SAFETY: forwarded from the caller.
    unsafe {
        match ty {
            QuantType::Q8_0 => dot_n::<Q8_0, N>(row, xs),
            QuantType::Q4_0 => dot_n::<Q4_0, N>(row, xs),
            QuantType::Q4_1 => dot_n::<Q4_1, N>(row, xs),
            QuantType::Q5_0 => dot_n::<Q5_0, N>(row, xs),
            QuantType::Q5_1 => dot_n::<Q5_1, N>(row, xs),
            QuantType::Q4_K => dot_n::<Q4_K, N>(row, xs),
            QuantType::Q6_K => dot_n::<Q6_K, N>(row, xs),
        }
    }
}
