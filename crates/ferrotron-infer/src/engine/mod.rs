//! The serving engine (vLLM's `EngineCore` on our model): requests join and leave at every
//! step ([`scheduler`]: continuous batching, chunked prefill, preemption), their keys and
//! values live in a paged pool ([`ferrotron_model::PagedKvCache`]) whose blocks the
//! [`block_manager`] hands out and shares between prompts with a common prefix, and each step
//! runs every scheduled sequence's new tokens as one ragged batch
//! ([`ferrotron_model::GptModel::forward_paged`]) and samples a token for each sequence that
//! reached its end. Decoding sequences may also verify speculative proposals
//! ([`speculative`]: prompt lookup, or a draft model, `draft.rs`). [`EngineHandle`] runs an
//! engine on its own thread.
//!
//! A request alone in the engine computes exactly what [`crate::generate()`] computes: one
//! prefill pass over the prompt (when it fits one step's token budget) and one row per
//! decode step, with the same kernels, so greedy outputs agree token for token. Requests
//! batched together share the matrix products, whose row blocking may round the last bit
//! differently.

pub mod block_manager;
mod draft;
mod handle;
pub mod request;
pub mod scheduler;
pub mod speculative;
mod stats;

pub use handle::EngineHandle;
pub use request::{
    FinishReason, LoraRequest, OutputSink, Request, RequestId, RequestOutput, RequestParams,
    TokenOutput,
};
pub use scheduler::SchedulerConfig;
pub use speculative::{NgramConfig, SpeculativeConfig};
pub use stats::EngineStats;

use crate::sampler::SamplingError;
use block_manager::BlockManager;
use draft::DraftModel;
use ferrotron_model::{GptModel, ModelError, PagedKvCache, RaggedBatch, RaggedSeq};
use request::Sequence;
use scheduler::{Scheduled, Scheduler};
use std::ops::ControlFlow;
use std::sync::Arc;

/// Errors of the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// A request the engine cannot run (empty, too long for the context, duplicate id).
    #[error("{0}")]
    Request(String),
    /// Settings that cannot work together (e.g. a KV pool smaller than one full context).
    #[error("{0}")]
    Config(String),
}

/// The engine's sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Tokens per KV block (vLLM's default 16).
    pub block_size: usize,
    /// Blocks in the KV pool ([`EngineConfig::blocks_for_memory`]).
    pub num_blocks: usize,
    pub scheduler: SchedulerConfig,
    /// Reuse cached full blocks of earlier prompts (vLLM's `enable_prefix_caching`).
    pub enable_prefix_caching: bool,
    /// Speculative decoding (`None`: off).
    pub speculative: Option<SpeculativeConfig>,
    /// No proposals in a step that starts with at least this many running sequences
    /// (vLLM's `speculative_disable_by_batch_size`): verifying proposals costs compute that
    /// batching already uses, so speculation pays at small batches. A draft model still runs
    /// the real tokens then, to stay in step.
    pub speculative_disable_by_batch_size: Option<usize>,
}

impl EngineConfig {
    /// Blocks of `block_size` tokens that fit in `bytes`, each holding the keys and values of
    /// every model in `models` (the target, and a draft model's pool beside it).
    pub fn blocks_for_memory(models: &[&GptModel], block_size: usize, bytes: u64) -> usize {
        (bytes / Self::memory_for_tokens(models, block_size, block_size).max(1)) as usize
    }

    /// Bytes of the blocks that hold `tokens` tokens of every model in `models` (the inverse
    /// of [`EngineConfig::blocks_for_memory`], rounded up to whole blocks).
    pub fn memory_for_tokens(models: &[&GptModel], block_size: usize, tokens: usize) -> u64 {
        let per_block: u64 = models
            .iter()
            .map(|m| PagedKvCache::bytes_per_block(m.config(), block_size) as u64)
            .sum();
        per_block * tokens.div_ceil(block_size.max(1)) as u64
    }
}

/// The limits every request is checked against before it is queued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestLimits {
    /// The model's context length (`max_position_embeddings`): prompt plus output.
    pub max_model_len: usize,
    /// Token ids must be below this.
    pub vocab_size: usize,
}

impl RequestLimits {
    /// Checks `request`: a non-empty prompt of known token ids that leaves room for at least
    /// one generated token, `max_tokens >= 1`, valid sampling settings. Errors name the field
    /// and the limit (vLLM's wording for the context length).
    pub fn check(&self, request: &Request) -> Result<(), EngineError> {
        let bad = |m: String| Err(EngineError::Request(m));
        let (n, max) = (request.prompt.len(), self.max_model_len);
        if n == 0 {
            return bad("the prompt is empty (zero tokens)".into());
        }
        if n >= max {
            return bad(format!(
                "This model's maximum context length is {max} tokens. However, your prompt has \
                 {n} tokens, which leaves no room for output."
            ));
        }
        if request.params.max_tokens == 0 {
            return bad("max_tokens must be at least 1".into());
        }
        if let Some(&t) = request
            .prompt
            .iter()
            .find(|&&t| t as usize >= self.vocab_size)
        {
            return bad(format!(
                "prompt token id {t} is outside the vocabulary ({} ids)",
                self.vocab_size
            ));
        }
        request.params.sampling.validate()?;
        Ok(())
    }
}

