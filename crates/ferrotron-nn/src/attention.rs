//! Core attention `softmax(q·kᵀ/√d + mask)·v` with grouped-query heads, causal masking and an
//! optional sliding window (Vaswani et al. 2017; GQA: Ainslie et al. 2023; Mistral's window).
//! Mirrors HF `eager_attention_forward` in f32.

use rayon::prelude::*;

/// Which keys each query sees: keys at positions `j <= i` (causal) and, with a window `w`,
/// only `i - j < w` (query `i` attends key `j` iff `0 <= i - j < w`, HF Mistral semantics).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct AttentionMask {
    pub sliding_window: Option<usize>,
}

impl AttentionMask {
    /// Half-open range of key positions visible to a query at position `pos`.
    pub fn key_range(&self, pos: usize) -> std::ops::Range<usize> {
        let lo = match self.sliding_window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        };
        lo..pos + 1
    }
}

/// Sizes for [`core_attention`].
#[derive(Clone, Copy, Debug)]
pub struct AttentionDims {
    /// Query tokens `sq` per sequence.
    pub sq: usize,
    /// Key/value tokens `skv` per sequence (`skv >= q_offset + sq`).
    pub skv: usize,
    /// Micro-batch `b`.
    pub batch: usize,
    /// Query heads `a`.
    pub heads: usize,
    /// Key/value heads (query groups) `g`; `a % g == 0`.
    pub groups: usize,
    /// Head dim `d`.
    pub head_dim: usize,
    /// Position of the first query token (the KV-cache length before this step).
    pub q_offset: usize,
}

/// `out = softmax(q·kᵀ/√d + mask)·v` per sequence and head.
///
/// Shapes: `q, out: [sq, b, a, d]`; `k, v: [skv, b, g, d]` (key `j` at position `j`); query
/// head `h` reads key/value group `h / (a/g)`. Backward needs `q, k, v` and the row-wise
/// softmax statistics (or recomputes them).
pub fn core_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    dims: AttentionDims,
    mask: AttentionMask,
) {
    let AttentionDims {
        sq,
        skv,
        batch: b,
        heads: a,
        groups: g,
        head_dim: d,
        q_offset,
    } = dims;
    assert!(g > 0 && a % g == 0 && q_offset + sq <= skv);
    assert!(q.len() == sq * b * a * d && out.len() == q.len());
    assert!(k.len() >= skv * b * g * d && v.len() >= skv * b * g * d);
    let scale = 1.0 / (d as f32).sqrt();
    let heads_per_group = a / g;
    out.par_chunks_mut(d)
        .zip(q.par_chunks(d))
        .enumerate()
        .for_each_init(Vec::new, |scores, (row, (o, qr))| {
            let (t, j, h) = (row / (b * a), (row / a) % b, row % a);
            let gh = h / heads_per_group;
            let keys = mask.key_range(q_offset + t);
            let kv_row = |pos: usize| ((pos * b + j) * g + gh) * d;
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for pos in keys.clone() {
                let kr = &k[kv_row(pos)..][..d];
                let s = dot(qr, kr) * scale;
                max = max.max(s);
                scores.push(s);
            }
            let mut sum = 0f32;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            let inv = 1.0 / sum;
            o.fill(0.0);
            for (pos, &p) in keys.zip(scores.iter()) {
                let vr = &v[kv_row(pos)..][..d];
                let w = p * inv;
                for (o, &x) in o.iter_mut().zip(vr) {
                    *o += w * x;
                }
            }
        });
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Straightforward reference: explicit score matrix, -inf mask, softmax, weighted sum.
    fn reference(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        dims: AttentionDims,
        mask: AttentionMask,
    ) -> Vec<f32> {
        let AttentionDims {
            sq,
            skv,
            batch: b,
            heads: a,
            groups: g,
            head_dim: d,
            q_offset,
        } = dims;
        let mut out = vec![0f32; q.len()];
        for t in 0..sq {
            for j in 0..b {
                for h in 0..a {
                    let gh = h / (a / g);
                    let qr = &q[((t * b + j) * a + h) * d..][..d];
                    let mut s: Vec<f64> = (0..skv)
                        .map(|p| {
                            let kr = &k[((p * b + j) * g + gh) * d..][..d];
                            let pos = q_offset + t;
                            let ok = p <= pos && mask.sliding_window.is_none_or(|w| pos - p < w);
                            if ok {
                                qr.iter().zip(kr).map(|(x, y)| (x * y) as f64).sum::<f64>()
                                    / (d as f64).sqrt()
                            } else {
                                f64::NEG_INFINITY
                            }
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = s
                        .iter_mut()
                        .map(|x| {
                            *x = (*x - m).exp();
                            *x
                        })
                        .sum();
                    for (p, w) in s.iter().enumerate() {
                        let vr = &v[((p * b + j) * g + gh) * d..][..d];
                        for i in 0..d {
                            out[((t * b + j) * a + h) * d + i] += (w / z * vr[i] as f64) as f32;
                        }
                    }
                }
            }
        }
        out
    }

    #[test]
    fn matches_reference_with_gqa_window_and_offset() {
        let dims = AttentionDims {
            sq: 3,
            skv: 7,
            batch: 2,
            heads: 4,
            groups: 2,
            head_dim: 5,
            q_offset: 4,
        };
        let make = |n: usize, s: f32| (0..n).map(|i| (i as f32 * s).sin()).collect::<Vec<_>>();
        let q = make(3 * 2 * 4 * 5, 0.7);
        let k = make(7 * 2 * 2 * 5, 1.3);
        let v = make(7 * 2 * 2 * 5, 0.4);
        for window in [None, Some(1), Some(3)] {
            let mask = AttentionMask {
                sliding_window: window,
            };
            let mut out = vec![0f32; q.len()];
            core_attention(&q, &k, &v, &mut out, dims, mask);
            let want = reference(&q, &k, &v, dims, mask);
            for (a, b) in out.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "window {window:?}: {a} vs {b}");
            }
        }
    }
}
