//! The paged KV cache and the ragged batch a serving engine runs (vLLM's PagedAttention, Kwon
//! et al. 2023): keys and values live in fixed-size blocks of one shared pool, each sequence
//! names its blocks in a block table, and one forward runs new tokens of many sequences —
//! prompt chunks and single decode tokens side by side — through the shared layer forward.

use crate::lora::LoraWeights;
use crate::{ModelError, NewTokens, Result, TransformerConfig};
use ferrotron_tensor::quant::QuantRows;
use std::ops::Range;
use std::sync::Arc;

/// Keys and values of every layer in blocks of `block_size` tokens. Per layer
/// `k, v: [num_blocks · block_size, g, d]` f32; token `t` of block `b` is row
/// `b · block_size + t`. Which block holds which sequence's tokens is the caller's business
/// (the engine's block manager): a [`RaggedSeq`] names them.
#[derive(Clone, Debug)]
pub struct PagedKvCache {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    block_size: usize,
    num_blocks: usize,
    /// Values per token per layer: `g · d`.
    row: usize,
}

impl PagedKvCache {
    /// A pool of `num_blocks` blocks of `block_size` tokens for `config`'s layers.
    ///
    /// # Errors
    /// A zero block size or block count.
    pub fn new(config: &TransformerConfig, block_size: usize, num_blocks: usize) -> Result<Self> {
        if block_size == 0 || num_blocks == 0 {
            return Err(ModelError::Input(format!(
                "paged KV cache: block size {block_size} and block count {num_blocks} must be \
                 positive"
            )));
        }
        let row = config.num_query_groups * config.kv_channels;
        let per_layer = num_blocks * block_size * row;
        let pool = || {
            (0..config.num_layers)
                .map(|_| vec![0f32; per_layer])
                .collect()
        };
        Ok(PagedKvCache {
            keys: pool(),
            values: pool(),
            block_size,
            num_blocks,
            row,
        })
    }

    /// Bytes one block takes over all layers: `2 · layers · block_size · g · d · 4`.
    pub fn bytes_per_block(config: &TransformerConfig, block_size: usize) -> usize {
        2 * config.num_layers * block_size * config.num_query_groups * config.kv_channels * 4
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Writes `k, v: [n, g, d]` of one sequence's tokens at positions `start..start + n` of
    /// layer `layer` into the blocks `table` names.
    pub(crate) fn write(
        &mut self,
        layer: usize,
        table: &[u32],
        start: usize,
        k: &[f32],
        v: &[f32],
    ) {
        let (bs, row) = (self.block_size, self.row);
        for (i, (kr, vr)) in k.chunks_exact(row).zip(v.chunks_exact(row)).enumerate() {
            let pos = start + i;
            let at = (table[pos / bs] as usize * bs + pos % bs) * row;
            self.keys[layer][at..at + row].copy_from_slice(kr);
            self.values[layer][at..at + row].copy_from_slice(vr);
        }
    }

    /// Copies one sequence's first `len` tokens of layer `layer` into contiguous
    /// `k, v: [len, g, d]` (a prompt chunk then runs the tiled attention kernel).
    pub(crate) fn gather(&self, layer: usize, table: &[u32], len: usize) -> (Vec<f32>, Vec<f32>) {
        let (bs, row) = (self.block_size, self.row);
        let mut k = Vec::with_capacity(len * row);
        let mut v = Vec::with_capacity(len * row);
        for block_start in (0..len).step_by(bs) {
            let n = bs.min(len - block_start);
            let at = table[block_start / bs] as usize * bs * row;
            k.extend_from_slice(&self.keys[layer][at..at + n * row]);
            v.extend_from_slice(&self.values[layer][at..at + n * row]);
        }
        (k, v)
    }

    /// Layer `layer`'s whole pool: `k, v: [num_blocks · block_size, g, d]`.
    pub(crate) fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        (&self.keys[layer], &self.values[layer])
    }
}

/// One sequence's part of a [`RaggedBatch`]: `num_tokens` new tokens at positions
/// `context_len..context_len + num_tokens`, after `context_len` tokens whose keys and values
/// are already in the blocks of `block_table`.
#[derive(Clone, Debug, PartialEq)]
pub struct RaggedSeq {
    /// New tokens of this sequence in the batch (its rows are consecutive).
    pub num_tokens: usize,
    /// Tokens already cached (the position of the first new token).
    pub context_len: usize,
    /// Block ids holding positions `0..context_len + num_tokens` (position `p` in block
    /// `block_table[p / block_size]`); the new tokens' keys and values are written there.
    pub block_table: Vec<u32>,
    /// Logits for this many of the sequence's last new tokens (0: none, e.g. a prompt chunk
    /// mid-prompt; 1: the next token; `1 + k`: verifying `k` speculative tokens).
    pub num_logits: usize,
    /// Attend row by row as decode steps do (each new token a query at its own position, the
    /// arithmetic of a one-token step), instead of the tiled prefill kernel: speculative
    /// verification then computes exactly what decoding the tokens one by one computes.
    pub row_by_row: bool,
    /// The LoRA adapter this sequence's rows take (`None`: the base model alone); see
    /// [`crate::lora::LoraWeights`].
    pub adapter: Option<Arc<LoraWeights>>,
    /// The sequence's prompt length: new tokens at positions before it are prompt tokens,
    /// the others generated ones ([`crate::NewTokens`]: how quantized weights multiply
    /// them).
    pub prompt_len: usize,
}