/// A model, its paged KV pool and the requests in flight.
pub struct Engine {
    model: Arc<GptModel>,
    cache: PagedKvCache,
    blocks: BlockManager,
    scheduler: Scheduler,
    config: EngineConfig,
    limits: RequestLimits,
    stats: Arc<EngineStats>,
    /// The draft model of [`SpeculativeConfig::DraftModel`].
    draft: Option<DraftModel>,
}

impl Engine {
    /// An engine over `model` (the whole model, not a shard or stage).
    ///
    /// # Errors
    /// A pool that cannot hold one full context (`num_blocks · block_size <
    /// max_position_embeddings`, vLLM's check, so no sequence can outgrow it), or zero limits.
    pub fn new(model: Arc<GptModel>, config: EngineConfig) -> Result<Engine, EngineError> {
        let c = model.config();
        let max_model_len = c.max_position_embeddings;
        let capacity = config.num_blocks * config.block_size;
        if capacity < max_model_len {
            let need =
                EngineConfig::memory_for_tokens(&[&model], config.block_size, max_model_len) as f64;
            return Err(EngineError::Config(format!(
                "the KV cache holds {capacity} tokens ({} blocks of {}), less than the model's \
                 context of {max_model_len} tokens: give it at least {:.3} GiB",
                config.num_blocks,
                config.block_size,
                need / (1u64 << 30) as f64
            )));
        }
        if let Some(spec) = &config.speculative {
            spec.validate().map_err(EngineError::Config)?;
        }
        let s = config.scheduler;
        if s.max_num_seqs == 0 || s.max_num_batched_tokens == 0 {
            return Err(EngineError::Config(format!(
                "max_num_seqs ({}) and max_num_batched_tokens ({}) must be positive",
                s.max_num_seqs, s.max_num_batched_tokens
            )));
        }
        let cache = PagedKvCache::new(c, config.block_size, config.num_blocks)?;
        let blocks = BlockManager::new(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
        );
        let limits = RequestLimits {
            max_model_len,
            vocab_size: c.vocab_size,
        };
        Ok(Engine {
            model,
            cache,
            blocks,
            scheduler: Scheduler::default(),
            config,
            limits,
            stats: Arc::new(EngineStats::default()),
            draft: None,
        })
    }

    /// Gives the engine the draft model that [`SpeculativeConfig::DraftModel`] runs: same
    /// vocabulary as the target (one tokenizer), a context at least as long; its KV pool has
    /// the target's block count and size.
    ///
    /// # Errors
    /// A config without [`SpeculativeConfig::DraftModel`], or a draft that does not fit the
    /// target ([`EngineError::Config`]).
    pub fn with_draft_model(mut self, draft: Arc<GptModel>) -> Result<Engine, EngineError> {
        if !matches!(
            self.config.speculative,
            Some(SpeculativeConfig::DraftModel { .. })
        ) {
            return Err(EngineError::Config(
                "a draft model needs speculative decoding by draft model".into(),
            ));
        }
        let (block_size, num_blocks) = (self.config.block_size, self.config.num_blocks);
        self.draft = Some(DraftModel::new(draft, &self.model, block_size, num_blocks)?);
        Ok(self)
    }

    /// What requests are checked against.
    pub fn limits(&self) -> RequestLimits {
        self.limits
    }

    /// Counters and gauges, shared with readers on other threads.
    pub fn stats(&self) -> Arc<EngineStats> {
        self.stats.clone()
    }

    /// True while a request waits or runs.
    pub fn has_work(&self) -> bool {
        !self.scheduler.is_idle()
    }

    /// Queues `request`; its outputs go to `sink`.
    ///
    /// # Errors
    /// A request [`RequestLimits::check`] rejects, or an id already in flight.
    pub fn add_request(&mut self, request: Request, sink: OutputSink) -> Result<(), EngineError> {
        self.check(&request)?;
        self.scheduler
            .waiting
            .push_back(Sequence::new(request, sink)?);
        self.stats.set_queue(&self.scheduler, &self.blocks);
        Ok(())
    }

