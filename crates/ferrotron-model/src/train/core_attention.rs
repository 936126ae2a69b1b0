//! Core attention inside a layer: where it finds its keys and values ([`KeysValues`]: the
//! pass's own tokens, or a KV cache), and its output and log-sum-exp ([`CoreAttnOut`]), which
//! selective recompute drops and the backward recomputes from q/k/v.

use super::forward::Pass;
use super::stored::{Kept, Stored, element_bytes};
use crate::{KvCache, PagedKvCache, RaggedBatch, Result, TransformerConfig};
use ferrotron_nn::attention::{
    AttentionDims, AttentionMask, AttentionPrecision, PagedKv, PagedQuery, core_attention,
    core_attention_forward_train, paged_decode_attention,
};
use ferrotron_tensor::Buffer;

/// Where core attention finds the keys and values of a [`layer_forward`].
pub(crate) enum KeysValues<'c> {
    /// The pass's own tokens only: causal over each sequence (training, scoring).
    Fresh,
    /// After the tokens already in `cache` for the held layer `layer`: this pass's keys and
    /// values are appended, and its queries attend to every cached token (generation).
    Cached {
        cache: &'c mut KvCache,
        layer: usize,
    },
    /// After each sequence's cached tokens in the paged `cache` (serving): the rows are
    /// `batch`'s sequences' new tokens, whose keys and values are written into their blocks;
    /// each sequence's queries attend to its own tokens only.
    Paged {
        cache: &'c mut PagedKvCache,
        layer: usize,
        batch: &'c RaggedBatch,
    },
}

/// Core attention's output and softmax statistic: what selective recompute drops and the
/// backward recomputes from q/k/v.
pub(crate) struct CoreAttnOut {
    /// Core attention output `[rows, a·d]` (input of `linear_proj`).
    pub ctx: Stored,
    /// Softmax log-sum-exp per query row and head `[rows, a]`.
    pub lse: Buffer<f32>,
}

impl CoreAttnOut {
    /// Flash-style causal attention of `q: [rows, a, d]` (after rope) over `k, v: [rows, g, d]`:
    /// the output (kept through [`Kept`], which rounds it under `pass.narrow`, by the forward
    /// and by a recompute alike) and the log-sum-exp. On a context-parallel rank the keys
    /// and values of the rest of the sequence come over its group ([`Pass::cp`]).
    ///
    /// # Errors
    /// A failed context-parallel exchange.
    pub(crate) fn compute(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        pass: &Pass<'_>,
    ) -> Result<(Kept, Buffer<f32>)> {
        let c = pass.c;
        let rows = pass.positions.len();
        let mut ctx = Buffer::zeros(pass.device, rows * c.num_attention_heads * c.kv_channels);
        let mut lse = Buffer::zeros(pass.device, rows * c.num_attention_heads);
        let (dims, mask) = attention_dims(pass);
        let (o, l) = (ctx.host_mut(), lse.host_mut());
        let precision = attention_precision(pass);
        match pass.cp {
            Some(cp) => cp.attention_forward(q, k, v, o, l, dims, mask, precision)?,
            None => core_attention_forward_train(q, k, v, o, l, dims, mask, precision),
        }
        Ok((Kept::new(ctx, pass.narrow), lse))
    }

    /// [`CoreAttnOut::compute`] after the cached tokens: appends `k, v` (this pass's
    /// `[rows, g, d]`) to `cache`'s `layer` and attends to all its tokens, the queries at
    /// positions `cache.len()..`. No log-sum-exp for a single decode row (the simple kernel
    /// avoids transposing the whole cache; nothing runs a backward through generation).
    pub(crate) fn compute_cached(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        cache: &mut KvCache,
        layer: usize,
        pass: &Pass<'_>,
    ) -> (Kept, Buffer<f32>) {
        let c = pass.c;
        let rows = pass.positions.len();
        let mut ctx = Buffer::zeros(pass.device, rows * c.num_attention_heads * c.kv_channels);
        let (mut dims, mask) = attention_dims(pass);
        dims.q_offset = cache.len();
        dims.skv = cache.len() + pass.seq;
        let (keys, values) = cache.append(layer, k, v);
        let mut lse = Buffer::default();
        if rows > 1 {
            // Prefill: the register-tiled kernel is ~3x faster on many query rows.
            lse = Buffer::zeros(pass.device, rows * c.num_attention_heads);
            let (o, l) = (ctx.host_mut(), lse.host_mut());
            let precision = attention_precision(pass);
            core_attention_forward_train(q, keys, values, o, l, dims, mask, precision);
        } else {
            core_attention(q, keys, values, ctx.host_mut(), dims, mask);
        }
        (Kept::new(ctx, pass.narrow), lse)
    }