/// New tokens of several sequences in one forward (vLLM's flattened batch): `tokens` holds
/// each sequence's new tokens in turn, `seqs` says whose they are.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RaggedBatch {
    /// `[Σ num_tokens]`, sequence after sequence.
    pub tokens: Vec<u32>,
    pub seqs: Vec<RaggedSeq>,
}

impl RaggedBatch {
    /// Rotary position of every row `[Σ num_tokens]`.
    pub fn positions(&self) -> Vec<usize> {
        self.seqs
            .iter()
            .flat_map(|s| s.context_len..s.context_len + s.num_tokens)
            .collect()
    }

    /// Row ranges of the sequences, in order.
    pub fn row_ranges(&self) -> impl Iterator<Item = (Range<usize>, &RaggedSeq)> {
        self.seqs.iter().scan(0, |start, s| {
            let rows = *start..*start + s.num_tokens;
            *start += s.num_tokens;
            Some((rows, s))
        })
    }

    /// Each run of rows of prompt tokens and of generated tokens, in order, with the
    /// quantized kernels' path of its kind ([`crate::NewTokens`]).
    pub(crate) fn quant_rows(&self) -> Vec<(Range<usize>, QuantRows)> {
        let mut out: Vec<(Range<usize>, QuantRows)> = Vec::new();
        for (rows, s) in self.row_ranges() {
            let prompt = s.prompt_len.saturating_sub(s.context_len).min(rows.len());
            let parts = [
                (rows.start..rows.start + prompt, NewTokens::Prompt),
                (rows.start + prompt..rows.end, NewTokens::Generated),
            ];
            for (r, kind) in parts.into_iter().filter(|(r, _)| !r.is_empty()) {
                let path = kind.quant_rows();
                match out.last_mut() {
                    Some((last, p)) if *p == path && last.end == r.start => last.end = r.end,
                    _ => out.push((r, path)),
                }
            }
        }
        out
    }

    /// The rows that take a LoRA adapter, with their adapter: consecutive sequences of one
    /// adapter form one range.
    pub(crate) fn adapter_rows(&self) -> Vec<(Range<usize>, &LoraWeights)> {
        let mut out: Vec<(Range<usize>, &LoraWeights)> = Vec::new();
        for (rows, s) in self.row_ranges() {
            let Some(w) = s.adapter.as_deref() else {
                continue;
            };
            match out.last_mut() {
                Some((r, last)) if r.end == rows.start && std::ptr::eq(*last, w) => {
                    r.end = rows.end
                }
                _ => out.push((rows, w)),
            }
        }
        out
    }

    /// Checks the batch against the model and the cache: token count, ids below `vocab`,
    /// positions within `max_position_embeddings`, block tables long enough and inside the
    /// pool.
    pub fn validate(&self, c: &TransformerConfig, cache: &PagedKvCache) -> Result<()> {
        let bad = |msg: String| Err(ModelError::Input(format!("ragged batch: {msg}")));
        let total: usize = self.seqs.iter().map(|s| s.num_tokens).sum();
        if total != self.tokens.len() || self.seqs.is_empty() {
            return bad(format!(
                "{} tokens for {} sequences of {total} new tokens",
                self.tokens.len(),
                self.seqs.len()
            ));
        }
        if let Some(&id) = self.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return bad(format!("token id {id} >= vocabulary size {}", c.vocab_size));
        }
        for (i, s) in self.seqs.iter().enumerate() {
            let end = s.context_len + s.num_tokens;
            if s.num_tokens == 0 || s.num_logits > s.num_tokens || end > c.max_position_embeddings {
                return bad(format!(
                    "sequence {i}: {} new tokens after {}, logits for {} (max_position_embeddings \
                     {})",
                    s.num_tokens, s.context_len, s.num_logits, c.max_position_embeddings
                ));
            }
            let need = end.div_ceil(cache.block_size());
            let outside = s
                .block_table
                .iter()
                .find(|&&b| b as usize >= cache.num_blocks());
            if s.block_table.len() < need || outside.is_some() {
                return bad(format!(
                    "sequence {i}: block table {:?} cannot hold {end} tokens in {} blocks of {}",
                    s.block_table,
                    cache.num_blocks(),
                    cache.block_size()
                ));
            }
        }
        Ok(())
    }
}