    /// What [`Engine::add_request`] checks: the [`RequestLimits`], a fresh id, and a LoRA
    /// adapter made for the model.
    ///
    /// # Errors
    /// The first problem found.
    pub fn check(&self, request: &Request) -> Result<(), EngineError> {
        self.limits.check(request)?;
        if let Some(lora) = &request.lora {
            if lora.id == 0 {
                return Err(EngineError::Request(format!(
                    "LoRA adapter {}: its id must be > 0 (0 is the base model's)",
                    lora.name
                )));
            }
            lora.weights
                .check_fits(&self.model)
                .map_err(|e| EngineError::Request(format!("LoRA adapter {}: {e}", lora.name)))?;
        }
        if self.find(request.id).is_some() {
            let id = request.id;
            return Err(EngineError::Request(format!(
                "request id {id} is already in flight"
            )));
        }
        Ok(())
    }

    /// Cancels request `id` (no output is sent); false when it is not in flight.
    pub fn abort(&mut self, id: crate::engine::RequestId) -> bool {
        let removed = if let Some(i) = self.scheduler.running.iter().position(|s| s.id == id) {
            Some(self.scheduler.running.remove(i))
        } else if let Some(i) = self.scheduler.waiting.iter().position(|s| s.id == id) {
            self.scheduler.waiting.remove(i)
        } else {
            None
        };
        let Some(seq) = removed else { return false };
        self.blocks.free(seq.blocks);
        self.stats.finished(FinishReason::Abort);
        self.stats.set_queue(&self.scheduler, &self.blocks);
        true
    }

    /// Ends every request in flight with [`FinishReason::Abort`] (after a failed step).
    pub fn abort_all(&mut self) {
        let seqs: Vec<Sequence> = self
            .scheduler
            .running
            .drain(..)
            .chain(self.scheduler.waiting.drain(..))
            .collect();
        for mut seq in seqs {
            self.blocks.free(std::mem::take(&mut seq.blocks));
            let out = output(&seq, None, Some(FinishReason::Abort));
            let _ = (seq.sink)(out);
            self.stats.finished(FinishReason::Abort);
        }
        self.stats.set_queue(&self.scheduler, &self.blocks);
    }

    fn find(&self, id: crate::engine::RequestId) -> Option<&Sequence> {
        let s = &self.scheduler;
        s.running
            .iter()
            .chain(s.waiting.iter())
            .find(|q| q.id == id)
    }

    /// One step: schedules, runs the ragged batch, samples and reports a token for every
    /// sequence that reached its end, retires finished ones. Returns the tokens run (0 when
    /// idle).
    ///
    /// # Errors
    /// A failed forward (the requests stay in flight; [`Engine::abort_all`] ends them).
    pub fn step(&mut self) -> Result<usize, EngineError> {
        let speculative = self.config.speculative.as_ref();
        let crowded = self
            .config
            .speculative_disable_by_batch_size
            .is_some_and(|n| self.scheduler.running.len() >= n);
        let max_len = self.limits.max_model_len;
        let mut plan = self.scheduler.schedule(
            &self.config.scheduler,
            &mut self.blocks,
            speculative.filter(|_| !crowded),
            max_len,
        );
        if plan.is_empty() {
            return Ok(0);
        }
        // The sequences of one LoRA adapter side by side: their rows then form one range
        // that reads the adapter's weights once per step (S-LoRA groups requests the same way).
        let running = &self.scheduler.running;
        plan.sort_by_key(|sch| running[sch.index].cache_namespace());
        match &mut self.draft {
            Some(draft) => draft.propose(&plan, &mut self.scheduler.running)?,
            None if matches!(speculative, Some(SpeculativeConfig::DraftModel { .. })) => {
                return Err(EngineError::Config(
                    "speculative decoding by draft model without a draft model \
                     (Engine::with_draft_model)"
                        .into(),
                ));
            }
            None => {}
        }
        let batch = self.ragged_batch(&plan);
        let mut logits = self.model.forward_paged(&batch, &mut self.cache)?;
        let v = self.model.local_config().vocab_size;
        let mut rows = logits.chunks_exact_mut(v);
        let mut done = Vec::new();
        for (sch, rs) in plan.iter().zip(&batch.seqs) {
            let mut seq_rows: Vec<&mut [f32]> = rows.by_ref().take(rs.num_logits).collect();
            let seq = &mut self.scheduler.running[sch.index];
            seq.record_prompt_logprobs(rs.context_len, &seq_rows);
            // Every real input token has keys and values now; each accepted proposal adds one
            // more (`next_tokens`).
            let drafted = seq.draft.len();
            seq.num_computed += sch.num_tokens - drafted;
            let sampling = if seq.num_computed == seq.tokens.len() {
                1 + drafted
            } else {
                0
            };
            let first = seq_rows.len() - sampling;
            let sampling_rows = &mut seq_rows[first..];
            if let Some(reason) = self.next_tokens(sch.index, sampling_rows) {
                done.push((sch.index, reason));
            }
            let seq = &mut self.scheduler.running[sch.index];
            // A block is shared by the prefix cache once every model holds its keys and
            // values (the draft may lag one proposal behind).
            seq.draft_computed = seq.draft_computed.min(seq.num_computed);
            let shared = match self.draft {
                Some(_) => seq.draft_computed,
                None => seq.num_computed,
            };
            self.blocks
                .commit_full_blocks(&mut seq.blocks, &seq.tokens[..shared]);
        }
        done.sort_by_key(|&(i, _)| std::cmp::Reverse(i));
        for (i, reason) in done {
            let seq = self.scheduler.running.remove(i);
            self.blocks.free(seq.blocks);
            self.stats.finished(reason);
        }
        self.stats.set_queue(&self.scheduler, &self.blocks);
        Ok(batch.tokens.len())
    }

