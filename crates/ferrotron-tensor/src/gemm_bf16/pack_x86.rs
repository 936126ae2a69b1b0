//! AVX-512 packing (AVX512F + AVX512BW) into the panel layouts of [`super::pack`]: 32 values
//! at a time, f32 rounded to bf16 with the same integer arithmetic as
//! [`crate::round_to_bf16_bits`] (so results are bit-identical to the scalar packers, denormals
//! and NaNs included; `vcvtneps2bf16` would flush denormals), every element of the panels
//! written once (padding as zeros, no separate clearing pass).
//!
//! The four cases, by how the stored matrix meets the panel:
//! - A `Op::N` (`[m, k]`): panel rows are stored rows: convert and copy.
//! - A `Op::T` (`[k, m]`) and B `Op::T` (`[n, k]`): the panel runs across the stored rows:
//!   build `(p, p+1)` pairs as 32-bit words and transpose 16 × 16 blocks of them.
//! - B `Op::N` (`[k, n]`): pair-rows interleave two stored rows (one `vpermt2w` per 16
//!   columns).

use super::pack::{MR, NR};
use crate::gemm::Op;
use half::bf16;
use std::arch::x86_64::*;
use std::ops::Range;

/// Whether this CPU runs these packers.
pub fn available() -> bool {
    is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
}

/// A stored element type that loads as 32 bf16 at a time.
pub trait Load32: Copy {
    /// `count` (≤ 32) stored values from `ptr` as bf16 bits in the low `count` 16-bit lanes of
    /// the result, zero above.
    ///
    /// # Safety
    /// [`available`]; `ptr .. ptr + count` is readable.
    unsafe fn load32(ptr: *const Self, count: usize) -> __m512i;
}

impl Load32 for f32 {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn load32(ptr: *const f32, count: usize) -> __m512i {
        let lo_mask = low_mask16(count.min(16));
        let hi_mask = low_mask16(count.saturating_sub(16));
        // SAFETY: masked loads touch only the first `count` elements (caller: readable).
        let (lo, hi) = unsafe {
            (
                _mm512_maskz_loadu_ps(lo_mask, ptr),
                _mm512_maskz_loadu_ps(hi_mask, ptr.wrapping_add(16)),
            )
        };
        let lo = _mm512_cvtepi32_epi16(round_to_bf16(_mm512_castps_si512(lo)));
        let hi = _mm512_cvtepi32_epi16(round_to_bf16(_mm512_castps_si512(hi)));
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
    }
}

impl Load32 for bf16 {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn load32(ptr: *const bf16, count: usize) -> __m512i {
        let mask = if count >= 32 {
            u32::MAX
        } else {
            (1u32 << count) - 1
        };
        // SAFETY: the masked load touches only the first `count` elements (caller).
        unsafe { _mm512_maskz_loadu_epi16(mask, ptr.cast()) }
    }
}

fn low_mask16(count: usize) -> u16 {
    if count >= 16 {
        u16::MAX
    } else {
        (1u16 << count) - 1
    }
}

/// Sixteen f32 (as bits) → the bits of their nearest bf16 in the low half of each 32-bit lane:
/// [`crate::round_to_bf16_bits`] lane by lane.
#[inline]
#[target_feature(enable = "avx512f")]
fn round_to_bf16(bits: __m512i) -> __m512i {
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
    let bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
    let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, bias));
    let abs = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fff_ffff));
    let nan = _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7f80_0000));
    let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(0x0040));
    _mm512_mask_blend_epi32(nan, rounded, quiet)
}

/// The 16-bit lanes of `r0` and `r1` interleaved: `(lo, hi)` with `lo = [r0[0], r1[0], …,
/// r0[15], r1[15]]` and `hi` the same for lanes 16..32 — sixteen `(r0, r1)` pairs as 32-bit
/// words each.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn interleave16(r0: __m512i, r1: __m512i) -> (__m512i, __m512i) {
    let lo_idx: [u16; 32] = std::array::from_fn(|l| (l / 2 + 32 * (l % 2)) as u16);
    let hi_idx: [u16; 32] = std::array::from_fn(|l| (16 + l / 2 + 32 * (l % 2)) as u16);
    // SAFETY: 64-byte arrays read as vectors.
    let (lo_idx, hi_idx) = unsafe {
        (
            _mm512_loadu_si512(lo_idx.as_ptr().cast()),
            _mm512_loadu_si512(hi_idx.as_ptr().cast()),
        )
    };
    (
        _mm512_permutex2var_epi16(r0, lo_idx, r1),
        _mm512_permutex2var_epi16(r0, hi_idx, r1),
    )
}

