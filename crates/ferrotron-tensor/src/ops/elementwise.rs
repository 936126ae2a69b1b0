use rayon::prelude::*;

/// `a += b` elementwise (residual connections). Shapes equal.
pub fn add_inplace(a: &mut [f32], b: &[f32]) {
    assert_eq!(a.len(), b.len());
    a.par_chunks_mut(8192)
        .zip(b.par_chunks(8192))
        .for_each(|(a, b)| a.iter_mut().zip(b).for_each(|(a, b)| *a += b));
}

/// `x[r, :] += bias` for `x: [rows, n]`, `bias: [n]`.
pub fn add_bias(x: &mut [f32], bias: &[f32]) {
    let n = bias.len();
    assert!(n > 0 && x.len().is_multiple_of(n));
    x.par_chunks_mut(n)
        .for_each(|row| row.iter_mut().zip(bias).for_each(|(v, b)| *v += b));
}

/// Columns of `dbias` owned by one task in [`add_bias_backward`].
const BIAS_COLS: usize = 64;

/// Backward of [`add_bias`] for the bias: `dbias[c] += Σ_r dy[r, c]` (**accumulates**), with
/// `dy: [rows, n]`, `dbias: [n]`. The gradient of `x` is `dy` itself (nothing to compute), as for
/// [`add_inplace`] (a residual passes `dy` to both branches).
///
/// Parallel over column blocks; each column is summed in row order, so the result is bitwise
/// reproducible for any thread count.
///
/// # Panics
/// When `dy.len()` is not a multiple of `dbias.len()` (a caller bug).
pub fn add_bias_backward(dy: &[f32], dbias: &mut [f32]) {
    let n = dbias.len();
    assert!(n > 0 && dy.len().is_multiple_of(n));
    dbias
        .par_chunks_mut(BIAS_COLS)
        .enumerate()
        .for_each(|(blk, db)| {
            let c0 = blk * BIAS_COLS;
            let mut acc = [0f32; BIAS_COLS];
            let acc = &mut acc[..db.len()];
            for row in dy.chunks_exact(n) {
                acc.iter_mut()
                    .zip(&row[c0..c0 + db.len()])
                    .for_each(|(a, v)| *a += v);
            }
            db.iter_mut().zip(acc.iter()).for_each(|(d, a)| *d += a);
        });
}
