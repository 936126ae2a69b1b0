//! Matrix-vector products `y[n] = w[n, k] · x[k]` for decode, where every weight byte is read
//! once per token: memory bandwidth, not FLOPs, sets the speed. f16 weights (half the bytes
//! of f32) are widened to f32 in registers ([`gemv`]); bf16 weights multiply in bf16 as the
//! bf16 GEMM does ([`gemv_bf16`]: `x` rounded to bf16, `vdpbf16ps` where the CPU has
//! AVX512-BF16). AVX-512 kernels are chosen at run time; other CPUs use a portable loop.

use crate::gemm::WeightRef;
mod transposed;

pub use transposed::gemv_transposed;

use crate::gemm_bf16::Bf16Kernel;
use crate::{Element, round_to_bf16_bits};
use half::bf16;
use rayon::prelude::*;

/// Output rows handled by one rayon task.
const ROWS_PER_TASK: usize = 64;

/// `y[n] = w[n, k] · x[k]` (`+=` when `accumulate`), `n = y.len()`, `k = x.len()`.
///
/// # Panics
/// When `w.len() < y.len() * x.len()` (a caller bug).
pub fn gemv<W: Element + Widen>(w: &[W], x: &[f32], y: &mut [f32], accumulate: bool) {
    row_chunks(w, x.len(), y, Split::Tasks, |w, y| {
        dot_rows(w, x, y, accumulate)
    });
}

/// Whether a GEMV hands its output rows to rayon tasks or runs them on the calling thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Split {
    Tasks,
    Serial,
}

/// [`gemv`] or [`gemv_bf16`] (by `w`'s storage) on the calling thread: the same kernels and
/// sums, bit for bit, without handing rows to other threads — for products too small to pay
/// for that (a LoRA adapter's `A: [r, in]` or `B: [out, r]` on one token). Quantized blocks
/// take [`crate::gemm::matmul_weight_t`].
pub fn gemv_serial(w: WeightRef<'_>, x: &[f32], y: &mut [f32], accumulate: bool) {
    match w {
        WeightRef::F32(w) => dot_rows(&w[..y.len() * x.len()], x, y, accumulate),
        WeightRef::F16(w) => dot_rows(&w[..y.len() * x.len()], x, y, accumulate),
        WeightRef::BF16(w) => gemv_bf16_split(w, x, y, accumulate, Split::Serial),
        WeightRef::Quant(_) => {
            crate::gemm::matmul_weight_t(x, w, y, 1, y.len(), x.len(), accumulate)
        }
    }
}

/// `y[n] = w[n, k] · x[k]` (`+=` when `accumulate`) for bf16 weights, as bf16 x bf16 -> f32:
/// `x` is rounded to bf16 (nearest-even, as [`crate::gemm_bf16`] packs a matmul's activations
/// and as autocast casts them), every product is exact and the sums are f32 — so one token
/// decodes to the values a prefill of more rows computes, up to the order of the f32 sums.
/// AVX512-BF16 `vdpbf16ps` does 32 products per instruction (llama.cpp's BF16 `vec_dot`
/// does the same); without it, or for rows shorter than 32 (a LoRA adapter's `B: [out, r]`),
/// the rounded `x` goes through the widening kernel of [`gemv`].
///
/// # Panics
/// When `w.len() < y.len() * x.len()` (a caller bug).
pub fn gemv_bf16(w: &[bf16], x: &[f32], y: &mut [f32], accumulate: bool) {
    gemv_bf16_split(w, x, y, accumulate, Split::Tasks);
}

fn gemv_bf16_split(w: &[bf16], x: &[f32], y: &mut [f32], accumulate: bool, split: Split) {
    let k = x.len();
    let rounded = x.iter().map(|&v| round_to_bf16_bits(v));
    #[cfg(target_arch = "x86_64")]
    if k >= 32 && Bf16Kernel::available().contains(&Bf16Kernel::Avx512Bf16) {
        let xb: Vec<bf16> = rounded.map(bf16::from_bits).collect();
        row_chunks(w, x.len(), y, split, |w, y| {
            // SAFETY: the CPU has AVX512F and AVX512-BF16 (checked above).
            unsafe { avx512::dot_rows_bf16(w, &xb, y, accumulate) }
        });
        return;
    }
    let xr: Vec<f32> = rounded
        .map(|b| f32::from_bits(u32::from(b) << 16))
        .collect();
    row_chunks(w, x.len(), y, split, |w, y| dot_rows(w, &xr, y, accumulate));
}

