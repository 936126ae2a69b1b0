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
