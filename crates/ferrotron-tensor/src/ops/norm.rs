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