/// `y[m, n] = x[m, k] · wᵀ` (`+=` when `accumulate`) for a few activation rows (batched
/// decode): every weight row is read from memory once and multiplied by all `m` rows while
/// it sits in L1, each product by the one-row kernel of [`gemv`] / [`gemv_bf16`] — so row `r`
/// of `y` is bit for bit what a GEMV of row `r` alone computes, whatever `m` is (a served
/// request's decode does not depend on what it is batched with).
///
/// # Panics
/// When a slice is shorter than its shape (a caller bug).
pub fn gemv_rows<W: Element + Widen>(
    w: &[W],
    x: &[f32],
    y: &mut [f32],
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
) {
    assert!(x.len() >= m * k && y.len() >= m * n);
    #[cfg(target_arch = "x86_64")]
    let avx512 = std::arch::is_x86_feature_detected!("avx512f");
    // Per block of weight rows: four activation rows at a time (they stay in L1) against
    // every weight row of the block (which stays in L2 for the next four).
    let dots = |wb: &[W], out: &mut [f32]| {
        let rows = out.len() / m;
        let mut r = 0;
        #[cfg(target_arch = "x86_64")]
        while avx512 && r + 4 <= m {
            let xs = std::array::from_fn(|i| &x[(r + i) * k..(r + i + 1) * k]);
            for j in 0..rows {
                let o: &mut [f32; 4] = (&mut out[j * m + r..j * m + r + 4]).try_into().expect("4");
                // SAFETY: the CPU supports AVX-512F (checked above).
                unsafe { avx512::dot_row_x4(&wb[j * k..(j + 1) * k], xs, o) };
            }
            r += 4;
        }
        for i in r..m {
            for j in 0..rows {
                let o = std::slice::from_mut(&mut out[j * m + i]);
                dot_rows(&wb[j * k..(j + 1) * k], &x[i * k..(i + 1) * k], o, false);
            }
        }
    };
    multi_rows(w, y, (m, n, k), accumulate, dots);
}

/// [`gemv_rows`] for bf16 weights: the activation rows rounded to bf16 once, each product
/// the one-row kernel of [`gemv_bf16`].
///
/// # Panics
/// When a slice is shorter than its shape (a caller bug).
pub fn gemv_rows_bf16(
    w: &[bf16],
    x: &[f32],
    y: &mut [f32],
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
) {
    assert!(x.len() >= m * k && y.len() >= m * n);
    let rounded = x[..m * k].iter().map(|&v| round_to_bf16_bits(v));
    #[cfg(target_arch = "x86_64")]
    if k >= 32 && Bf16Kernel::available().contains(&Bf16Kernel::Avx512Bf16) {
        let xb: Vec<bf16> = rounded.map(bf16::from_bits).collect();
        let dots = |wb: &[bf16], out: &mut [f32]| {
            let rows = out.len() / m;
            let mut r = 0;
            while r + 4 <= m {
                let xs = std::array::from_fn(|i| &xb[(r + i) * k..(r + i + 1) * k]);
                for j in 0..rows {
                    let o: &mut [f32; 4] =
                        (&mut out[j * m + r..j * m + r + 4]).try_into().expect("4");
                    // SAFETY: the CPU has AVX512F and AVX512-BF16 (checked above).
                    unsafe { avx512::dot_row_x4_bf16(&wb[j * k..(j + 1) * k], xs, o) };
                }
                r += 4;
            }
            for i in r..m {
                for j in 0..rows {
                    let (wj, xr) = (&wb[j * k..(j + 1) * k], &xb[i * k..(i + 1) * k]);
                    let o = std::slice::from_mut(&mut out[j * m + i]);
                    // SAFETY: as above.
                    unsafe { avx512::dot_rows_bf16(wj, xr, o, false) };
                }
            }
        };
        multi_rows(w, y, (m, n, k), accumulate, dots);
        return;
    }
    let xr: Vec<f32> = rounded
        .map(|b| f32::from_bits(u32::from(b) << 16))
        .collect();
    gemv_rows(w, &xr, y, (m, n, k), accumulate);
}

