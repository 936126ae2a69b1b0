//! Core attention `softmax(q·kᵀ/√d + bias + mask)·v` with grouped-query heads, causal masking,
//! an optional sliding window, optional per-document masking of packed rows and an optional
//! ALiBi bias (Vaswani et al. 2017; GQA: Ainslie et al. 2023; Mistral's window; Megatron's
//! `reset_attention_mask`; ALiBi: Press et al. 2022). Mirrors HF `eager_attention_forward` in
//! f32. The training forward (saving the logsumexp) and its backward live in `train.rs`, with
//! f32 or bf16 products (`train_bf16.rs`, [`AttentionPrecision`]) on the operands and tiles of
//! `tiles.rs`; document starts in `documents.rs`; ALiBi slopes in `alibi.rs`.

use ferrotron_tensor::multiversion;
use ferrotron_tensor::ops::dot;
use rayon::prelude::*;

mod alibi;
mod documents;
mod tiles;
mod train;
mod train_bf16;
use alibi::alibi_bias;
pub use alibi::alibi_slopes;
pub use documents::{DocumentStarts, document_starts};
pub use train::{core_attention_backward, core_attention_forward_train};
pub use train_bf16::AttentionPrecision;

/// Which keys each query sees: keys at positions `j <= i` (causal); with a window `w`, only
/// `i - j < w` (query `i` attends key `j` iff `0 <= i - j < w`, HF Mistral semantics); with
/// documents, only keys of the query's own document (`j >= start(i)`, Megatron's
/// `reset_attention_mask`). The visible keys of a query always form one range
/// ([`AttentionMask::key_range`]). With ALiBi slopes, the visible keys' scores also get the
/// bias `slope_h·(j − i)` ([`alibi_slopes`]). `Default`: causal only, no ALiBi.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct AttentionMask<'a> {
    /// Window `w` in tokens (query `i` sees keys `i − w < j <= i`); `None`: unbounded.
    pub sliding_window: Option<usize>,
    /// Per-token document starts `[s, b]` of packed rows; `None`: one document per row.
    /// Indexed by absolute position: `[sq, b]` for a pass without offsets, the whole
    /// sequence's starts for the training kernels' blocks at offsets (context parallelism).
    pub documents: Option<DocumentStarts<'a>>,
    /// ALiBi slopes `[a]`, one per query head of this call (a tensor-parallel rank passes the
    /// slice of its own heads, e.g. `&alibi_slopes(total)[rank·a..][..a]`): query head `h` at
    /// position `i` adds `slope_h·(j − i)` to its score of key `j` (positions are absolute,
    /// query `t` at `q_offset + t`; with documents, `j − i` is also the distance within the
    /// document). `None`: no bias.
    pub alibi_slopes: Option<&'a [f32]>,
}

impl AttentionMask<'_> {
    /// Half-open range of key positions visible to the query at position `pos` of sequence
    /// `seq`: `max(start(pos), pos + 1 − w) ..= pos`.
    ///
    /// # Panics
    /// With documents, when `pos >= s` or `seq >= b` (caller bugs).
    pub fn key_range(&self, pos: usize, seq: usize) -> std::ops::Range<usize> {
        let window_lo = match self.sliding_window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        };
        let doc_lo = self.documents.map_or(0, |docs| docs.start(pos, seq));
        window_lo.max(doc_lo)..pos + 1
    }

    /// Last query position (inclusive) of sequence `seq` that may see key `key`, or
    /// `usize::MAX` when only causality bounds it: `min(key + w − 1, end(key) − 1)`. Keys
    /// past the documents' `s` are bounded by the last document.
    pub fn last_query(&self, key: usize, seq: usize) -> usize {
        let window = self
            .sliding_window
            .map_or(usize::MAX, |w| (key + w).saturating_sub(1));
        let document = self.documents.map_or(usize::MAX, |docs| {
            let s = docs.seq_len();
            if s == 0 {
                0
            } else {
                docs.end(key.min(s - 1), seq) - 1
            }
        });
        window.min(document)
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
    /// Position of the first key/value token: `k, v` hold positions `kv_offset..kv_offset +
    /// skv` (the masks compare absolute positions). Non-zero only for the training kernels'
    /// blocks of a longer sequence (context parallelism's chunks); 0 everywhere else.
    pub kv_offset: usize,
}

