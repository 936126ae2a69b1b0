//! The inference forwards of a whole model: [`GptModel::forward`] over a KV cache (`generate`,
//! scoring, perplexity) and [`GptModel::forward_paged`] over a ragged batch in a paged cache
//! (the serving engine), both through the training layers' forward without keeping
//! activations, and which kernels multiply their rows by quantized weights ([`NewTokens`]).

use crate::lora::LoraWeights;
use crate::train::core_attention::KeysValues;
use crate::train::forward::{Pass, layer_forward};
use crate::{GptModel, KvCache, ModelError, PagedKvCache, RaggedBatch, Result};
use ferrotron_tensor::gemm::matmul_weight_t_with;
use ferrotron_tensor::quant::QuantRows;

/// Which positions get logits from [`GptModel::forward`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsMode {
    /// Every token: logits `[s, b, v]`.
    All,
    /// Only the last token of each sequence: logits `[b, v]` (generation).
    Last,
}

/// What the new tokens of a KV-cached forward are, which decides how quantized weights
/// multiply their rows (llama.cpp's prompt processing or its token generation's integer
/// dot products, [`QuantRows`]): by what the rows are, never by how many a step
/// holds, so a request's arithmetic is the same alone ([`GptModel::forward_with_lora`], what
/// `generate` runs) and in any served batch ([`RaggedSeq::prompt_len`](crate::RaggedSeq::prompt_len)).
/// Other weights compute the same either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NewTokens {
    /// Prompt tokens: llama.cpp's prompt processing ([`QuantRows::Prefill`]).
    Prompt,
    /// Generated tokens (decoding, verifying proposals): activations quantized to int8 per
    /// 32 values, integer dot products.
    Generated,
    /// Neither in particular (scoring, perplexity): by the number of rows
    /// ([`QuantRows::BySize`]).
    Any,
}

impl NewTokens {
    /// The quantized kernels' path of these rows.
    pub fn quant_rows(self) -> QuantRows {
        match self {
            NewTokens::Prompt => QuantRows::Prefill,
            NewTokens::Generated => QuantRows::Decode,
            NewTokens::Any => QuantRows::BySize,
        }
    }
}