/// Runs `dots(w_block, out)` (out: `[rows, m]`, the block's products) for blocks of
/// [`ROWS_PER_TASK`] weight rows on rayon tasks; each task writes its block's columns of
/// every row of `y[m, n]`.
fn multi_rows<W: Sync>(
    w: &[W],
    y: &mut [f32],
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
    dots: impl Fn(&[W], &mut [f32]) + Sync,
) {
    assert!(w.len() >= n * k && m > 0);
    // Task t's columns of each of the m rows of y.
    let mut rows: Vec<_> = y[..m * n]
        .chunks_exact_mut(n)
        .map(|r| r.chunks_mut(ROWS_PER_TASK))
        .collect();
    let tasks: Vec<Vec<&mut [f32]>> = (0..n.div_ceil(ROWS_PER_TASK))
        .map(|_| {
            rows.iter_mut()
                .map(|r| r.next().expect("n columns"))
                .collect()
        })
        .collect();
    tasks.into_par_iter().enumerate().for_each(|(t, mut cols)| {
        let (row0, len) = (t * ROWS_PER_TASK, cols[0].len());
        let mut out = vec![0f32; len * m];
        dots(&w[row0 * k..(row0 + len) * k], &mut out);
        for (r, col) in cols.iter_mut().enumerate() {
            for (j, y) in col.iter_mut().enumerate() {
                let v = out[j * m + r];
                *y = if accumulate { *y + v } else { v };
            }
        }
    });
}

