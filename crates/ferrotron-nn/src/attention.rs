//! Core attention `softmax(q·kᵀ/√d + mask)·v` with grouped-query heads, causal masking and an
//! optional sliding window (Vaswani et al. 2017; GQA: Ainslie et al. 2023; Mistral's window).
//! Mirrors HF `eager_attention_forward` in f32.

use ferrotron_tensor::multiversion;
use ferrotron_tensor::ops::fast_exp;
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

/// Keys per block in the training kernels: a block's 64 dot products live in four AVX-512
/// registers while the loop runs over the head dim.
const KB: usize = 64;

/// Keys and values of one `(batch, group)` transposed to `[d, skv]`, so the dot products of a
/// query with a run of keys vectorize over the keys.
struct Transposed {
    kt: Vec<f32>, // [b, g, d, skv]
    vt: Vec<f32>, // [b, g, d, skv]
}

impl Transposed {
    fn new(k: &[f32], v: &[f32], dims: &AttentionDims) -> Transposed {
        let (skv, b, g, d) = (dims.skv, dims.batch, dims.groups, dims.head_dim);
        let transpose = |src: &[f32]| {
            let mut t = vec![0f32; b * g * d * skv];
            t.par_chunks_mut(d * skv).enumerate().for_each(|(jg, t)| {
                for p in 0..skv {
                    let row = &src[(p * b * g + jg) * d..][..d];
                    for (c, &x) in row.iter().enumerate() {
                        t[c * skv + p] = x;
                    }
                }
            });
            t
        };
        Transposed {
            kt: transpose(k),
            vt: transpose(v),
        }
    }

    /// `([d, skv] keys, [d, skv] values)` of batch `j`, group `gh`.
    fn group(&self, j: usize, gh: usize, dims: &AttentionDims) -> (&[f32], &[f32]) {
        let n = dims.head_dim * dims.skv;
        let o = (j * dims.groups + gh) * n;
        (&self.kt[o..o + n], &self.vt[o..o + n])
    }
}

/// `out[p − lo] = scale · Σ_c x[c]·t[c·skv + p]` for keys `p` in `lo..hi` (`hi − lo <= KB`),
/// `t: [d, skv]`. Every element is accumulated over `c` in order whatever the block split, so
/// the forward and the backward recompute identical scores.
#[inline(always)]
fn block_dots(
    x: &[f32],
    t: &[f32],
    skv: usize,
    keys: std::ops::Range<usize>,
    scale: f32,
    out: &mut [f32; KB],
) {
    let (lo, n) = (keys.start, keys.len());
    if n == KB {
        let mut acc = [0f32; KB];
        for (c, &xc) in x.iter().enumerate() {
            let row = &t[c * skv + lo..][..KB];
            for l in 0..KB {
                acc[l] = xc.mul_add(row[l], acc[l]);
            }
        }
        for l in 0..KB {
            out[l] = acc[l] * scale;
        }
    } else {
        let acc = &mut out[..n];
        acc.fill(0.0);
        for (c, &xc) in x.iter().enumerate() {
            let row = &t[c * skv + lo..][..n];
            for (a, &k) in acc.iter_mut().zip(row) {
                *a = xc.mul_add(k, *a);
            }
        }
        for a in acc.iter_mut() {
            *a *= scale;
        }
    }
}

/// Key blocks `lo..hi` split at multiples of [`KB`] (aligned to the same grid in every kernel).
fn key_blocks(keys: std::ops::Range<usize>) -> impl Iterator<Item = std::ops::Range<usize>> {
    let mut lo = keys.start;
    std::iter::from_fn(move || {
        (lo < keys.end).then(|| {
            let hi = ((lo / KB + 1) * KB).min(keys.end);
            let r = lo..hi;
            lo = hi;
            r
        })
    })
}

