//! The engine's counters and gauges (vLLM's `/metrics` names, `ferrotron:` prefix), updated by
//! the engine thread and read by the server's `/metrics` without locks.

use super::FinishReason;
use super::block_manager::BlockManager;
use super::scheduler::Scheduler;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Counters (monotonic) and gauges (current values) of one engine.
#[derive(Debug, Default)]
pub struct EngineStats {
    /// Requests running (admitted, holding KV blocks).
    pub num_requests_running: AtomicU64,
    /// Requests waiting for admission (new or preempted).
    pub num_requests_waiting: AtomicU64,
    /// KV blocks in use / all blocks, as `f64` bits.
    kv_cache_usage: AtomicU64,
    /// Prompt tokens of requests that produced their first token.
    pub prompt_tokens_total: AtomicU64,
    /// Tokens generated.
    pub generation_tokens_total: AtomicU64,
    /// Prompt tokens looked up in the prefix cache (vLLM `prefix_cache_queries`).
    pub prefix_cache_queries_total: AtomicU64,
    /// Prompt tokens served from it (vLLM `prefix_cache_hits`).
    pub prefix_cache_hits_total: AtomicU64,
    /// Sequences preempted (their blocks freed, recomputed later).
    pub num_preemptions_total: AtomicU64,
    /// Tokens proposed by speculative decoding, and those the model accepted.
    pub spec_decode_num_draft_tokens_total: AtomicU64,
    pub spec_decode_num_accepted_tokens_total: AtomicU64,
    /// Requests finished by a stop token, by the length limit, and aborted.
    pub request_success_stop: AtomicU64,
    pub request_success_length: AtomicU64,
    pub request_abort: AtomicU64,
}

impl EngineStats {
    /// KV blocks in use as a fraction of the pool.
    pub fn kv_cache_usage(&self) -> f64 {
        f64::from_bits(self.kv_cache_usage.load(Relaxed))
    }

    /// Refreshes the gauges from the queues and the pool.
    pub(crate) fn set_queue(&self, s: &Scheduler, blocks: &BlockManager) {
        self.num_requests_running
            .store(s.running.len() as u64, Relaxed);
        self.num_requests_waiting
            .store(s.waiting.len() as u64, Relaxed);
        self.kv_cache_usage.store(blocks.usage().to_bits(), Relaxed);
        self.num_preemptions_total.store(s.preemptions, Relaxed);
    }

    /// A request's prompt was processed (`cached` of its `prompt` tokens from the cache).
    pub(crate) fn prompt_done(&self, prompt: usize, cached: usize) {
        self.prompt_tokens_total.fetch_add(prompt as u64, Relaxed);
        self.prefix_cache_queries_total
            .fetch_add(prompt as u64, Relaxed);
        self.prefix_cache_hits_total
            .fetch_add(cached as u64, Relaxed);
    }

    /// `n` tokens were generated.
    pub(crate) fn generated(&self, n: usize) {
        self.generation_tokens_total.fetch_add(n as u64, Relaxed);
    }

    /// `n` tokens were proposed.
    pub(crate) fn proposed(&self, n: usize) {
        self.spec_decode_num_draft_tokens_total
            .fetch_add(n as u64, Relaxed);
    }

    /// `n` proposed tokens were accepted.
    pub(crate) fn accepted(&self, n: usize) {
        self.spec_decode_num_accepted_tokens_total
            .fetch_add(n as u64, Relaxed);
    }

    /// A request ended.
    pub(crate) fn finished(&self, reason: FinishReason) {
        match reason {
            FinishReason::Stop(_) => &self.request_success_stop,
            FinishReason::Length => &self.request_success_length,
            FinishReason::Abort => &self.request_abort,
        }
        .fetch_add(1, Relaxed);
    }
}