/// Runs `rows(w_chunk, y_chunk)` on rayon tasks of [`ROWS_PER_TASK`] output rows, each with
/// its rows of `w` (`k` elements each).
///
/// # Panics
/// When `w.len() < y.len() * k` (a caller bug).
fn row_chunks<W: Sync>(
    w: &[W],
    k: usize,
    y: &mut [f32],
    split: Split,
    rows: impl Fn(&[W], &mut [f32]) + Sync,
) {
    assert!(w.len() >= y.len() * k);
    if split == Split::Serial {
        return rows(&w[..y.len() * k], y);
    }
    y.par_chunks_mut(ROWS_PER_TASK)
        .enumerate()
        .for_each(|(t, y_chunk)| {
            let row0 = t * ROWS_PER_TASK;
            rows(&w[row0 * k..(row0 + y_chunk.len()) * k], y_chunk);
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

    /// One row at a time, front to back, four accumulators (64 weights per step). Reading each
    /// row contiguously lets the hardware prefetcher stream the weights: measured 1.8x faster
    /// than interleaving 8 rows (which stalls on load latency), and software prefetch only hurt.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dot_rows<W: Element + Widen>(
        w: &[W],
        x: &[f32],
        y: &mut [f32],
        accumulate: bool,
    ) {
        let k = x.len();
        let k64 = k / 64 * 64;
        let k16 = k / 16 * 16;
        assert!(w.len() >= y.len() * k);
        let xp = x.as_ptr();
        for (j, yj) in y.iter_mut().enumerate() {
            let row = &w[j * k..(j + 1) * k];
            let rp = row.as_ptr();
            let mut acc = [_mm512_setzero_ps(); 4];
            let mut p = 0;
            // SAFETY: every load below reads 16 elements at p + o < k16 <= k of row and x.
            unsafe {
                while p < k64 {
                    for (o, a) in acc.iter_mut().enumerate() {
                        let q = p + 16 * o;
                        *a = _mm512_fmadd_ps(W::load16(rp.add(q)), _mm512_loadu_ps(xp.add(q)), *a);
                    }
                    p += 64;
                }
                while p < k16 {
                    acc[0] =
                        _mm512_fmadd_ps(W::load16(rp.add(p)), _mm512_loadu_ps(xp.add(p)), acc[0]);
                    p += 16;
                }
            }
            let tail = (k16..k).map(|q| row[q].to_f32() * x[q]).sum();
            finish(acc, tail, yj, accumulate);
        }
    }

    /// [`dot_rows`] for bf16 rows and a bf16 `x`: `vdpbf16ps` multiplies 32 consecutive
    /// elements of a row by those of `x` (pairs `(2i, 2i+1)` add into f32 lane `i`), four
    /// accumulators (128 weights per step); the tail in scalar f32 (exact products).
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn dot_rows_bf16(w: &[bf16], x: &[bf16], y: &mut [f32], accumulate: bool) {
        let k = x.len();
        let k128 = k / 128 * 128;
        let k32 = k / 32 * 32;
        assert!(w.len() >= y.len() * k);
        let xp = x.as_ptr();
        for (j, yj) in y.iter_mut().enumerate() {
            let row = &w[j * k..(j + 1) * k];
            let rp = row.as_ptr();
            let mut acc = [_mm512_setzero_ps(); 4];
            let mut p = 0;
            // SAFETY: every load below reads 32 elements at p + o < k32 <= k of row and x.
            unsafe {
                while p < k128 {
                    for (o, a) in acc.iter_mut().enumerate() {
                        let q = p + 32 * o;
                        *a = _mm512_dpbf16_ps(*a, load32(rp.add(q)), load32(xp.add(q)));
                    }
                    p += 128;
                }
                while p < k32 {
                    acc[0] = _mm512_dpbf16_ps(acc[0], load32(rp.add(p)), load32(xp.add(p)));
                    p += 32;
                }
            }
            let tail = (k32..k).map(|q| row[q].to_f32() * x[q].to_f32()).sum();
            finish(acc, tail, yj, accumulate);
        }
    }

    /// One weight row `w[k]` times four activation rows: each row's sum in exactly the
    /// order of [`dot_rows`] (the same four accumulators over the same 64-element steps, the
    /// same tail), so the results are bit-identical to four [`dot_rows`] calls, but every
    /// weight vector is loaded once for the four products.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dot_row_x4<W: Element + Widen>(w: &[W], x: [&[f32]; 4], y: &mut [f32; 4]) {
        let k = w.len();
        let (k64, k16) = (k / 64 * 64, k / 16 * 16);
        assert!(x.iter().all(|r| r.len() >= k));
        let rp = w.as_ptr();
        let mut acc = [[_mm512_setzero_ps(); 4]; 4];
        let mut p = 0;
        // SAFETY: every load reads 16 elements at p + o < k16 <= k of w and of each x row.
        unsafe {
            while p < k64 {
                for o in 0..4 {
                    let q = p + 16 * o;
                    let wv = W::load16(rp.add(q));
                    for (a, xr) in acc.iter_mut().zip(&x) {
                        a[o] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xr.as_ptr().add(q)), a[o]);
                    }
                }
                p += 64;
            }
            while p < k16 {
                let wv = W::load16(rp.add(p));
                for (a, xr) in acc.iter_mut().zip(&x) {
                    a[0] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xr.as_ptr().add(p)), a[0]);
                }
                p += 16;
            }
        }
        for ((a, xr), yr) in acc.into_iter().zip(&x).zip(y.iter_mut()) {
            let tail = (k16..k).map(|q| w[q].to_f32() * xr[q]).sum();
            finish(a, tail, yr, false);
        }
    }

    /// [`dot_row_x4`] for bf16: bit-identical to four [`dot_rows_bf16`] calls.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn dot_row_x4_bf16(w: &[bf16], x: [&[bf16]; 4], y: &mut [f32; 4]) {
        let k = w.len();
        let (k128, k32) = (k / 128 * 128, k / 32 * 32);
        assert!(x.iter().all(|r| r.len() >= k));
        let rp = w.as_ptr();
        let mut acc = [[_mm512_setzero_ps(); 4]; 4];
        let mut p = 0;
        // SAFETY: every load reads 32 elements at p + o < k32 <= k of w and of each x row.
        unsafe {
            while p < k128 {
                for o in 0..4 {
                    let q = p + 32 * o;
                    let wv = load32(rp.add(q));
                    for (a, xr) in acc.iter_mut().zip(&x) {
                        a[o] = _mm512_dpbf16_ps(a[o], wv, load32(xr.as_ptr().add(q)));
                    }
                }
                p += 128;
            }
            while p < k32 {
                let wv = load32(rp.add(p));
                for (a, xr) in acc.iter_mut().zip(&x) {
                    a[0] = _mm512_dpbf16_ps(a[0], wv, load32(xr.as_ptr().add(p)));
                }
                p += 32;
            }
        }
        for ((a, xr), yr) in acc.into_iter().zip(&x).zip(y.iter_mut()) {
            let tail = (k32..k).map(|q| w[q].to_f32() * xr[q].to_f32()).sum();
            finish(a, tail, yr, false);
        }
    }

    /// The row's dot product — the four accumulators' lanes plus the scalar `tail` — into
    /// `y` (`+=` when `accumulate`).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn finish(acc: [__m512; 4], tail: f32, y: &mut f32, accumulate: bool) {
        let sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        let s = _mm512_reduce_add_ps(sum) + tail;
        *y = if accumulate { *y + s } else { s };
    }

    /// 32 bf16 at `p` as a `vdpbf16ps` operand.
    ///
    /// # Safety
    /// `p..p+32` is readable and the CPU has AVX512F and AVX512-BF16.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn load32(p: *const bf16) -> __m512bh {
        // SAFETY: 32 readable bf16 (caller) are the 512 bits of a __m512bh.
        unsafe { std::mem::transmute(_mm512_loadu_si512(p.cast())) }
    }
}

#[cfg(test)]
mod tests;