/// `out = softmax(q·kᵀ/√d + alibi + mask)·v` per sequence and head (`alibi` only with
/// [`AttentionMask::alibi_slopes`]).
///
/// Shapes: `q, out: [sq, b, a, d]`; `k, v: [skv, b, g, d]` (key `j` at position `j`); query
/// head `h` reads key/value group `h / (a/g)`. Backward needs `q, k, v` and the row-wise
/// softmax statistics (or recomputes them).
///
/// # Panics
/// On inconsistent dims or slice lengths, document starts that are not `[sq, b]` or come with
/// a query offset, or ALiBi slopes that are not `[a]` (caller bugs).
pub fn core_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    dims: AttentionDims,
    mask: AttentionMask,
) {
    check_dims(q, k, v, &dims, &mask);
    assert!(out.len() == q.len(), "attention: out is not [sq, b, a, d]");
    assert!(
        dims.kv_offset == 0,
        "attention: the inference kernel reads keys from position 0"
    );
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
            let q_pos = q_offset + t;
            let query = Query {
                row: qr,
                pos: q_pos,
                keys: mask.key_range(q_pos, j),
                alibi_slope: mask.alibi_slopes.map(|s| s[h]),
                scale,
            };
            let rows = KvRows::Contiguous { b, j, g, gh };
            attend_row(&query, k, v, &rows, o, scores);
        });
}

/// One query row of [`core_attention`]: its values `[d]`, absolute position, visible keys,
/// ALiBi slope and score scale.
struct Query<'a> {
    row: &'a [f32],
    pos: usize,
    keys: std::ops::Range<usize>,
    alibi_slope: Option<f32>,
    scale: f32,
}

/// Where the key/value row `[d]` of a position is: `[skv, b, g, d]` order for sequence `j`,
/// or the paged layout through a block table; group `gh` in both.
enum KvRows<'a> {
    Contiguous {
        b: usize,
        j: usize,
        g: usize,
        gh: usize,
    },
    Paged {
        table: &'a [u32],
        block_size: usize,
        g: usize,
        gh: usize,
    },
}

impl KvRows<'_> {
    /// Offset of position `pos`'s row (head dim `d`).
    #[inline(always)]
    fn offset(&self, pos: usize, d: usize) -> usize {
        match *self {
            KvRows::Contiguous { b, j, g, gh } => ((pos * b + j) * g + gh) * d,
            KvRows::Paged {
                table,
                block_size: bs,
                g,
                gh,
            } => ((table[pos / bs] as usize * bs + pos % bs) * g + gh) * d,
        }
    }
}

multiversion! {
    /// `o = softmax(q·kᵀ·scale + alibi)·v` for one query row over its visible keys, key/value
    /// rows `[d]` where `rows` says in `k` and `v`; `scores` is scratch. The one arithmetic of
    /// [`core_attention`] and [`paged_decode_attention`] (fixed-order sums: the same result on
    /// every dispatch path), so a paged decode computes bit for bit what a contiguous cache
    /// does.
    fn attend_row(query: &Query, k: &[f32], v: &[f32], rows: &KvRows, o: &mut [f32], scores: &mut Vec<f32>) {
        let d = o.len();
        scores.clear();
        let mut max = f32::NEG_INFINITY;
        for pos in query.keys.clone() {
            let kr = &k[rows.offset(pos, d)..][..d];
            let mut s = dot(query.row, kr) * query.scale;
            if let Some(slope) = query.alibi_slope {
                s += alibi_bias(slope, pos as i32 - query.pos as i32);
            }
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
        for (pos, &p) in query.keys.clone().zip(scores.iter()) {
            let vr = &v[rows.offset(pos, d)..][..d];
            let w = p * inv;
            for (o, &x) in o.iter_mut().zip(vr) {
                *o += w * x;
            }
        }
    }
}

/// Keys and values stored in fixed-size blocks (vLLM's PagedAttention layout): one layer's
/// `k, v: [num_blocks · block_size, g, d]`, token `t` of a block at row `block · block_size +
/// t`.
#[derive(Clone, Copy, Debug)]
pub struct PagedKv<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    /// Tokens per block.
    pub block_size: usize,
    /// Key/value heads (query groups) `g`.
    pub groups: usize,
    /// Head dim `d`.
    pub head_dim: usize,
}

/// One decode query of [`paged_decode_attention`]: its sequence's block table (block ids,
/// position `p` in block `table[p / block_size]`) and the query's position (keys `0..=pos`
/// are stored).
#[derive(Clone, Copy, Debug)]
pub struct PagedQuery<'a> {
    pub block_table: &'a [u32],
    pub pos: usize,
}

