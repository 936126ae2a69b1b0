//! The inference kernel `core_attention` against a straightforward reference (explicit score
//! matrix, -inf mask, softmax in f64), with GQA, sliding windows and a query offset.

use ferrotron_nn::attention::{AttentionDims, AttentionMask, core_attention};

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
        ..
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
        kv_offset: 0,
    };
    let make = |n: usize, s: f32| (0..n).map(|i| (i as f32 * s).sin()).collect::<Vec<_>>();
    let q = make(3 * 2 * 4 * 5, 0.7);
    let k = make(7 * 2 * 2 * 5, 1.3);
    let v = make(7 * 2 * 2 * 5, 0.4);
    for window in [None, Some(1), Some(3)] {
        let mask = AttentionMask {
            sliding_window: window,
            documents: None,
            alibi_slopes: None,
        };
        let mut out = vec![0f32; q.len()];
        core_attention(&q, &k, &v, &mut out, dims, mask);
        let want = reference(&q, &k, &v, dims, mask);
        for (a, b) in out.iter().zip(&want) {
            assert!((a - b).abs() < 1e-5, "window {window:?}: {a} vs {b}");
        }
    }
}
