//! `y[m, n] += x[m, k] · wt[k, n]` for a short `k` with the weight stored `k`-major (a LoRA
//! adapter's `Bᵀ: [r, out]`, `r` a few dozen): each output is a sum of `k` products, taken
//! in order `j = 0, 1, ..` with fused multiply-adds into an accumulator that starts at 0 and
//! is then added to `y`. Each step reads one contiguous weight row and updates 16 outputs
//! per instruction — no horizontal reduction per output, which is what makes a dot-product
//! GEMV slow at this shape. The AVX-512 kernel and the portable loop perform the same
//! roundings in the same order, so they agree bit for bit.

use super::Widen;
use crate::Element;
use crate::gemm::WeightRef;

/// `y[m, n] += x[m, k] · wt[k, n]` (see the module doc), `wt` dense (f32, bf16 or f16).
///
/// # Panics
/// When a slice is shorter than its shape, or `wt` is quantized (a caller bug).
pub fn gemv_transposed(
    wt: WeightRef<'_>,
    x: &[f32],
    y: &mut [f32],
    (m, n, k): (usize, usize, usize),
) {
    assert!(x.len() >= m * k && y.len() >= m * n);
    match wt {
        WeightRef::F32(w) => rows(w, x, y, (m, n, k)),
        WeightRef::BF16(w) => rows(w, x, y, (m, n, k)),
        WeightRef::F16(w) => rows(w, x, y, (m, n, k)),
        WeightRef::Quant(_) => panic!("gemv_transposed takes a dense weight"),
    }
}

fn rows<W: Element + Widen>(w: &[W], x: &[f32], y: &mut [f32], (m, n, k): (usize, usize, usize)) {
    assert!(w.len() >= k * n);
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F (checked above).
        unsafe { avx512::rows(w, &x[..m * k], &mut y[..m * n], k) };
        return;
    }
    for (xr, yr) in x.chunks_exact(k).zip(y.chunks_exact_mut(n)).take(m) {
        row_portable(w, xr, yr);
    }
}

/// One output row: `y[n] += Σ_j x[j]·wt[j, :]`, the sum in `j` order with fused
/// multiply-adds.
fn row_portable<W: Element>(w: &[W], x: &[f32], y: &mut [f32]) {
    let n = y.len();
    let mut acc = vec![0f32; n];
    for (j, &xj) in x.iter().enumerate() {
        for (a, wv) in acc.iter_mut().zip(&w[j * n..(j + 1) * n]) {
            *a = xj.mul_add(wv.to_f32(), *a);
        }
    }
    y.iter_mut().zip(&acc).for_each(|(yv, a)| *yv += a);
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::Widen;
    use crate::Element;
    use std::arch::x86_64::*;

    /// [`super::row_portable`] of every row, 16 outputs per vector (the tail masked): for
    /// each block of 64 outputs, all rows in turn, so the block's `k × 64` weights are read
    /// from memory once and from L1 for the other rows.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn rows<W: Element + Widen>(w: &[W], x: &[f32], y: &mut [f32], k: usize) {
        let n = y.len() / (x.len() / k);
        let n16 = n / 16 * 16;
        let wp = w.as_ptr();
        let mut o = 0;
        // SAFETY: loads read 16 elements at j·n + o + 16q < j·n + n16 <= k·n of w, and
        // stores write them at r·n + o + 16q < r·n + n16 of y.
        unsafe {
            while o < n16 {
                let width = (n16 - o).min(64) / 16;
                for (xr, yr) in x.chunks_exact(k).zip(y.chunks_exact_mut(n)) {
                    let mut acc = [_mm512_setzero_ps(); 4];
                    for (j, &xj) in xr.iter().enumerate() {
                        let xv = _mm512_set1_ps(xj);
                        for (q, a) in acc.iter_mut().enumerate().take(width) {
                            *a = _mm512_fmadd_ps(xv, W::load16(wp.add(j * n + o + 16 * q)), *a);
                        }
                    }
                    for (q, a) in acc.iter().enumerate().take(width) {
                        let yp = yr.as_mut_ptr().add(o + 16 * q);
                        _mm512_storeu_ps(yp, _mm512_add_ps(_mm512_loadu_ps(yp), *a));
                    }
                }
                o += 16 * width;
            }
        }
        // The tail (< 16 outputs): the same fused multiply-adds one output at a time.
        for (xr, yr) in x.chunks_exact(k).zip(y.chunks_exact_mut(n)) {
            for (t, yv) in yr.iter_mut().enumerate().skip(n16) {
                let mut a = 0f32;
                for (j, &xj) in xr.iter().enumerate() {
                    a = xj.mul_add(w[j * n + t].to_f32(), a);
                }
                *yv += a;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / 1e7 - 0.8
            })
            .collect()
    }

    #[test]
    fn matches_the_portable_order_bit_for_bit_and_the_plain_product_closely() {
        for (m, n, k) in [
            (1, 3072, 16),
            (3, 100, 8),
            (2, 37, 5),
            (1, 64, 64),
            (5, 200, 16),
        ] {
            let (w, x) = (values(k * n, 1), values(m * k, 2));
            let mut y = values(m * n, 3);
            let mut want = y.clone();
            gemv_transposed(WeightRef::F32(&w), &x, &mut y, (m, n, k));
            for r in 0..m {
                let mut one = values(m * n, 3)[r * n..(r + 1) * n].to_vec();
                gemv_transposed(
                    WeightRef::F32(&w),
                    &x[r * k..(r + 1) * k],
                    &mut one,
                    (1, n, k),
                );
                assert_eq!(one, y[r * n..(r + 1) * n], "row {r} alone");
            }
            for (xr, yr) in x.chunks_exact(k).zip(want.chunks_exact_mut(n)) {
                row_portable(&w, xr, yr);
            }
            assert_eq!(y, want, "m {m} n {n} k {k}");
            let plain: Vec<f32> = (0..m * n)
                .map(|i| {
                    let (r, o) = (i / n, i % n);
                    values(m * n, 3)[i] + (0..k).map(|j| x[r * k + j] * w[j * n + o]).sum::<f32>()
                })
                .collect();
            let diff = y
                .iter()
                .zip(&plain)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(diff < 1e-5, "m {m} n {n} k {k}: {diff}");
        }
    }

    #[test]
    fn bf16_weights_widen_exactly() {
        let (n, k) = (80, 16);
        let wb: Vec<bf16> = values(k * n, 4).into_iter().map(bf16::from_f32).collect();
        let wf: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
        let x = values(k, 5);
        let (mut a, mut b) = (vec![0.5f32; n], vec![0.5f32; n]);
        gemv_transposed(WeightRef::BF16(&wb), &x, &mut a, (1, n, k));
        gemv_transposed(WeightRef::F32(&wf), &x, &mut b, (1, n, k));
        assert_eq!(a, b);
    }
}