/// `dst += Σᵢ coef[i] · row(i)` over `d = dst.len()` columns, in tiles of 64 (then 16, then 1)
/// columns whose accumulators stay in registers across the rows (no store-to-load chain).
/// Each element is summed over `i` in order whatever the tile, so results do not depend on `d`'s
/// split.
#[inline(always)]
fn axpy_rows<'a>(dst: &mut [f32], coef: &[f32], row: impl Fn(usize) -> &'a [f32]) {
    #[inline(always)]
    fn tiles<'a, const W: usize>(
        dst: &mut [f32],
        c0: &mut usize,
        coef: &[f32],
        row: &impl Fn(usize) -> &'a [f32],
    ) {
        while *c0 + W <= dst.len() {
            let mut acc = [0f32; W];
            acc.copy_from_slice(&dst[*c0..*c0 + W]);
            for (i, &w) in coef.iter().enumerate() {
                let r = &row(i)[*c0..*c0 + W];
                for l in 0..W {
                    acc[l] = w.mul_add(r[l], acc[l]);
                }
            }
            dst[*c0..*c0 + W].copy_from_slice(&acc);
            *c0 += W;
        }
    }
    let mut c0 = 0;
    tiles::<64>(dst, &mut c0, coef, &row);
    tiles::<16>(dst, &mut c0, coef, &row);
    tiles::<1>(dst, &mut c0, coef, &row);
}

fn check_dims(q: &[f32], k: &[f32], v: &[f32], dims: &AttentionDims) {
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
    assert!(
        k.len() >= skv * b * g * d && v.len() >= skv * b * g * d,
        "attention: k/v too short"
    );
}

/// [`core_attention`] for training: the same `out: [sq, b, a, d]`, plus the per-row softmax
/// statistic `lse: [sq, b, a]` (**overwritten**), `lse = log Σⱼ exp(sⱼ)` over the visible keys
/// with `s = q·kᵀ/√d` — what [`core_attention_backward`] needs besides `q, k, v, out`
/// (FlashAttention-2's saved `L`, Dao 2023). Deterministic; keys and values are read in
/// blocks of 64 transposed keys so the dot products vectorize.
///
/// # Panics
/// On inconsistent dims or slice lengths (caller bugs), as [`core_attention`].
pub fn core_attention_forward_train(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
    dims: AttentionDims,
    mask: AttentionMask,
) {
    check_dims(q, k, v, &dims);
    assert!(out.len() == q.len() && lse.len() * dims.head_dim == q.len());
    let tr = Transposed::new(k, v, &dims);
    out.par_chunks_mut(dims.head_dim)
        .zip(lse.par_iter_mut())
        .enumerate()
        .for_each_init(Vec::new, |scores, (row, (o, lse))| {
            *lse = forward_row(q, v, &tr, row, o, scores, &dims, mask);
        });
}

multiversion! {
    /// One query row of the training forward; returns its log-sum-exp.
    fn forward_row(
        q: &[f32],
        v: &[f32],
        tr: &Transposed,
        row: usize,
        o: &mut [f32],
        scores: &mut Vec<f32>,
        dims: &AttentionDims,
        mask: AttentionMask,
    ) -> f32 {
        let AttentionDims { skv, batch: b, heads: a, groups: g, head_dim: d, q_offset, .. } = *dims;
        let (t, j, h) = (row / (b * a), (row / a) % b, row % a);
        let gh = h / (a / g);
        let (kt, _) = tr.group(j, gh, dims);
        let qr = &q[row * d..][..d];
        let keys = mask.key_range(q_offset + t);
        let scale = 1.0 / (d as f32).sqrt();
        scores.resize(keys.len(), 0.0);
        let mut buf = [0f32; KB];
        for blk in key_blocks(keys.clone()) {
            let n = blk.len();
            let off = blk.start - keys.start;
            block_dots(qr, kt, skv, blk, scale, &mut buf);
            scores[off..off + n].copy_from_slice(&buf[..n]);
        }
        // Max and Σ exp with 16 partial results (vectorizes; fixed order).
        let mut acc = [f32::NEG_INFINITY; 16];
        let mut chunks = scores.chunks_exact(16);
        for c in &mut chunks {
            for l in 0..16 {
                acc[l] = acc[l].max(c[l]);
            }
        }
        let max = chunks.remainder().iter().chain(&acc).copied().fold(f32::NEG_INFINITY, f32::max);
        let mut acc = [0f32; 16];
        let mut chunks = scores.chunks_exact_mut(16);
        for c in &mut chunks {
            for l in 0..16 {
                c[l] = fast_exp(c[l] - max);
                acc[l] += c[l];
            }
        }
        let mut sum: f32 = acc.iter().sum();
        for x in chunks.into_remainder() {
            *x = fast_exp(*x - max);
            sum += *x;
        }
        let inv = 1.0 / sum;
        o.fill(0.0);
        let k0 = keys.start;
        axpy_rows(o, scores, |i| &v[(((k0 + i) * b + j) * g + gh) * d..][..d]);
        for x in o.iter_mut() {
            *x *= inv;
        }
        max + sum.ln()
    }
}

