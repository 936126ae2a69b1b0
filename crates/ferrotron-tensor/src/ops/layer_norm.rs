use super::math::{LANES, dev_sums, multiversion, sum};
use rayon::prelude::*;

/// LayerNorm over rows (Ba et al. 2016): `out[r, :] = (x[r, :] − μ)·rstd ⊙ weight + bias` with
/// `μ = mean(x[r, :])`, the biased variance `σ² = mean((x[r, :] − μ)²)` and
/// `rstd = 1/sqrt(σ² + eps)`. `weight` and `bias` are each optional (`None` means 1 and 0;
/// OLMo's non-parametric LayerNorm has neither, StarCoder2, Falcon and Bloom have both).
///
/// Shapes: `x, out: [rows, h]`, `weight, bias: [h]`, `stats = (mean, rstd)`: `[rows]` each
/// (optional; receive `μ` and `rstd` for [`layer_norm_backward`]). Mirrors torch
/// `F.layer_norm(x.float(), (h,), weight, bias, eps)` (HF `nn.LayerNorm`, OLMo's
/// `OlmoLayerNorm`; ATen `LayerNormKernelImplInternal`).
///
/// Numerics: `μ` and `σ²` by the corrected two-pass algorithm in f32 (Chan, Golub & LeVeque
/// 1983: `μ₀ = Σx/h`, then `c = Σ(x − μ₀)`, `s = Σ(x − μ₀)²`, `μ = μ₀ + c/h`,
/// `σ² = (s − c²/h)/h`, clamped at 0), each sum with 32 partial sums in a fixed order, so rows
/// with a large mean keep their variance (torch uses Welford's update for the same reason).
/// Each row is independent, so results do not depend on the thread count.
///
/// # Panics
/// When the slice lengths do not match the shapes above (a caller bug).
pub fn layer_norm(
    x: &[f32],
    h: usize,
    weight: Option<&[f32]>,
    bias: Option<&[f32]>,
    eps: f32,
    out: &mut [f32],
    stats: Option<(&mut [f32], &mut [f32])>,
) {
    assert!(
        h > 0 && x.len().is_multiple_of(h) && out.len() == x.len(),
        "layer_norm: x and out are not both [rows, h]"
    );
    assert!(
        weight.is_none_or(|w| w.len() == h),
        "layer_norm: weight is not [h]"
    );
    assert!(
        bias.is_none_or(|b| b.len() == h),
        "layer_norm: bias is not [h]"
    );
    let norm_row = |(xr, or): (&[f32], &mut [f32])| layer_norm_row(xr, weight, bias, eps, or);
    match stats {
        Some((mean, rstd)) => {
            let rows = x.len() / h;
            assert!(
                mean.len() == rows && rstd.len() == rows,
                "layer_norm: stats not [rows]"
            );
            x.par_chunks(h)
                .zip(out.par_chunks_mut(h))
                .zip(mean.par_iter_mut().zip(rstd.par_iter_mut()))
                .for_each(|(pair, (m, r))| (*m, *r) = norm_row(pair));
        }
        None => x.par_chunks(h).zip(out.par_chunks_mut(h)).for_each(|pair| {
            norm_row(pair);
        }),
    }
}

multiversion! {
    /// One row of [`layer_norm`]; returns `(μ, rstd)`.
    fn layer_norm_row(
        x: &[f32],
        weight: Option<&[f32]>,
        bias: Option<&[f32]>,
        eps: f32,
        out: &mut [f32],
    ) -> (f32, f32) {
        let n = x.len() as f32;
        let m0 = sum(x) / n;
        let (c, s) = dev_sums(x, m0);
        let m = m0 + c / n;
        let var = ((s - c * (c / n)) / n).max(0.0);
        let r = 1.0 / (var + eps).sqrt();
        let xs = x.iter().zip(out.iter_mut());
        match (weight, bias) {
            (Some(w), Some(b)) => {
                for (((&v, o), &w), &b) in xs.zip(w).zip(b) {
                    *o = (v - m) * r * w + b;
                }
            }
            (Some(w), None) => {
                for ((&v, o), &w) in xs.zip(w) {
                    *o = (v - m) * r * w;
                }
            }
            (None, Some(b)) => {
                for ((&v, o), &b) in xs.zip(b) {
                    *o = (v - m) * r + b;
                }
            }
            (None, None) => {
                for (&v, o) in xs {
                    *o = (v - m) * r;
                }
            }
        }
        (m, r)
    }
}

