/// Index of the largest value; the first one on ties (like `torch.argmax`). NaN is never chosen
/// over a number. Returns 0 for an empty slice.
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in x.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best
}

/// The `k` largest `(index, value)` pairs, largest first (ties: lower index first).
pub fn top_k(x: &[f32], k: usize) -> Vec<(usize, f32)> {
    let mut idx: Vec<usize> = (0..x.len()).collect();
    let k = k.min(x.len());
    let cmp = |a: &usize, b: &usize| x[*b].total_cmp(&x[*a]).then(a.cmp(b));
    if k < idx.len() && k > 0 {
        idx.select_nth_unstable_by(k - 1, cmp);
    }
    idx.truncate(k);
    idx.sort_by(cmp);
    idx.into_iter().map(|i| (i, x[i])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_and_top_k() {
        let x = [0.5, 3.0, -1.0, 3.0, 2.0];
        assert_eq!(argmax(&x), 1);
        assert_eq!(top_k(&x, 3), vec![(1, 3.0), (3, 3.0), (4, 2.0)]);
        assert_eq!(top_k(&x, 10).len(), 5);
    }
}