/// Backward of [`core_attention_forward_train`] (FlashAttention-2's backward, Dao 2023,
/// Algorithm 2, computed exactly without atomics). With `S = q·kᵀ/√d`, `P = exp(S − lse)`,
/// `δᵢ = Σ dOᵢ ⊙ Oᵢ`:
/// `dV = Pᵀ·dO`, `dS = P ⊙ (dO·Vᵀ − δ)`, `dQ = dS·K/√d`, `dK = dSᵀ·Q/√d`; with GQA, `dK`/`dV` of
/// a group sum over its `a/g` query heads.
///
/// Shapes: `q, out, dout, dq: [sq, b, a, d]`; `k, v: [skv, b, g, d]` (at least; only the first
/// `skv` positions are read); `dk, dv: [skv, b, g, d]` exactly; `lse: [sq, b, a]`. `dq`, `dk`
/// and `dv` are **overwritten** (keys no query sees get 0).
///
/// Parallel and deterministic: a first pass computes `dQ` (and `δ`) per query row; a second
/// pass computes `dK, dV` per (batch, group, block of 64 keys) by recomputing `P` and `dS`
/// for the queries that see the block, in a fixed order. Results are bitwise reproducible
/// for any thread count.
///
/// # Panics
/// On inconsistent dims or slice lengths (caller bugs).
#[allow(clippy::too_many_arguments)]
pub fn core_attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &[f32],
    dout: &[f32],
    lse: &[f32],
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    dims: AttentionDims,
    mask: AttentionMask,
) {
    check_dims(q, k, v, &dims);
    let AttentionDims {
        skv,
        batch: b,
        groups: g,
        head_dim: d,
        ..
    } = dims;
    assert!(out.len() == q.len() && dout.len() == q.len() && dq.len() == q.len());
    assert!(lse.len() * d == q.len(), "attention: lse is not [sq, b, a]");
    let kv_len = skv * b * g * d;
    assert!(
        dk.len() == kv_len && dv.len() == kv_len,
        "attention: dk/dv are not [skv, b, g, d]"
    );
    let tr = Transposed::new(k, v, &dims);
    let io = BackwardInputs {
        q,
        k,
        out,
        dout,
        lse,
        tr: &tr,
    };

    // Pass 1: dQ and δ per query row.
    let mut delta = vec![0f32; lse.len()];
    dq.par_chunks_mut(d)
        .zip(delta.par_iter_mut())
        .enumerate()
        .for_each(|(row, (dqr, delta))| *delta = dq_row(&io, row, dqr, &dims, mask));

    // Pass 2: dK, dV per (batch, group, key block), into [b, g, skv, d] scratch.
    let mut dk_s = vec![0f32; kv_len];
    let mut dv_s = vec![0f32; kv_len];
    dk_s.par_chunks_mut(skv * d)
        .zip(dv_s.par_chunks_mut(skv * d))
        .enumerate()
        .for_each(|(jg, (dkg, dvg))| {
            dkg.par_chunks_mut(KB * d)
                .zip(dvg.par_chunks_mut(KB * d))
                .enumerate()
                .for_each(|(blk, (dkb, dvb))| {
                    let keys = blk * KB..(blk * KB + KB).min(skv);
                    dkv_block(&io, &delta, jg, keys, dkb, dvb, &dims, mask);
                });
        });

    // Back to [skv, b, g, d].
    for (dst, src) in [(dk, &dk_s), (dv, &dv_s)] {
        dst.par_chunks_mut(d).enumerate().for_each(|(r, row)| {
            let (p, jg) = (r / (b * g), r % (b * g));
            row.copy_from_slice(&src[(jg * skv + p) * d..][..d]);
        });
    }
}

struct BackwardInputs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    out: &'a [f32],
    dout: &'a [f32],
    lse: &'a [f32],
    tr: &'a Transposed,
}

