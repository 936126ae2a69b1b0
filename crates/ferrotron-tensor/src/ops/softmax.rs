use super::math::{dot, multiversion};
use rayon::prelude::*;

/// In-place softmax over each row of `x: [rows, n]` (max-subtracted for stability).
pub fn softmax_rows(x: &mut [f32], n: usize) {
    assert!(n > 0 && x.len().is_multiple_of(n));
    x.par_chunks_mut(n).for_each(softmax_row);
}

/// In-place softmax of one row; `-inf` entries become exactly 0.
pub fn softmax_row(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in row.iter_mut() {
        *v *= inv;
    }
}

/// Backward of [`softmax_rows`]: `y: [rows, n]` is the saved softmax output, `dy` its gradient;
/// **overwrites** `dx = y ⊙ (dy − Σⱼ yⱼ·dyⱼ)` per row (PyTorch `_softmax_backward_data`).
///
/// # Panics
/// When the lengths do not match `[rows, n]` (a caller bug).
pub fn softmax_rows_backward(y: &[f32], dy: &[f32], dx: &mut [f32], n: usize) {
    assert!(n > 0 && y.len().is_multiple_of(n) && dy.len() == y.len() && dx.len() == y.len());
    dx.par_chunks_mut(n)
        .zip(y.par_chunks(n).zip(dy.par_chunks(n)))
        .for_each(|(dx, (y, dy))| softmax_row_backward(y, dy, dx));
}

multiversion! {
    fn softmax_row_backward(y: &[f32], dy: &[f32], dx: &mut [f32]) {
        let s = dot(y, dy);
        for ((o, &y), &d) in dx.iter_mut().zip(y).zip(dy) {
            *o = y * (d - s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_sum_to_one_and_masked_entries_vanish() {
        let mut x = vec![1.0, 2.0, f32::NEG_INFINITY, 1000.0, 1000.0, 999.0];
        softmax_rows(&mut x, 3);
        assert!((x[0] + x[1] - 1.0).abs() < 1e-6 && x[2] == 0.0);
        assert!((x[3] - x[4]).abs() < 1e-7 && (x[3..].iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }
}
