//! The GEMV kernels against the portable loop, the bf16 rounding contract, and the
//! multi-row products' bit-identity with one-row GEMVs.

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

/// Batched decode: every row of a multi-row product is bit for bit the one-row GEMV of
/// that row, for any row count (groups of four and the rest) and ragged `k`.
#[test]
fn multi_row_products_are_bit_identical_to_one_row_gemvs() {
    for (n, k) in [(3, 1), (70, 33), (130, 576), (9, 300)] {
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919) % 211) as f32 / 100.0 - 1.0)
            .collect();
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
        for m in 1..=9 {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 31) % 17) as f32 / 7.0 - 1.1)
                .collect();
            let mut got = vec![0.5f32; m * n];
            let mut got_b = got.clone();
            let mut got_h = got.clone();
            gemv_rows(&w, &x, &mut got, (m, n, k), true);
            gemv_rows_bf16(&wb, &x, &mut got_b, (m, n, k), false);
            gemv_rows(&wh, &x, &mut got_h, (m, n, k), false);
            for r in 0..m {
                let (xr, ys) = (&x[r * k..(r + 1) * k], r * n..(r + 1) * n);
                let mut want = vec![0.5f32; n];
                gemv(&w, xr, &mut want, true);
                assert_eq!(got[ys.clone()], want[..], "f32 m {m} n {n} k {k} row {r}");
                gemv_bf16(&wb, xr, &mut want, false);
                assert_eq!(
                    got_b[ys.clone()],
                    want[..],
                    "bf16 m {m} n {n} k {k} row {r}"
                );
                gemv(&wh, xr, &mut want, false);
                assert_eq!(got_h[ys], want[..], "f16 m {m} n {n} k {k} row {r}");
            }
        }
    }
}

/// bf16 weights: `x` rounded to bf16, exact products, f32 sums — within f32 summation
/// error of the f64 sum of the rounded products, for lengths with and without a tail.
#[test]
fn bf16_gemv_multiplies_the_rounded_activations() {
    for (n, k) in [(1, 1), (7, 33), (130, 576), (5, 100), (3, 1536)] {
        let w: Vec<bf16> = (0..n * k)
            .map(|i| bf16::from_f32(((i * 7919) % 211) as f32 / 100.0 - 1.0))
            .collect();
        let x: Vec<f32> = (0..k).map(|i| ((i * 31) % 17) as f32 / 7.0 - 1.1).collect();
        let mut got = vec![0.25f32; n];
        gemv_bf16(&w, &x, &mut got, true);
        for (j, g) in got.iter().enumerate() {
            let (mut want, mut scale) = (0.25f64, 0.25f64);
            for q in 0..k {
                let xr = bf16::from_f32(x[q]).to_f32() as f64;
                let prod = w[j * k + q].to_f32() as f64 * xr;
                want += prod;
                scale += prod.abs();
            }
            let err = (*g as f64 - want).abs();
            assert!(err <= 1e-6 * scale, "n {n} k {k} row {j}: {g} vs {want}");
        }
    }
}
