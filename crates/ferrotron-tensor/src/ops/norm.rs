use super::math::{LANES, multiversion};
use rayon::prelude::*;

/// RMSNorm over rows: `out[r, :] = weight ⊙ x[r, :] / sqrt(mean(x[r, :]²) + eps)`.
///
/// Shapes: `x, out: [rows, h]`, `weight: [h]`, `rstd: [rows]` (optional; receives
/// `1 / sqrt(mean(x²) + eps)` for the backward pass). Mirrors HF `LlamaRMSNorm` computed in f32
/// (Zhang & Sennrich 2019).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32], rstd: Option<&mut [f32]>) {
    let h = weight.len();
    assert!(h > 0 && x.len().is_multiple_of(h) && out.len() == x.len());
    let norm_row = |(xr, or): (&[f32], &mut [f32])| -> f32 {
        let ss: f32 = sum_squares(xr);
        let r = 1.0 / (ss / h as f32 + eps).sqrt();
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(weight) {
            *o = g * (v * r);
        }
        r
    };
    match rstd {
        Some(rs) => {
            assert_eq!(rs.len(), x.len() / h);
            x.par_chunks(h)
                .zip(out.par_chunks_mut(h))
                .zip(rs.par_iter_mut())
                .for_each(|(pair, r)| *r = norm_row(pair));
        }
        None => x.par_chunks(h).zip(out.par_chunks_mut(h)).for_each(|pair| {
            norm_row(pair);
        }),
    }
}

/// Rows per block of the `dweight` reduction in [`rms_norm_backward`]. Fixed (not derived from
/// the thread count) so the summation order, and so the result, never depends on the pool.
const RMS_ROW_BLOCK: usize = 32;

/// Backward of [`rms_norm`]: given `dy = ∂L/∂out`, writes `dx = ∂L/∂x` and adds `∂L/∂weight`.
///
/// Shapes: `x, dy, dx: [rows, h]`, `weight, dweight: [h]`, `rstd: [rows]` (saved by the forward).
/// `dx` is **overwritten**; `dweight` is **accumulated** (`+=`, so micro-batches add up).
///
/// Math, with `r = rstd[row]` and `x̂ = x·r`:
/// `dx = r·(w⊙dy) − r³/h · x · Σⱼ(wⱼ·dyⱼ·xⱼ)`, `dweight += Σ_rows dy ⊙ x̂`
/// (the autograd of HF `LlamaRMSNorm` / Apex `FusedRMSNorm` backward).
///
/// Deterministic: rows are processed in blocks of a fixed size, each block's `dweight` partial
/// sum is formed in row order, and the partials are added in block order, so results are bitwise
/// identical run to run and for any thread count.
///
/// # Panics
/// When the slice lengths do not match the shapes above (a caller bug).
pub fn rms_norm_backward(
    x: &[f32],
    weight: &[f32],
    rstd: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    dweight: &mut [f32],
) {
    let h = weight.len();
    assert!(
        h > 0 && x.len().is_multiple_of(h),
        "rms_norm_backward: x is not [rows, h]"
    );
    let rows = x.len() / h;
    assert!(rstd.len() == rows && dy.len() == x.len() && dx.len() == x.len());
    assert_eq!(dweight.len(), h);
    let block = RMS_ROW_BLOCK * h;
    let mut partial = vec![0f32; rows.div_ceil(RMS_ROW_BLOCK) * h];
    partial
        .par_chunks_mut(h)
        .zip(x.par_chunks(block))
        .zip(dy.par_chunks(block).zip(dx.par_chunks_mut(block)))
        .zip(rstd.par_chunks(RMS_ROW_BLOCK))
        .for_each(|(((dw, xb), (dyb, dxb)), rb)| rms_backward_block(xb, weight, rb, dyb, dxb, dw));
    for p in partial.chunks_exact(h) {
        dweight.iter_mut().zip(p).for_each(|(d, p)| *d += p);
    }
}

multiversion! {
    /// One block of rows: writes `dx`, overwrites `dw` with the block's `Σ dy ⊙ x·r`.
    fn rms_backward_block(
        x: &[f32],
        weight: &[f32],
        rstd: &[f32],
        dy: &[f32],
        dx: &mut [f32],
        dw: &mut [f32],
    ) {
        let h = weight.len();
        for (((xr, dyr), dxr), &r) in x
            .chunks_exact(h)
            .zip(dy.chunks_exact(h))
            .zip(dx.chunks_exact_mut(h))
            .zip(rstd)
        {
            // s = Σ w·dy·x, with partial sums (vectorizes).
            let mut acc = [0f32; LANES];
            let mut s_tail = 0f32;
            let (cw, cd, cx) = (weight.chunks_exact(LANES), dyr.chunks_exact(LANES), xr.chunks_exact(LANES));
            for ((w, d), xv) in cw.remainder().iter().zip(cd.remainder()).zip(cx.remainder()) {
                s_tail += w * d * xv;
            }
            for ((w, d), xv) in cw.zip(cd).zip(cx) {
                for l in 0..LANES {
                    acc[l] += w[l] * d[l] * xv[l];
                }
            }
            let s = acc.iter().sum::<f32>() + s_tail;
            let c = r * r * r * s / h as f32;
            for (((o, &w), &d), &xv) in dxr.iter_mut().zip(weight).zip(dyr).zip(xr) {
                *o = r * (w * d) - c * xv;
            }
        }
        dw.fill(0.0);
        for ((xr, dyr), &r) in x.chunks_exact(h).zip(dy.chunks_exact(h)).zip(rstd) {
            for ((o, &d), &xv) in dw.iter_mut().zip(dyr).zip(xr) {
                *o += d * (xv * r);
            }
        }
    }
}

/// Sum of squares with eight partial sums (vectorizes; stable enough for f32 rows).
fn sum_squares(x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            acc[l] += c[l] * c[l];
        }
    }
    acc.iter().sum::<f32>() + tail.iter().map(|v| v * v).sum::<f32>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_definition() {
        let x = [1.0, -2.0, 3.0, 0.5, 4.0, 0.0, -1.0, 2.0];
        let w = [0.5, 1.0, 2.0, -1.0];
        let mut out = [0.0; 8];
        let mut rstd = [0.0; 2];
        rms_norm(&x, &w, 1e-5, &mut out, Some(&mut rstd));
        for r in 0..2 {
            let row = &x[r * 4..r * 4 + 4];
            let ms = row.iter().map(|v| v * v).sum::<f32>() / 4.0;
            let inv = 1.0 / (ms + 1e-5f32).sqrt();
            assert!((rstd[r] - inv).abs() < 1e-6);
            for i in 0..4 {
                assert!((out[r * 4 + i] - w[i] * row[i] * inv).abs() < 1e-5);
            }
        }
    }
}