/// Transposes 16 vectors of 16 32-bit lanes in place: afterwards `r[i]` lane `j` is what
/// `r[j]` lane `i` was.
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose16(r: &mut [__m512i; 16]) {
    let mut t = [_mm512_setzero_si512(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for g in 0..4 {
        let b = 4 * g;
        r[b] = _mm512_unpacklo_epi64(t[b], t[b + 2]);
        r[b + 1] = _mm512_unpackhi_epi64(t[b], t[b + 2]);
        r[b + 2] = _mm512_unpacklo_epi64(t[b + 1], t[b + 3]);
        r[b + 3] = _mm512_unpackhi_epi64(t[b + 1], t[b + 3]);
    }
    for h in 0..2 {
        let b = 8 * h;
        for c in 0..4 {
            t[b + c] = _mm512_shuffle_i32x4::<0x88>(r[b + c], r[b + 4 + c]);
            t[b + 4 + c] = _mm512_shuffle_i32x4::<0xdd>(r[b + c], r[b + 4 + c]);
        }
    }
    for c in 0..8 {
        r[c] = _mm512_shuffle_i32x4::<0x88>(t[c], t[8 + c]);
        r[8 + c] = _mm512_shuffle_i32x4::<0xdd>(t[c], t[8 + c]);
    }
}

/// A row-major stored matrix of `cols` columns.
#[derive(Clone, Copy)]
struct Stored<'a, T> {
    data: &'a [T],
    cols: usize,
}

impl<T: Load32> Stored<'_, T> {
    /// Up to 32 values of stored row `row` from column `col`, `count` of them real (zero when
    /// `count` is 0).
    ///
    /// # Safety
    /// [`available`].
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn load(&self, row: usize, col: usize, count: usize) -> __m512i {
        if count == 0 {
            return _mm512_setzero_si512();
        }
        let at = row * self.cols + col;
        assert!(col + count <= self.cols && at + count <= self.data.len());
        // SAFETY: `at .. at + count` lies inside `data` (asserted).
        unsafe { T::load32(self.data.as_ptr().add(at), count) }
    }
}

/// [`super::pack::pack_a`] of `op(a)`, `a` stored `[m, k]` (`Op::N`) or `[k, m]` (`Op::T`).
///
/// # Safety
/// [`available`]; `dst` holds the panels.
pub unsafe fn pack_a<T: Load32>(
    data: &[T],
    op: Op,
    (m, k): (usize, usize),
    rows: Range<usize>,
    cols: Range<usize>,
    kcp: usize,
    dst: &mut [u16],
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match op {
            Op::N => pack_a_n(Stored { data, cols: k }, rows, cols, kcp, dst),
            Op::T => pack_a_t(Stored { data, cols: m }, rows, cols, kcp, dst),
        }
    }
}

/// [`super::pack::pack_b`] of `op(b)`, `b` stored `[k, n]` (`Op::N`) or `[n, k]` (`Op::T`).
///
/// # Safety
/// [`available`]; `dst` holds the panels.
pub unsafe fn pack_b<T: Load32>(
    data: &[T],
    op: Op,
    (k, n): (usize, usize),
    rows: Range<usize>,
    cols: Range<usize>,
    kcp: usize,
    dst: &mut [u16],
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match op {
            Op::N => pack_b_n(Stored { data, cols: n }, rows, cols, kcp, dst),
            Op::T => pack_b_t(Stored { data, cols: k }, rows, cols, kcp, dst),
        }
    }
}

/// How many of the 32 positions from `start` fall before `end`.
fn valid(start: usize, end: usize) -> usize {
    end.saturating_sub(start).min(32)
}

/// A panels from `op(a) = a` stored `[m, k]`: rows `rows` × columns `cols` into
/// `ceil(rows.len()/MR)` panels of `[MR][kcp]`.
///
/// # Safety
/// [`available`]; `dst` holds the panels.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_a_n<T: Load32>(
    a: Stored<'_, T>,
    rows: Range<usize>,
    cols: Range<usize>,
    kcp: usize,
    dst: &mut [u16],
) {
    let height = rows.len().next_multiple_of(MR);
    assert!(dst.len() >= height * kcp && kcp.is_multiple_of(32));
    for i in 0..height {
        let r = rows.start + i;
        for c0 in (0..kcp).step_by(32) {
            let count = if r < rows.end {
                valid(c0, cols.len())
            } else {
                0
            };
            // SAFETY: loads checked inside; the store lies in row i of the panels (asserted).
            unsafe {
                let v = a.load(r, cols.start + c0, count);
                _mm512_storeu_si512(dst.as_mut_ptr().add(i * kcp + c0).cast(), v);
            }
        }
    }
}

