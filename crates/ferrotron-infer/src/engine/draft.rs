//! Draft-model speculative decoding (vLLM's draft-model proposer; Leviathan et al. 2023,
//! "Fast Inference from Transformers via Speculative Decoding"): a smaller model with the same
//! vocabulary proposes `k` tokens greedily for every decoding sequence, and the target verifies
//! them in its next pass (`super::speculative`).
//!
//! The draft keeps its own paged KV pool with the target's block size and block count, and
//! writes each sequence's keys and values into the blocks of the sequence's own block table:
//! one allocation serves both models. Every step the draft first runs the real tokens the
//! target runs (prompt chunks included, so a full block the prefix cache shares holds the
//! draft's keys and values too), catching up on tokens it has not seen, then `k - 1` one-token
//! passes over its own proposals. Greedy proposals are a point-mass draft distribution, so the
//! target's rejection rule ([`crate::sampler::Sampler::verify`]) keeps its distribution exactly.

use super::EngineError;
use super::request::Sequence;
use super::scheduler::Scheduled;
use ferrotron_model::{GptModel, PagedKvCache, RaggedBatch, RaggedSeq};
use ferrotron_tensor::ops::argmax;
use std::sync::Arc;

/// The draft model and its KV pool.
pub(crate) struct DraftModel {
    model: Arc<GptModel>,
    cache: PagedKvCache,
}

impl DraftModel {
    /// A draft for `target` over a pool of `num_blocks` blocks of `block_size` tokens.
    ///
    /// # Errors
    /// A vocabulary that differs from the target's, a shorter context, or a pool that cannot
    /// be allocated.
    pub fn new(
        model: Arc<GptModel>,
        target: &GptModel,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<DraftModel, EngineError> {
        let (d, t) = (model.config(), target.config());
        if d.vocab_size != t.vocab_size {
            return Err(EngineError::Config(format!(
                "the draft model's vocabulary has {} ids, the target's {}: they must share a \
                 tokenizer",
                d.vocab_size, t.vocab_size
            )));
        }
        if d.max_position_embeddings < t.max_position_embeddings {
            return Err(EngineError::Config(format!(
                "the draft model's context ({} tokens) is shorter than the target's ({})",
                d.max_position_embeddings, t.max_position_embeddings
            )));
        }
        let cache = PagedKvCache::new(d, block_size, num_blocks)?;
        Ok(DraftModel { model, cache })
    }

    /// Fills `draft` of every scheduled sequence in `running` with `draft_room` proposed
    /// tokens (see the module doc), advancing `draft_computed` over what the draft has run.
    ///
    /// # Errors
    /// A failed forward pass of the draft.
    pub fn propose(
        &mut self,
        plan: &[Scheduled],
        running: &mut [Sequence],
    ) -> Result<(), EngineError> {
        // The real tokens the target runs this step, after what the draft has seen.
        let mut batch = RaggedBatch::default();
        for sch in plan {
            let seq = &running[sch.index];
            let (start, end) = (seq.draft_computed, real_end(seq, sch));
            batch.tokens.extend_from_slice(&seq.tokens[start..end]);
            batch
                .seqs
                .push(draft_row(seq, end - start, start, seq.draft_room > 0));
        }
        let mut proposing: Vec<usize> = Vec::new();
        let logits = self.model.forward_paged(&batch, &mut self.cache)?;
        let mut rows = logits.chunks_exact(self.model.config().vocab_size);
        for sch in plan {
            let seq = &mut running[sch.index];
            seq.draft_computed = real_end(seq, sch);
            if seq.draft_room > 0 {
                seq.draft
                    .push(argmax(rows.next().expect("a row per proposer")) as u32);
                proposing.push(sch.index);
            }
        }
        // One token at a time: each proposal is the next pass's input.
        loop {
            proposing.retain(|&i| running[i].draft.len() < running[i].draft_room);
            if proposing.is_empty() {
                return Ok(());
            }
            let mut batch = RaggedBatch::default();
            for &i in &proposing {
                let seq = &running[i];
                batch.tokens.push(*seq.draft.last().expect("proposed"));
                batch.seqs.push(draft_row(seq, 1, seq.draft_computed, true));
            }
            let logits = self.model.forward_paged(&batch, &mut self.cache)?;
            let rows = logits.chunks_exact(self.model.config().vocab_size);
            for (&i, row) in proposing.iter().zip(rows) {
                let seq = &mut running[i];
                seq.draft.push(argmax(row) as u32);
                seq.draft_computed += 1;
            }
        }
    }
}

/// The end of the real tokens `seq` runs in the step `sch` (its proposals come after).
fn real_end(seq: &Sequence, sch: &Scheduled) -> usize {
    seq.num_computed + sch.num_tokens - seq.draft_room
}

/// `num_tokens` of `seq` after `context_len` in its own blocks, with the last row's logits
/// when `propose`.
fn draft_row(seq: &Sequence, num_tokens: usize, context_len: usize, propose: bool) -> RaggedSeq {
    RaggedSeq {
        num_tokens,
        context_len,
        block_table: seq.blocks.table.clone(),
        num_logits: usize::from(propose),
        row_by_row: false,
        adapter: None,
        prompt_len: seq.prompt_len,
    }
}