/// Rows per block of the `dweight` / `dbias` reduction in [`layer_norm_backward`]. Fixed (not
/// derived from the thread count) so the summation order, and so the result, never depends on
/// the pool.
const LN_ROW_BLOCK: usize = 32;

/// Backward of [`layer_norm`]: given `dy = ∂L/∂out`, writes `dx = ∂L/∂x` and adds
/// `∂L/∂weight`, `∂L/∂bias`.
///
/// Shapes: `x, dy, dx: [rows, h]`, `weight, dweight, dbias: [h]`, `mean, rstd: [rows]` (saved by
/// the forward). `dx` is **overwritten**; `dweight` and `dbias` are **accumulated** (`+=`, so
/// micro-batches add up); pass `None` for a gradient that is not wanted (or a parameter that
/// does not exist: `bias` plays no part in the backward besides `dbias`).
///
/// Math, with `r = rstd[row]`, `x̂ = (x − μ)·r` and `g = w ⊙ dy` (`g = dy` without a weight):
/// `dx = r·(g − mean(g) − x̂·mean(g ⊙ x̂))`, `dweight += Σ_rows dy ⊙ x̂`, `dbias += Σ_rows dy`
/// (the autograd of torch `F.layer_norm`; ATen `LayerNormBackwardKernelImplInternal` computes
/// the same `dx` as `a·g + b·x + c`, which we avoid because `b·x + c` cancels for rows with a
/// large mean).
///
/// Deterministic: rows are processed in blocks of a fixed size, each block's partial sums are
/// formed in row order, and the partials are added in block order, so results are bitwise
/// identical run to run and for any thread count.
///
/// # Panics
/// When the slice lengths do not match the shapes above, or `dweight` is given without a
/// `weight` (caller bugs).
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward(
    x: &[f32],
    h: usize,
    weight: Option<&[f32]>,
    mean: &[f32],
    rstd: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    mut dweight: Option<&mut [f32]>,
    mut dbias: Option<&mut [f32]>,
) {
    assert!(
        h > 0 && x.len().is_multiple_of(h),
        "layer_norm_backward: x is not [rows, h]"
    );
    let rows = x.len() / h;
    assert!(
        mean.len() == rows && rstd.len() == rows && dy.len() == x.len() && dx.len() == x.len(),
        "layer_norm_backward: mean, rstd, dy or dx does not match x"
    );
    assert!(
        weight.is_none_or(|w| w.len() == h),
        "layer_norm_backward: weight is not [h]"
    );
    assert!(
        dweight.is_none() || weight.is_some(),
        "layer_norm_backward: dweight without a weight"
    );
    assert!(dweight.as_ref().is_none_or(|d| d.len() == h));
    assert!(dbias.as_ref().is_none_or(|d| d.len() == h));
    // Without a weight, g = 1·dy = dy exactly.
    let ones;
    let weight = match weight {
        Some(w) => w,
        None => {
            ones = vec![1f32; h];
            &ones
        }
    };
    // Per block: [dweight partial (h, if wanted) | dbias partial (h, if wanted)].
    let (nw, nb) = (
        h * usize::from(dweight.is_some()),
        h * usize::from(dbias.is_some()),
    );
    let blocks = rows.div_ceil(LN_ROW_BLOCK);
    let mut partial = vec![0f32; blocks * (nw + nb)];
    let parts: Vec<&mut [f32]> = if nw + nb == 0 {
        (0..blocks).map(|_| &mut [][..]).collect()
    } else {
        partial.chunks_mut(nw + nb).collect()
    };
    let block = LN_ROW_BLOCK * h;
    parts
        .into_par_iter()
        .zip(x.par_chunks(block).zip(dy.par_chunks(block)))
        .zip(dx.par_chunks_mut(block))
        .zip(
            mean.par_chunks(LN_ROW_BLOCK)
                .zip(rstd.par_chunks(LN_ROW_BLOCK)),
        )
        .for_each(|(((part, (xb, dyb)), dxb), (mb, rb))| {
            let (dw, db) = part.split_at_mut(nw);
            ln_backward_block(xb, weight, mb, rb, dyb, dxb, dw, db);
        });
    if nw + nb == 0 {
        return;
    }
    for p in partial.chunks_exact(nw + nb) {
        let (pw, pb) = p.split_at(nw);
        if let Some(dw) = dweight.as_deref_mut() {
            dw.iter_mut().zip(pw).for_each(|(d, p)| *d += p);
        }
        if let Some(db) = dbias.as_deref_mut() {
            db.iter_mut().zip(pb).for_each(|(d, p)| *d += p);
        }
    }
}