/// A panels from `op(a) = aᵀ`, `a` stored `[k, m]`: (row `i`, depth `p`) of the panel is
/// stored element `(p, i)`.
///
/// # Safety
/// [`available`]; `dst` holds the panels.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_a_t<T: Load32>(
    a: Stored<'_, T>,
    rows: Range<usize>,
    depth: Range<usize>,
    kcp: usize,
    dst: &mut [u16],
) {
    let height = rows.len().next_multiple_of(MR);
    assert!(dst.len() >= height * kcp && kcp.is_multiple_of(32));
    for i0 in (0..height).step_by(32) {
        let i_count = valid(i0, rows.len());
        for p0 in (0..kcp).step_by(32) {
            let mut lo = [_mm512_setzero_si512(); 16];
            let mut hi = [_mm512_setzero_si512(); 16];
            for q in 0..16 {
                let p = p0 + 2 * q;
                let at = |p: usize| if p < depth.len() { i_count } else { 0 };
                // SAFETY: loads checked inside.
                let (r0, r1) = unsafe {
                    (
                        a.load(depth.start + p, rows.start + i0, at(p)),
                        a.load(depth.start + p + 1, rows.start + i0, at(p + 1)),
                    )
                };
                (lo[q], hi[q]) = interleave16(r0, r1);
            }
            transpose16(&mut lo);
            transpose16(&mut hi);
            for (half, rows16) in [lo, hi].iter().enumerate() {
                for (ii, v) in rows16.iter().enumerate() {
                    let i = i0 + 16 * half + ii;
                    // SAFETY: inside row i of the panels (asserted above).
                    unsafe { _mm512_storeu_si512(dst.as_mut_ptr().add(i * kcp + p0).cast(), *v) };
                }
            }
        }
    }
}

/// B panels from `op(b) = b` stored `[k, n]`: pair-row `pp` of a panel interleaves stored rows
/// `2pp` and `2pp + 1`.
///
/// # Safety
/// [`available`]; `dst` holds the panels.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_b_n<T: Load32>(
    b: Stored<'_, T>,
    depth: Range<usize>,
    cols: Range<usize>,
    kcp: usize,
    dst: &mut [u16],
) {
    let panels = cols.len().div_ceil(NR);
    assert!(dst.len() >= panels * NR * kcp && NR == 32 && kcp.is_multiple_of(2));
    for jp in 0..panels {
        let j_count = valid(jp * NR, cols.len());
        for pp in 0..kcp / 2 {
            let at = |p: usize| if p < depth.len() { j_count } else { 0 };
            let col = cols.start + jp * NR;
            // SAFETY: loads checked inside; the stores fill pair-row pp of panel jp.
            unsafe {
                let r0 = b.load(depth.start + 2 * pp, col, at(2 * pp));
                let r1 = b.load(depth.start + 2 * pp + 1, col, at(2 * pp + 1));
                let (lo, hi) = interleave16(r0, r1);
                let out = dst.as_mut_ptr().add(jp * NR * kcp + pp * 2 * NR);
                _mm512_storeu_si512(out.cast(), lo);
                _mm512_storeu_si512(out.add(32).cast(), hi);
            }
        }
    }
}

/// B panels from `op(b) = bᵀ`, `b` stored `[n, k]`: the `(p, p+1)` pair of column `j` is two
/// adjacent stored values of row `j`; 16 columns' pairs are transposed into pair-rows.
///
/// # Safety
/// [`available`]; `dst` holds the panels.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_b_t<T: Load32>(
    b: Stored<'_, T>,
    depth: Range<usize>,
    cols: Range<usize>,
    kcp: usize,
    dst: &mut [u16],
) {
    let panels = cols.len().div_ceil(NR);
    assert!(dst.len() >= panels * NR * kcp && NR == 32 && kcp.is_multiple_of(32));
    for jp in 0..panels {
        for half in 0..2 {
            let j0 = jp * NR + 16 * half;
            for p0 in (0..kcp).step_by(32) {
                let p_count = valid(p0, depth.len());
                let mut v: [__m512i; 16] = std::array::from_fn(|jj| {
                    let count = if j0 + jj < cols.len() { p_count } else { 0 };
                    // SAFETY: loads checked inside.
                    unsafe { b.load(cols.start + j0 + jj, depth.start + p0, count) }
                });
                transpose16(&mut v);
                for (q, pair_row) in v.iter().enumerate() {
                    let at = jp * NR * kcp + (p0 / 2 + q) * 2 * NR + 32 * half;
                    // SAFETY: inside panel jp (asserted above).
                    unsafe { _mm512_storeu_si512(dst.as_mut_ptr().add(at).cast(), *pair_row) };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose16_transposes() {
        if !available() {
            return;
        }
        let mut m: [[u32; 16]; 16] =
            std::array::from_fn(|i| std::array::from_fn(|j| (i * 16 + j) as u32));
        // SAFETY: AVX-512 checked above; 64-byte rows read and written as vectors.
        unsafe {
            let mut r: [__m512i; 16] =
                std::array::from_fn(|i| _mm512_loadu_si512(m[i].as_ptr().cast()));
            transpose16(&mut r);
            for (i, v) in r.iter().enumerate() {
                _mm512_storeu_si512(m[i].as_mut_ptr().cast(), *v);
            }
        }
        for (i, row) in m.iter().enumerate() {
            for (j, &x) in row.iter().enumerate() {
                assert_eq!(x, (j * 16 + i) as u32, "({i}, {j})");
            }
        }
    }
}