/// Decode attention over paged keys and values (vLLM `paged_attention_v1`): `q, out: [n, a,
/// d]`, token `i` the query `queries[i]` (its rows of `out` written) or, when `None`, left to
/// another kernel (its rows of `out` untouched: a ragged batch's prompt chunks); query head
/// `h` reads group `h / (a/g)`. Computes exactly what [`core_attention`] computes for the
/// same token over a contiguous cache (same per-row arithmetic). `mask.documents` must be
/// `None`.
///
/// # Panics
/// On inconsistent lengths, a block table too short for `pos`, a block outside `kv`, or
/// document starts (caller bugs).
pub fn paged_decode_attention(
    q: &[f32],
    kv: PagedKv<'_>,
    queries: &[Option<PagedQuery<'_>>],
    heads: usize,
    out: &mut [f32],
    mask: AttentionMask,
) {
    let PagedKv {
        k,
        v,
        block_size: bs,
        groups: g,
        head_dim: d,
    } = kv;
    assert!(
        g > 0 && d > 0 && bs > 0 && heads.is_multiple_of(g) && mask.documents.is_none(),
        "paged attention: bad dims (a {heads}, g {g}, d {d}, block size {bs})"
    );
    assert!(q.len() == queries.len() * heads * d && out.len() == q.len());
    assert!(k.len() == v.len() && k.len().is_multiple_of(bs * g * d));
    let blocks = k.len() / (bs * g * d);
    for query in queries.iter().flatten() {
        let need = query.pos / bs + 1;
        assert!(
            query.block_table.len() >= need
                && query.block_table[..need]
                    .iter()
                    .all(|&b| (b as usize) < blocks),
            "paged attention: block table {:?} does not hold position {} in {blocks} blocks",
            query.block_table,
            query.pos
        );
    }
    if let Some(slopes) = mask.alibi_slopes {
        assert!(
            slopes.len() == heads,
            "paged attention: need one ALiBi slope per head"
        );
    }
    let scale = 1.0 / (d as f32).sqrt();
    let heads_per_group = heads / g;
    out.par_chunks_mut(d)
        .zip(q.par_chunks(d))
        .enumerate()
        .for_each_init(Vec::new, |scores, (row, (o, qr))| {
            let (i, h) = (row / heads, row % heads);
            let Some(PagedQuery { block_table, pos }) = queries[i] else {
                return;
            };
            let gh = h / heads_per_group;
            let query = Query {
                row: qr,
                pos,
                keys: mask.key_range(pos, 0),
                alibi_slope: mask.alibi_slopes.map(|s| s[h]),
                scale,
            };
            let rows = KvRows::Paged {
                table: block_table,
                block_size: bs,
                g,
                gh,
            };
            attend_row(&query, k, v, &rows, o, scores);
        });
}

/// Shape checks shared by the inference and training kernels (caller bugs panic with the
/// offending dims): `q`, `k`, `v` against `dims` (keys reaching the last query or all before
/// the first), document starts covering every position, and ALiBi slopes against `[a]`.
pub(super) fn check_dims(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: &AttentionDims,
    mask: &AttentionMask,
) {
    let AttentionDims {
        sq,
        skv,
        batch: b,
        heads: a,
        groups: g,
        head_dim: d,
        q_offset,
        kv_offset,
    } = *dims;
    // The keys reach the last query, or all precede the first one (a block of a longer
    // sequence's keys).
    let (q_end, kv_end) = (q_offset + sq, kv_offset + skv);
    assert!(
        g > 0
            && d > 0
            && a % g == 0
            && kv_offset <= q_offset
            && (q_end <= kv_end || kv_end <= q_offset),
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
    if let Some(docs) = mask.documents {
        // Indexed by absolute position: every query and key position.
        assert!(
            docs.batch() == b && docs.seq_len() >= q_end.max(kv_end),
            "attention: doc_starts are [{}, {}], need b = {b} and every position of the \
             queries ({q_offset}..{q_end}) and keys ({kv_offset}..{kv_end})",
            docs.seq_len(),
            docs.batch()
        );
    }
    if let Some(slopes) = mask.alibi_slopes {
        assert!(
            slopes.len() == a,
            "attention: {} ALiBi slopes for {a} query heads (need one per query head of this \
             call)",
            slopes.len()
        );
    }
}