multiversion! {
    /// One block of rows: writes `dx`; overwrites `dw` (if not empty) with the block's
    /// `Σ dy ⊙ x̂` and `db` (if not empty) with its `Σ dy`.
    fn ln_backward_block(
        x: &[f32],
        weight: &[f32],
        mean: &[f32],
        rstd: &[f32],
        dy: &[f32],
        dx: &mut [f32],
        dw: &mut [f32],
        db: &mut [f32],
    ) {
        let h = weight.len();
        let n = h as f32;
        let rows = x.chunks_exact(h).zip(dy.chunks_exact(h)).zip(mean.iter().zip(rstd));
        for (((xr, dyr), (&m, &r)), dxr) in rows.zip(dx.chunks_exact_mut(h)) {
            // Σ g and Σ g·x̂, with partial sums (vectorizes).
            let (mut a1, mut a2) = ([0f32; LANES], [0f32; LANES]);
            let (cw, cd, cx) = (
                weight.chunks_exact(LANES),
                dyr.chunks_exact(LANES),
                xr.chunks_exact(LANES),
            );
            let (mut t1, mut t2) = (0f32, 0f32);
            for ((&w, &d), &v) in cw.remainder().iter().zip(cd.remainder()).zip(cx.remainder()) {
                let g = w * d;
                t1 += g;
                t2 += g * ((v - m) * r);
            }
            for ((w, d), v) in cw.zip(cd).zip(cx) {
                for l in 0..LANES {
                    let g = w[l] * d[l];
                    a1[l] += g;
                    a2[l] += g * ((v[l] - m) * r);
                }
            }
            let mg = (a1.iter().sum::<f32>() + t1) / n;
            let mgx = (a2.iter().sum::<f32>() + t2) / n;
            for (((o, &w), &d), &v) in dxr.iter_mut().zip(weight).zip(dyr).zip(xr) {
                *o = r * (w * d - mg - (v - m) * r * mgx);
            }
        }
        if !dw.is_empty() {
            dw.fill(0.0);
            for ((xr, dyr), (&m, &r)) in x.chunks_exact(h).zip(dy.chunks_exact(h)).zip(mean.iter().zip(rstd)) {
                for ((o, &d), &v) in dw.iter_mut().zip(dyr).zip(xr) {
                    *o += d * ((v - m) * r);
                }
            }
        }
        if !db.is_empty() {
            db.fill(0.0);
            for dyr in dy.chunks_exact(h) {
                db.iter_mut().zip(dyr).for_each(|(o, &d)| *o += d);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EPS: f32 = 1e-5;
    const COMBOS: [(bool, bool); 4] = [(true, true), (true, false), (false, true), (false, false)];

    /// Rows with different character: zero-mean, offset, a large mean with small spread
    /// (ill-conditioned for a one-pass variance), constant (σ² = 0).
    fn input(rows: usize, h: usize) -> Vec<f32> {
        (0..rows * h)
            .map(|i| {
                let (r, j) = (i / h, (i % h) as f32);
                let w = (j * 0.731 + r as f32).sin() * (j * 0.057).cos();
                [1.7 * w, 3.0 + 0.8 * w, 300.0 + 0.25 * w, -0.375][r % 4]
            })
            .collect()
    }

    fn wave(n: usize, seed: f32) -> Vec<f32> {
        (0..n)
            .map(|i| (i as f32 * 0.377 + seed).sin() + 0.2)
            .collect()
    }

    /// f64 `(μ, rstd)` of one row.
    fn ref_stats(x: &[f64]) -> (f64, f64) {
        let n = x.len() as f64;
        let m = x.iter().sum::<f64>() / n;
        let var = x.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / n;
        (m, 1.0 / (var + f64::from(EPS)).sqrt())
    }

    /// `Σ dy ⊙ layer_norm(x; w, b)` in f64, the loss the finite differences differentiate.
    fn ref_loss(x: &[f64], h: usize, w: &[f64], b: &[f64], dy: &[f32]) -> f64 {
        let mut total = 0.0;
        for (row, dyr) in x.chunks(h).zip(dy.chunks(h)) {
            let (m, r) = ref_stats(row);
            for j in 0..h {
                total += f64::from(dyr[j]) * ((row[j] - m) * r * w[j] + b[j]);
            }
        }
        total
    }

    /// Central difference of `loss` in coordinate `i` of `v`.
    fn fd(v: &mut [f64], i: usize, loss: &dyn Fn(&[f64]) -> f64) -> f64 {
        let (x0, step) = (v[i], 1e-6 * v[i].abs().max(1.0));
        v[i] = x0 + step;
        let lp = loss(v);
        v[i] = x0 - step;
        let lm = loss(v);
        v[i] = x0;
        (lp - lm) / (2.0 * step)
    }

    fn assert_close(what: &str, got: f64, want: f64, tol: f64) {
        assert!(
            (got - want).abs() <= tol,
            "{what}: {got} vs {want} (tol {tol:e})"
        );
    }

    fn to64(v: &[f32]) -> Vec<f64> {
        v.iter().map(|&a| f64::from(a)).collect()
    }

    #[test]
    fn forward_matches_f64_definition() {
        for (rows, h) in [(8, 77), (4, 1), (4, 3), (4, 1000)] {
            let x = input(rows, h);
            let (wv, bv) = (wave(h, 0.4), wave(h, 1.9));
            for (with_w, with_b) in COMBOS {
                let (w, b) = (with_w.then_some(&wv[..]), with_b.then_some(&bv[..]));
                let mut out = vec![f32::NAN; x.len()];
                let (mut mean, mut rstd) = (vec![0.0; rows], vec![0.0; rows]);
                layer_norm(&x, h, w, b, EPS, &mut out, Some((&mut mean, &mut rstd)));
                let mut out2 = vec![f32::NAN; x.len()];
                layer_norm(&x, h, w, b, EPS, &mut out2, None);
                assert_eq!(out, out2);
                for r in 0..rows {
                    let row = to64(&x[r * h..(r + 1) * h]);
                    let (m, rs) = ref_stats(&row);
                    assert_close("mean", f64::from(mean[r]), m, 1e-7 * (m.abs() + 1.0 / rs));
                    assert_close("rstd", f64::from(rstd[r]), rs, 1e-6 * rs);
                    for j in 0..h {
                        let wj = w.map_or(1.0, |w| f64::from(w[j]));
                        let bj = b.map_or(0.0, |b| f64::from(b[j]));
                        let xhat = (row[j] - m) * rs;
                        // Relative 1e-6 of the terms, plus the rounding of the f32 μ carried
                        // into x̂ (|μ|·rstd·ε/2; it matters for the large-mean rows only).
                        let tol = 1e-6 * (wj.abs() * (xhat.abs() + 1.0) + bj.abs())
                            + 1e-7 * wj.abs() * m.abs() * rs;
                        let what = format!("({rows}, {h}) y[{r}, {j}]");
                        assert_close(&what, f64::from(out[r * h + j]), xhat * wj + bj, tol);
                    }
                }
            }
        }
    }

    #[test]
    fn backward_matches_analytic_and_finite_differences() {
        let (rows, h) = (5, 37);
        let x = input(rows, h);
        let dy = wave(rows * h, 0.7);
        let (wv, bv) = (wave(h, 0.4), wave(h, 1.9));
        let x64 = to64(&x);
        for (with_w, with_b) in COMBOS {
            let (w, b) = (with_w.then_some(&wv[..]), with_b.then_some(&bv[..]));
            let w64: Vec<f64> = (0..h).map(|j| w.map_or(1.0, |w| f64::from(w[j]))).collect();
            let b64: Vec<f64> = (0..h).map(|j| b.map_or(0.0, |b| f64::from(b[j]))).collect();
            let mut out = vec![0.0; x.len()];
            let (mut mean, mut rstd) = (vec![0.0; rows], vec![0.0; rows]);
            layer_norm(&x, h, w, b, EPS, &mut out, Some((&mut mean, &mut rstd)));
            // dx overwritten (NaN before); dw, db accumulated onto 0.5.
            let mut dx = vec![f32::NAN; x.len()];
            let (mut dw, mut db) = (vec![0.5f32; h], vec![0.5f32; h]);
            let (dwo, dbo) = (with_w.then_some(&mut dw[..]), with_b.then_some(&mut db[..]));
            layer_norm_backward(&x, h, w, &mean, &rstd, &dy, &mut dx, dwo, dbo);
            // The analytic gradients in f64, and the scale of dx's terms.
            let (mut adx, mut sdx) = (vec![0f64; x.len()], vec![0f64; x.len()]);
            let (mut adw, mut adb) = (vec![0f64; h], vec![0f64; h]);
            for r in 0..rows {
                let (m, rs) = ref_stats(&x64[r * h..(r + 1) * h]);
                let xh: Vec<f64> = (0..h).map(|j| (x64[r * h + j] - m) * rs).collect();
                let g: Vec<f64> = (0..h).map(|j| w64[j] * f64::from(dy[r * h + j])).collect();
                let mg = g.iter().sum::<f64>() / h as f64;
                let mgx = g.iter().zip(&xh).map(|(g, x)| g * x).sum::<f64>() / h as f64;
                for j in 0..h {
                    adx[r * h + j] = rs * (g[j] - mg - xh[j] * mgx);
                    sdx[r * h + j] = rs * (g[j].abs() + mg.abs() + (xh[j] * mgx).abs());
                    adw[j] += f64::from(dy[r * h + j]) * xh[j];
                    adb[j] += f64::from(dy[r * h + j]);
                }
            }
            // The analytic formula against central differences of the f64 definition, and ours
            // against it (dx: relative 1e-5 of its terms, widened for the f32 μ like above).
            let mut v = x64.clone();
            for i in 0..x.len() {
                let d = fd(&mut v, i, &|v| ref_loss(v, h, &w64, &b64, &dy));
                assert_close(&format!("fd dx[{i}]"), d, adx[i], 1e-6 * (1.0 + sdx[i]));
                let tol = 1e-5 * sdx[i] * (1.0 + 1e-2 * f64::from(mean[i / h].abs()));
                assert_close(&format!("dx[{i}]"), f64::from(dx[i]), adx[i], tol);
            }
            let (mut wv64, mut bv64) = (w64.clone(), b64.clone());
            for j in 0..h {
                let d = fd(&mut wv64, j, &|wv| ref_loss(&x64, h, wv, &b64, &dy));
                assert_close(
                    &format!("fd dw[{j}]"),
                    d,
                    adw[j],
                    1e-6 * (1.0 + adw[j].abs()),
                );
                let d = fd(&mut bv64, j, &|bv| ref_loss(&x64, h, &w64, bv, &dy));
                assert_close(
                    &format!("fd db[{j}]"),
                    d,
                    adb[j],
                    1e-6 * (1.0 + adb[j].abs()),
                );
                let (gw, gb) = (f64::from(dw[j]) - 0.5, f64::from(db[j]) - 0.5);
                let (ww, wb) = (
                    if with_w { adw[j] } else { 0.0 },
                    if with_b { adb[j] } else { 0.0 },
                );
                assert_close(&format!("dw[{j}]"), gw, ww, 1e-5 * (1.0 + adw[j].abs()));
                assert_close(&format!("db[{j}]"), gb, wb, 1e-6 * (1.0 + adb[j].abs()));
            }
        }
    }

    #[test]
    fn backward_is_deterministic_across_thread_counts() {
        let (rows, h) = (203, 67); // several row blocks, the last one partial
        let x = input(rows, h);
        let dy = wave(rows * h, 0.2);
        let (w, b) = (wave(h, 0.4), wave(h, 1.9));
        let (w, b) = (Some(&w[..]), Some(&b[..]));
        let run = || {
            let mut y = vec![0.0; x.len()];
            let (mut m, mut r) = (vec![0.0; rows], vec![0.0; rows]);
            layer_norm(&x, h, w, b, EPS, &mut y, Some((&mut m, &mut r)));
            let mut dx = vec![0.0; x.len()];
            let (mut dw, mut db) = (vec![0.25; h], vec![0.25; h]);
            let (dwo, dbo) = (Some(&mut dw[..]), Some(&mut db[..]));
            layer_norm_backward(&x, h, w, &m, &r, &dy, &mut dx, dwo, dbo);
            [y, m, r, dx, dw, db].map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
        };
        let in_pool = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build();
            pool.expect("rayon pool").install(run)
        };
        let one = in_pool(1);
        assert_eq!(one, in_pool(3));
        assert_eq!(one, run());
    }

    #[test]
    #[should_panic(expected = "dweight without a weight")]
    fn dweight_needs_a_weight() {
        let (mut dx, mut dw) = ([0.0; 2], [0.0; 2]);
        let dwo = Some(&mut dw[..]);
        layer_norm_backward(
            &[1.0, 2.0],
            2,
            None,
            &[1.5],
            &[2.0],
            &[1.0; 2],
            &mut dx,
            dwo,
            None,
        );
    }
}
