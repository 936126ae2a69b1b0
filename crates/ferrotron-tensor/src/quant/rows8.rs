//! Q4_0 weight rows eight at a time against several int8 activation rows (AVX512-VNNI on
//! 256-bit vectors): the batched-decode kernel, as llama.cpp's `ggml_gemm_q4_0_8x8_q8_0`
//! (`ggml-cpu/repack.cpp`) but reading the GGUF blocks as they are, without a repacked copy.
//!
//! Lane `j` of every vector belongs to weight row `j` of the eight. Per block, each row's
//! bytes are transposed into eight vectors, vector `g` holding in lane `j` row `j`'s values
//! `4g..4g+4` as unsigned bytes (Q4_0's nibbles 0..15), each multiplied by `vpdpbusd` with
//! the activation's four matching bytes broadcast to all lanes. The offset (8) is taken out
//! exactly in integers by starting each block's sum at `-8·Σx` (the activation block's sum,
//! [`super::Q8Rows`]). One f32 per lane then gets `Σ · d_w · d_x` per block, in block order,
//! so a row's result is the same whatever the number of activation rows beside it.
//!
//! On Zen 4 this is 1.5x / 1.8x the one-row kernel (`avx512.rs`) at 4 / 8 activation rows
//! and as fast at one. Q8_0 through the same scheme (values + 128, two transposes per block)
//! measured 1.7x slower than the one-row kernel at one activation row, so Q8_0 (like the
//! other formats) stays there: a format's kernel must not depend on the number of rows.

use std::arch::x86_64::*;

use super::QuantType;
use super::activation::{Q8Row, QK8};

/// A format this kernel reads: an f16 scale, then the values (Q4_0).
trait Rows8 {
    /// Bytes per block.
    const BLOCK_BYTES: usize;
    /// What the unsigned values exceed the signed ones by.
    const OFFSET: i32;
    /// Vector `g` of the eight rows' block at `p` (the block of row 0; row `j`'s is
    /// `j·stride` further): lane `j` holds row `j`'s values `4g..4g+4`, unsigned.
    unsafe fn values(p: *const u8, stride: usize) -> [__m256i; 8];
}

struct Q4_0;

impl Rows8 for Q4_0 {
    const BLOCK_BYTES: usize = 18;
    const OFFSET: i32 = 8;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn values(p: *const u8, stride: usize) -> [__m256i; 8] {
        // Byte i holds value i (low nibble) and value 16 + i (high nibble).
        // SAFETY: forwarded from the caller: the 16 nibble bytes follow the scale.
        let g = unsafe { transpose16(p.add(2), stride) };
        let low = _mm256_set1_epi8(0x0F);
        let lo = g.map(|v| _mm256_and_si256(v, low));
        let hi = g.map(|v| _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
        [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]]
    }
}

/// Whether [`dot_rows8`] takes rows of `ty`.
pub(crate) fn supports(ty: QuantType) -> bool {
    ty == QuantType::Q4_0
}

/// `out[r][j] = w_j · xs[r]` for the eight rows of `ty` starting at `rows` (each `row_bytes`
/// long, consecutive) and `N` activation rows.
///
/// # Safety
/// The CPU must pass [`super::avx512::available`]; `ty` must pass [`supports`]; `rows` must
/// point at eight whole rows of `row_bytes` bytes each, one after another, of the
/// activations' length.
pub(crate) unsafe fn dot_rows8<const N: usize>(
    ty: QuantType,
    rows: *const u8,
    row_bytes: usize,
    xs: &[Q8Row<'_>; N],
) -> [[f32; 8]; N] {
    // SAFETY: forwarded from the caller.
    unsafe {
        match ty {
            QuantType::Q4_0 => dot_n::<Q4_0, N>(rows, row_bytes, xs),
            _ => unreachable!("dot_rows8 on {ty}: callers check `supports`"),
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn dot_n<F: Rows8, const N: usize>(
    rows: *const u8,
    row_bytes: usize,
    xs: &[Q8Row<'_>; N],
) -> [[f32; 8]; N] {
    let mut acc = [_mm256_setzero_ps(); N];
    for b in 0..xs[0].d.len() {
        // SAFETY: block b lies inside each of the eight rows (the caller's contract).
        let p = unsafe { rows.add(b * F::BLOCK_BYTES) };
        // Each row's f16 scale.
        // SAFETY: as above.
        let h = |j: usize| unsafe { (p.add(j * row_bytes) as *const i16).read_unaligned() };
        let dw = _mm256_cvtph_ps(_mm_setr_epi16(
            h(0),
            h(1),
            h(2),
            h(3),
            h(4),
            h(5),
            h(6),
            h(7),
        ));
        // SAFETY: as above.
        let w = unsafe { F::values(p, row_bytes) };
        // The eight rows are read side by side, one block each, which the hardware
        // prefetchers follow poorly: fetch the same block of the next eight rows (a hint
        // that never faults, so past the matrix's end is harmless).
        for j in 8..16 {
            let ahead = p.wrapping_add(j * row_bytes);
            _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
        }
        for (r, x) in xs.iter().enumerate() {
            // SAFETY: block b lies inside every activation row.
            let q = unsafe { x.qs.as_ptr().add(b * QK8) } as *const i32;
            let mut s0 = _mm256_set1_epi32(-F::OFFSET * x.sum[b]);
            let mut s1 = _mm256_setzero_si256();
            for g in 0..4 {
                // SAFETY: bytes 4g.. and 16+4g.. of the block's 32.
                let (xa, xb) =
                    unsafe { (q.add(g).read_unaligned(), q.add(4 + g).read_unaligned()) };
                s0 = _mm256_dpbusd_epi32(s0, w[g], _mm256_set1_epi32(xa));
                s1 = _mm256_dpbusd_epi32(s1, w[4 + g], _mm256_set1_epi32(xb));
            }
            let s = _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1));
            let d = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[b]));
            acc[r] = _mm256_fmadd_ps(s, d, acc[r]);
        }
    }
    std::array::from_fn(|r| {
        let mut out = [0f32; 8];
        // SAFETY: out holds eight floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc[r]) };
        out
    })
}

/// The 16 bytes at `p + j·stride` for rows `j` = 0..8 as four vectors, vector `g` holding in
/// lane `j` row `j`'s bytes `4g..4g+4`.
///
/// # Safety
/// Sixteen bytes must be readable at each of the eight addresses.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn transpose16(p: *const u8, stride: usize) -> [__m256i; 4] {
    // Rows j and j+4 share a register (low and high 128-bit halves); the in-lane unpacks
    // then transpose both halves at once.
    // SAFETY: forwarded from the caller.
    let pair = |j: usize| unsafe {
        _mm256_loadu2_m128i(
            p.add((j + 4) * stride) as *const __m128i,
            p.add(j * stride) as *const __m128i,
        )
    };
    let (r0, r1, r2, r3) = (pair(0), pair(1), pair(2), pair(3));
    let t0 = _mm256_unpacklo_epi32(r0, r1); // 0.0 1.0 0.1 1.1
    let t1 = _mm256_unpackhi_epi32(r0, r1); // 0.2 1.2 0.3 1.3
    let t2 = _mm256_unpacklo_epi32(r2, r3); // 2.0 3.0 2.1 3.1
    let t3 = _mm256_unpackhi_epi32(r2, r3); // 2.2 3.2 2.3 3.3
    [
        _mm256_unpacklo_epi64(t0, t2),
        _mm256_unpackhi_epi64(t0, t2),
        _mm256_unpacklo_epi64(t1, t3),
        _mm256_unpackhi_epi64(t1, t3),
    ]
}