    /// The step's ragged batch: each scheduled sequence's next tokens after its cached ones,
    /// then its proposed tokens, verified row by row.
    fn ragged_batch(&self, plan: &[Scheduled]) -> RaggedBatch {
        let mut batch = RaggedBatch::default();
        for sch in plan {
            let seq = &self.scheduler.running[sch.index];
            let real = sch.num_tokens - seq.draft.len();
            let range = seq.num_computed..seq.num_computed + real;
            batch.tokens.extend_from_slice(&seq.tokens[range.clone()]);
            batch.tokens.extend_from_slice(&seq.draft);
            let at_end = range.end == seq.tokens.len();
            let in_prompt = range.start < seq.prompt_len;
            let num_logits = match (seq.params.prompt_logprobs, in_prompt, at_end) {
                // Every row: each predicts the next prompt token (the last, at the end of
                // the prompt, the first output token).
                (Some(_), true, _) => sch.num_tokens,
                (_, _, true) => 1 + seq.draft.len(),
                _ => 0,
            };
            batch.seqs.push(RaggedSeq {
                num_tokens: sch.num_tokens,
                context_len: seq.num_computed,
                block_table: seq.blocks.table.clone(),
                num_logits,
                row_by_row: !seq.draft.is_empty(),
                adapter: seq.lora.as_ref().map(|l| l.weights.clone()),
                prompt_len: seq.prompt_len,
            });
        }
        batch
    }

    /// Chooses the next tokens of `running[index]` from its logits rows: with a proposal,
    /// row `i` verifies proposed token `i` and the first rejection (or the row after the
    /// last proposal) gives the final token. Reports each token; returns why the request
    /// ended, if it did.
    /// The rows are the sampler's to process in place.
    fn next_tokens(&mut self, index: usize, rows: &mut [&mut [f32]]) -> Option<FinishReason> {
        let draft = std::mem::take(&mut self.scheduler.running[index].draft);
        if !draft.is_empty() {
            self.stats.proposed(draft.len());
        }
        for (i, row) in rows.iter_mut().enumerate() {
            let proposed = draft.get(i).copied();
            let seq = &mut self.scheduler.running[index];
            let token = seq.choose(row, proposed);
            let accepted = proposed == Some(token.token);
            if let Some(reason) = self.emit(index, token) {
                return Some(reason);
            }
            if !accepted {
                break;
            }
            self.stats.accepted(1);
            self.scheduler.running[index].num_computed += 1;
        }
        None
    }

    /// Appends `token` to `running[index]`, counts it and reports it to the request's sink;
    /// returns why the request ended, if it did (a stop token, the length limit, or a sink
    /// that breaks).
    fn emit(&mut self, index: usize, token: TokenOutput) -> Option<FinishReason> {
        let seq = &mut self.scheduler.running[index];
        let first = seq.output().is_empty();
        if first {
            self.stats
                .prompt_done(seq.prompt_len, seq.cached_tokens.unwrap_or(0));
        }
        seq.tokens.push(token.token);
        self.stats.generated(1);
        let p = &seq.params;
        let finish = if p.stop_token_ids.contains(&token.token) {
            Some(FinishReason::Stop(token.token))
        } else if seq.output().len() >= p.max_tokens
            || seq.tokens.len() >= self.limits.max_model_len
        {
            Some(FinishReason::Length)
        } else {
            None
        };
        let mut out = output(seq, Some(token), finish);
        if first {
            out.prompt_logprobs = std::mem::take(&mut seq.prompt_logprobs);
        }
        match (seq.sink)(out) {
            ControlFlow::Continue(()) => finish,
            ControlFlow::Break(()) => Some(finish.unwrap_or(FinishReason::Abort)),
        }
    }
}

/// A sequence's output carrying `token`, ending it when `finished` says why.
fn output(
    seq: &Sequence,
    token: Option<TokenOutput>,
    finished: Option<FinishReason>,
) -> RequestOutput {
    RequestOutput {
        id: seq.id,
        token,
        finished,
        cached_tokens: seq.cached_tokens.unwrap_or(0),
        prompt_tokens: seq.prompt_len,
        prompt_logprobs: Vec::new(),
    }
}