impl GptModel {
    /// Runs `tokens: [s, b]` (Megatron order: token `t` of sequence `j` at `t·b + j`) after the
    /// `cache.len()` tokens already cached, appending their keys/values to `cache`.
    ///
    /// Returns logits `[s, b, v]` for [`LogitsMode::All`] or `[b, v]` for [`LogitsMode::Last`].
    /// Errors: token ids `>= v`, a batch size other than the cache's, more tokens than the
    /// cache holds, or a model that is a shard or stage.
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        mode: LogitsMode,
    ) -> Result<Vec<f32>> {
        self.forward_with_lora(tokens, cache, mode, None, NewTokens::Any)
    }

    /// [`GptModel::forward`] of `new` tokens with the LoRA adapter `lora` on every row
    /// (`None`: the model alone): the arithmetic of a served request with that adapter
    /// ([`RaggedSeq::adapter`](crate::RaggedSeq::adapter)) and those tokens, so a lone
    /// request gets the same logits bit for bit. The logits of [`LogitsMode::Last`] take the
    /// generated tokens' kernels, as a served batch's logits rows do.
    ///
    /// # Errors
    /// As [`GptModel::forward`], or an adapter made for another base.
    pub fn forward_with_lora(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        mode: LogitsMode,
        lora: Option<&LoraWeights>,
        new: NewTokens,
    ) -> Result<Vec<f32>> {
        self.require_whole("the KV-cached forward runs")?;
        if let Some(w) = lora {
            w.check_fits(self)?;
        }
        // Run the whole pass on a rayon worker: the many small parallel kernels then start
        // inline instead of each being injected into the pool from outside (a futex handoff).
        rayon::scope(|_| {
            let b = cache.batch();
            if b == 0 || tokens.is_empty() || !tokens.len().is_multiple_of(b) {
                return Err(ModelError::Input(format!(
                    "{} tokens do not form whole rows of batch {b}",
                    tokens.len()
                )));
            }
            let s = tokens.len() / b;
            let start = cache.len();
            if start + s > cache.capacity() {
                return Err(ModelError::Input(format!(
                    "{} cached + {s} new tokens exceed the KV cache capacity {}",
                    start,
                    cache.capacity()
                )));
            }
            let mut x = self.embed_forward(tokens)?.0;
            let positions: Vec<usize> = (start..start + s)
                .flat_map(|p| std::iter::repeat_n(p, b))
                .collect();
            let mut pass = Pass::generation(self, &positions, s, b);
            pass.adapter_rows = lora.map(|w| (0..s * b, w)).into_iter().collect();
            pass.quant_rows = vec![(0..s * b, new.quant_rows())];
            for (layer_index, layer) in self.layers().iter().enumerate() {
                let kv = KeysValues::Cached {
                    cache: &mut *cache,
                    layer: layer_index,
                };
                // The activations a backward would need are dropped at once.
                x = layer_forward(layer, &pass, x, false, kv)?.1;
            }
            cache.advance(s);
            let (rows, quant) = match mode {
                LogitsMode::All => (0..s * b, new.quant_rows()),
                LogitsMode::Last => ((s - 1) * b..s * b, QuantRows::Decode),
            };
            self.logits_of_rows(x.host(), rows, quant)
        })
    }

    /// Runs a ragged batch (new tokens of several sequences, each after its own cached
    /// tokens in `cache`; see [`RaggedBatch`]) through the layers, writing the new keys and
    /// values into the sequences' blocks. Returns logits `[n, v]` of the last
    /// [`RaggedSeq::num_logits`](crate::RaggedSeq::num_logits) new tokens of each sequence,
    /// `n` in all, in batch order.
    ///
    /// A batch of one sequence computes exactly what [`GptModel::forward_with_lora`] computes
    /// for the same tokens (same kernels on the same rows: prompt rows as
    /// [`NewTokens::Prompt`], the others as [`NewTokens::Generated`]). With quantized
    /// weights a sequence's rows compute the same bits whatever else the batch holds; other
    /// weights choose their kernels by the number of rows (equal up to float rounding).
    ///
    /// # Errors
    /// A batch [`RaggedBatch::validate`] rejects, a LoRA adapter made for another base, or a
    /// model that is a shard or stage.
    pub fn forward_paged(&self, batch: &RaggedBatch, cache: &mut PagedKvCache) -> Result<Vec<f32>> {
        self.require_whole("the paged forward runs")?;
        batch.validate(&self.local, cache)?;
        let adapter_rows = batch.adapter_rows();
        for (_, w) in &adapter_rows {
            w.check_fits(self)?;
        }
        rayon::scope(|_| {
            let mut x = self.embed_forward(&batch.tokens)?.0;
            let positions = batch.positions();
            let mut pass = Pass::generation(self, &positions, positions.len(), 1);
            pass.adapter_rows = adapter_rows;
            pass.quant_rows = batch.quant_rows();
            for (layer_index, layer) in self.layers().iter().enumerate() {
                let kv = KeysValues::Paged {
                    cache: &mut *cache,
                    layer: layer_index,
                    batch,
                };
                x = layer_forward(layer, &pass, x, false, kv)?.1;
            }
            let last_rows = batch
                .row_ranges()
                .flat_map(|(r, s)| r.end - s.num_logits..r.end);
            self.logits_of_rows(x.host(), last_rows, QuantRows::Decode)
        })
    }

    /// The final norm and the output layer over the rows `rows` of `x: [rows, h]` (a
    /// quantized output layer on `quant`'s path): logits `[n, v]` in the order given.
    fn logits_of_rows(
        &self,
        x: &[f32],
        rows: impl Iterator<Item = usize>,
        quant: QuantRows,
    ) -> Result<Vec<f32>> {
        let h = self.local.hidden_size;
        let hidden: Vec<f32> = rows.flat_map(|r| &x[r * h..(r + 1) * h]).copied().collect();
        let n = hidden.len() / h;
        let normed = self.final_norm(&hidden)?.0;
        let v = self.local.vocab_size;
        let mut logits = vec![0f32; n * v];
        let w = self.output_weight()?.weight_ref();
        matmul_weight_t_with(normed.host(), w, &mut logits, (n, v, h), false, quant);
        Ok(logits)
    }
}
