//! Matrix-vector products `y[n] = w[n, k] · x[k]` for decode, where every weight byte is read
//! once per token: memory bandwidth, not FLOPs, sets the speed, so bf16/f16 weights (half the
//! bytes of f32) are widened to f32 in registers. AVX-512 kernels are chosen at run time;
//! other CPUs use a portable loop.

use crate::Element;
use rayon::prelude::*;

/// Output rows handled by one rayon task.
const ROWS_PER_TASK: usize = 64;

/// `y[n] = w[n, k] · x[k]` (`+=` when `accumulate`), `n = y.len()`, `k = x.len()`.
///
/// # Panics
/// When `w.len() < y.len() * x.len()` (a caller bug).
pub fn gemv<W: Element + Widen>(w: &[W], x: &[f32], y: &mut [f32], accumulate: bool) {
    let k = x.len();
    assert!(w.len() >= y.len() * k);
    y.par_chunks_mut(ROWS_PER_TASK)
        .enumerate()
        .for_each(|(t, y_chunk)| {
            let row0 = t * ROWS_PER_TASK;
            let w_chunk = &w[row0 * k..(row0 + y_chunk.len()) * k];
            dot_rows(w_chunk, x, y_chunk, accumulate);
        });
}

fn dot_rows<W: Element + Widen>(w: &[W], x: &[f32], y: &mut [f32], accumulate: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F (checked above).
            unsafe { avx512::dot_rows(w, x, y, accumulate) };
            return;
        }
    }
    dot_rows_portable(w, x, y, accumulate);
}

fn dot_rows_portable<W: Element>(w: &[W], x: &[f32], y: &mut [f32], accumulate: bool) {
    let k = x.len();
    for (j, yj) in y.iter_mut().enumerate() {
        let row = &w[j * k..(j + 1) * k];
        let mut acc = [0f32; 8];
        let mut chunks = row.chunks_exact(8);
        let mut xs = x.chunks_exact(8);
        for (wc, xc) in (&mut chunks).zip(&mut xs) {
            for l in 0..8 {
                acc[l] += wc[l].to_f32() * xc[l];
            }
        }
        let mut s: f32 = acc.iter().sum();
        for (wv, xv) in chunks.remainder().iter().zip(xs.remainder()) {
            s += wv.to_f32() * xv;
        }
        *yj = if accumulate { *yj + s } else { s };
    }
}

/// Storage types the AVX-512 kernel can widen to 16 f32 lanes.
pub trait Widen: Copy {
    /// Loads 16 consecutive elements at `p` as f32 lanes.
    ///
    /// # Safety
    /// `p..p+16` must be readable and the CPU must support AVX-512F.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::Widen;
    use crate::Element;
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    impl Widen for f32 {
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load16(p: *const f32) -> __m512 {
            unsafe { _mm512_loadu_ps(p) }
        }
    }

    impl Widen for bf16 {
        /// bf16 is the top half of an f32: zero-extend to 32 bits and shift left by 16.
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load16(p: *const bf16) -> __m512 {
            unsafe {
                let h = _mm256_loadu_si256(p as *const __m256i);
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            }
        }
    }

    impl Widen for f16 {
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load16(p: *const f16) -> __m512 {
            unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
        }
    }

    /// Rows in blocks of `R` (8, then 1 for the tail), two accumulators per row, so all
    /// accumulators stay in registers and each `x` load feeds `R` weight streams.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dot_rows<W: Element + Widen>(
        w: &[W],
        x: &[f32],
        y: &mut [f32],
        accumulate: bool,
    ) {
        let n = y.len();
        let mut j = 0;
        while j + 8 <= n {
            // SAFETY: rows j..j+8 exist (checked by the loop condition).
            unsafe { block::<8, W>(w, x, &mut y[j..j + 8], j, accumulate) };
            j += 8;
        }
        while j < n {
            // SAFETY: row j exists.
            unsafe { block::<1, W>(w, x, &mut y[j..j + 1], j, accumulate) };
            j += 1;
        }
    }

    /// `y[r] (+)= w[j0 + r, :] · x` for `r < R`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn block<const R: usize, W: Element + Widen>(
        w: &[W],
        x: &[f32],
        y: &mut [f32],
        j0: usize,
        accumulate: bool,
    ) {
        let k = x.len();
        let k32 = k / 32 * 32;
        debug_assert!(w.len() >= (j0 + R) * k && y.len() == R);
        let wp = w.as_ptr();
        let xp = x.as_ptr();
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        let mut p = 0;
        while p < k32 {
            // SAFETY: p + 32 <= k and rows j0..j0+R lie inside w.
            unsafe {
                let x0 = _mm512_loadu_ps(xp.add(p));
                let x1 = _mm512_loadu_ps(xp.add(p + 16));
                for (r, a) in acc.iter_mut().enumerate() {
                    let row = wp.add((j0 + r) * k + p);
                    a[0] = _mm512_fmadd_ps(W::load16(row), x0, a[0]);
                    a[1] = _mm512_fmadd_ps(W::load16(row.add(16)), x1, a[1]);
                }
            }
            p += 32;
        }
        for (r, a) in acc.iter().enumerate() {
            let mut s = _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1]));
            let row = &w[(j0 + r) * k..(j0 + r + 1) * k];
            for q in k32..k {
                s += row[q].to_f32() * x[q];
            }
            y[r] = if accumulate { y[r] + s } else { s };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn kernels_match_portable_path_with_ragged_sizes() {
        for (n, k) in [(1, 1), (7, 33), (130, 576), (5, 100)] {
            let w: Vec<f32> = (0..n * k)
                .map(|i| ((i * 7919) % 211) as f32 / 100.0 - 1.0)
                .collect();
            let x: Vec<f32> = (0..k).map(|i| ((i * 31) % 17) as f32 / 8.0 - 1.0).collect();
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
            let mut want = vec![0f32; n];
            dot_rows_portable(&w, &x, &mut want, false);
            let mut got = vec![0.5f32; n];
            gemv(&w, &x, &mut got, true);
            for (g, w) in got.iter().zip(&want) {
                assert!((g - (w + 0.5)).abs() < 1e-4 * (1.0 + w.abs()));
            }
            let mut want_b = vec![0f32; n];
            dot_rows_portable(&wb, &x, &mut want_b, false);
            gemv(&wb, &x, &mut got, false);
            for (g, w) in got.iter().zip(&want_b) {
                assert!((g - w).abs() < 1e-4 * (1.0 + w.abs()));
            }
            let mut want_h = vec![0f32; n];
            dot_rows_portable(&wh, &x, &mut want_h, false);
            gemv(&wh, &x, &mut got, false);
            for (g, w) in got.iter().zip(&want_h) {
                assert!((g - w).abs() < 1e-4 * (1.0 + w.abs()));
            }
        }
    }
}