    /// [`CoreAttnOut::compute_cached`] over a ragged batch and the paged `cache`: writes every
    /// sequence's new `k, v` (`[rows, g, d]`) into its blocks of `layer`, then attends. A
    /// sequence with one new token, or any sequence marked `row_by_row`, reads its blocks in
    /// place, one query per row ([`paged_decode_attention`], the arithmetic of a contiguous
    /// cache's decode); a prompt chunk gathers its keys and values and runs the tiled kernel,
    /// as a contiguous cache's prefill does. No log-sum-exp.
    pub(crate) fn compute_paged(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        (cache, layer, batch): (&mut PagedKvCache, usize, &RaggedBatch),
        pass: &Pass<'_>,
    ) -> (Kept, Buffer<f32>) {
        let c = pass.c;
        let (a, g, d) = (c.num_attention_heads, c.num_query_groups, c.kv_channels);
        let rows = pass.positions.len();
        let mut ctx = Buffer::zeros(pass.device, rows * a * d);
        let (_, mask) = attention_dims(pass);
        for (r, s) in batch.row_ranges() {
            let (k, v) = (
                &k[r.start * g * d..r.end * g * d],
                &v[r.start * g * d..r.end * g * d],
            );
            cache.write(layer, &s.block_table, s.context_len, k, v);
        }
        let out = ctx.host_mut();
        // One query per row decoded in place; `None` for the rows of prompt chunks.
        let mut queries = vec![None; rows];
        for (r, s) in batch.row_ranges() {
            if s.num_tokens == 1 || s.row_by_row {
                for (i, row) in r.enumerate() {
                    let (block_table, pos) = (&s.block_table[..], s.context_len + i);
                    queries[row] = Some(PagedQuery { block_table, pos });
                }
                continue;
            }
            let skv = s.context_len + s.num_tokens;
            let (keys, values) = cache.gather(layer, &s.block_table, skv);
            let dims = AttentionDims {
                sq: s.num_tokens,
                skv,
                batch: 1,
                heads: a,
                groups: g,
                head_dim: d,
                q_offset: s.context_len,
                kv_offset: 0,
            };
            let mut lse = vec![0f32; s.num_tokens * a];
            let (q, o) = (
                &q[r.start * a * d..r.end * a * d],
                &mut out[r.start * a * d..r.end * a * d],
            );
            let precision = attention_precision(pass);
            core_attention_forward_train(q, &keys, &values, o, &mut lse, dims, mask, precision);
        }
        if queries.iter().any(Option::is_some) {
            let (keys, values) = cache.layer(layer);
            let kv = PagedKv {
                k: keys,
                v: values,
                block_size: cache.block_size(),
                groups: g,
                head_dim: d,
            };
            paged_decode_attention(q, kv, &queries, a, out, mask);
        }
        (Kept::new(ctx, pass.narrow), Buffer::default())
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> u128 {
        self.ctx.bytes() + self.lse.bytes()
    }

    /// Bytes per token of [`CoreAttnOut`]: `a·dv` (bf16 when `narrow`) + `a` f32 (in u128,
    /// so no config overflows).
    pub(crate) fn bytes_per_row(c: &TransformerConfig, narrow: bool) -> u128 {
        let a = c.num_attention_heads as u128;
        a * c.value_head_dim() as u128 * element_bytes(narrow) + a * 4
    }
}

/// bf16 products (PyTorch's flash attention under autocast) when the pass keeps bf16
/// activations (bf16 training), f32 otherwise.
pub(crate) fn attention_precision(pass: &Pass<'_>) -> AttentionPrecision {
    if pass.narrow {
        AttentionPrecision::Bf16
    } else {
        AttentionPrecision::F32
    }
}

/// Attention dims and mask of a fresh causal pass over the batch.
pub(crate) fn attention_dims<'b>(pass: &Pass<'b>) -> (AttentionDims, AttentionMask<'b>) {
    let c = pass.c;
    (
        AttentionDims {
            sq: pass.seq,
            skv: pass.seq,
            batch: pass.micro_batch,
            heads: c.num_attention_heads,
            groups: c.num_query_groups,
            head_dim: c.kv_channels,
            q_offset: 0,
            kv_offset: 0,
        },
        AttentionMask {
            sliding_window: c.sliding_window,
            documents: pass.documents,
            alibi_slopes: pass.model.alibi_slopes(),
        },
    )
}
