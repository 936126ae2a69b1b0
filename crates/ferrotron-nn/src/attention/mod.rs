//! Core attention `softmax(q·kᵀ/√d + mask)·v` with grouped-query heads, causal masking and an
//! optional sliding window (Vaswani et al. 2017; GQA: Ainslie et al. 2023; Mistral's window).
//! Mirrors HF `eager_attention_forward` in f32. The training forward (saving the logsumexp) and
//! its backward live in `train.rs`.

use ferrotron_tensor::ops::dot;
use rayon::prelude::*;

mod train;
pub use train::{core_attention_backward, core_attention_forward_train};

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
    check_dims(q, k, v, &dims);
    assert!(out.len() == q.len(), "attention: out is not [sq, b, a, d]");
    let AttentionDims {
        batch: b,
        heads: a,
        groups: g,
        head_dim: d,
        q_offset,
        ..
    } = dims;
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

/// Shape checks shared by the inference and training kernels (caller bugs panic with the
/// offending dims).
pub(super) fn check_dims(q: &[f32], k: &[f32], v: &[f32], dims: &AttentionDims) {
    let AttentionDims {
        sq,
        skv,
        batch: b,
        heads: a,
        groups: g,
        head_dim: d,
        q_offset,
    } = *dims;
    assert!(
        g > 0 && d > 0 && a % g == 0 && q_offset + sq <= skv,
        "attention: bad dims {dims:?}"
    );
    assert!(
        q.len() == sq * b * a * d,
        "attention: q is not [sq, b, a, d]"
    );
    let kv = skv * b * g * d;
    assert!(
        k.len() >= kv && v.len() >= kv,
        "attention: k/v shorter than [skv, b, g, d]"
    );
}