multiversion! {
    /// `dq` of one query row; returns `δ = Σ dO ⊙ O`.
    fn dq_row(io: &BackwardInputs, row: usize, dqr: &mut [f32], dims: &AttentionDims, mask: AttentionMask) -> f32 {
        let AttentionDims { skv, batch: b, heads: a, groups: g, head_dim: d, q_offset, .. } = *dims;
        let (t, j, h) = (row / (b * a), (row / a) % b, row % a);
        let gh = h / (a / g);
        let (kt, vt) = io.tr.group(j, gh, dims);
        let (qr, dor, or) = (&io.q[row * d..][..d], &io.dout[row * d..][..d], &io.out[row * d..][..d]);
        let delta = dot(dor, or);
        let lse = io.lse[row];
        let scale = 1.0 / (d as f32).sqrt();
        let (mut s, mut dp) = ([0f32; KB], [0f32; KB]);
        dqr.fill(0.0);
        for blk in key_blocks(mask.key_range(q_offset + t)) {
            block_dots(qr, kt, skv, blk.clone(), scale, &mut s);
            block_dots(dor, vt, skv, blk.clone(), 1.0, &mut dp);
            let n = blk.len();
            for (s, &dp) in s[..n].iter_mut().zip(&dp[..n]) {
                *s = fast_exp(*s - lse) * (dp - delta); // dS
            }
            let k0 = blk.start;
            axpy_rows(dqr, &s[..n], |i| &io.k[(((k0 + i) * b + j) * g + gh) * d..][..d]);
        }
        for o in dqr.iter_mut() {
            *o *= scale;
        }
        delta
    }
}

multiversion! {
    /// `dk, dv: [keys.len(), d]` of one key block of batch/group `jg = j·g + gh`.
    fn dkv_block(
        io: &BackwardInputs,
        delta: &[f32],
        jg: usize,
        keys: std::ops::Range<usize>,
        dk: &mut [f32],
        dv: &mut [f32],
        dims: &AttentionDims,
        mask: AttentionMask,
    ) {
        let AttentionDims { sq, skv, batch: b, heads: a, groups: g, head_dim: d, q_offset } = *dims;
        let (j, gh, hpg) = (jg / g, jg % g, a / g);
        let (kt, vt) = io.tr.group(j, gh, dims);
        let scale = 1.0 / (d as f32).sqrt();
        // Queries at positions q_offset + t that can see some key in the block.
        // Query position `pos` sees key `p` iff `pos + 1 - w <= p <= pos`.
        let last_pos = match mask.sliding_window {
            Some(w) => (keys.end + w).saturating_sub(2),
            None => usize::MAX,
        };
        let first_t = keys.start.saturating_sub(q_offset);
        let end_t = match last_pos.checked_sub(q_offset) {
            Some(last_t) => sq.min(last_t.saturating_add(1)),
            None => 0,
        };
        let (mut s, mut dp) = ([0f32; KB], [0f32; KB]);
        for t in first_t..end_t {
            let visible = mask.key_range(q_offset + t);
            let lo = visible.start.max(keys.start);
            let hi = visible.end.min(keys.end);
            if lo >= hi {
                continue;
            }
            for h in gh * hpg..(gh + 1) * hpg {
                let row = (t * b + j) * a + h;
                let (qr, dor) = (&io.q[row * d..][..d], &io.dout[row * d..][..d]);
                let (lse, dl) = (io.lse[row], delta[row]);
                block_dots(qr, kt, skv, lo..hi, scale, &mut s);
                block_dots(dor, vt, skv, lo..hi, 1.0, &mut dp);
                for i in 0..hi - lo {
                    let p = fast_exp(s[i] - lse);
                    let ds = p * (dp[i] - dl);
                    let r = (lo - keys.start + i) * d;
                    for ((dv, dk), (&x, &y)) in dv[r..r + d].iter_mut().zip(&mut dk[r..r + d]).zip(dor.iter().zip(qr)) {
                        *dv = p.mul_add(x, *dv);
                        *dk = ds.mul_add(y, *dk);
                    }
                }
            }
        }
        for x in dk.iter_mut() {
            *x *= scale;
        }
    }
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
