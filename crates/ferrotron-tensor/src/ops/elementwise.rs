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
