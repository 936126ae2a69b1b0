//! Continuous batching with chunked prefill (vLLM v1's unified scheduler): every step takes up
//! to `max_num_batched_tokens` new tokens — first one token per decoding sequence and the next
//! chunk of every sequence still prefilling, in arrival order, then the prompts of waiting
//! requests — so requests join and leave at every step and a long prompt never stalls the
//! running decodes. When the KV pool runs out, the newest running sequence is preempted: its
//! blocks are freed and it waits at the front of the queue to be recomputed (its full blocks
//! usually come back from the prefix cache).

use super::block_manager::{BlockManager, SeqBlocks};
use super::request::Sequence;
use super::speculative::SpeculativeConfig;
use std::collections::VecDeque;

/// Scheduling limits (vLLM's `SchedulerConfig` names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Most new tokens in one step (the chunked-prefill budget).
    pub max_num_batched_tokens: usize,
}

/// One sequence's share of a step: the running sequence `index` runs `num_tokens` new tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Scheduled {
    pub index: usize,
    pub num_tokens: usize,
}

/// The waiting queue and the running set.
#[derive(Default)]
pub(crate) struct Scheduler {
    pub waiting: VecDeque<Sequence>,
    pub running: Vec<Sequence>,
    /// Sequences preempted so far.
    pub preemptions: u64,
}

impl Scheduler {
    /// True when nothing waits or runs.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Plans the next step: which running sequences run how many new tokens (indices into
    /// `running` after the step's admissions and preemptions). Empty only when idle or when
    /// the pool cannot hold even one sequence's next token.
    /// With `speculative`, a decoding sequence also runs the tokens it proposes, as far as
    /// the budget and its limits allow: prompt lookup proposes them here
    /// ([`Sequence::draft`]); for a draft model the room is set ([`Sequence::draft_room`])
    /// and the engine fills it before the pass.
    pub fn schedule(
        &mut self,
        config: &SchedulerConfig,
        blocks: &mut BlockManager,
        speculative: Option<&SpeculativeConfig>,
        max_model_len: usize,
    ) -> Vec<Scheduled> {
        let mut budget = config.max_num_batched_tokens;
        let mut plan = Vec::new();
        let preemptions_before = self.preemptions;
        let mut i = 0;
        // A sequence that is preempted itself is the last one running: the loop ends.
        while i < self.running.len() && budget > 0 {
            let seq = &mut self.running[i];
            let remaining = seq.tokens.len() - seq.num_computed;
            let n = remaining.min(budget);
            seq.draft.clear();
            seq.draft_room = 0;
            if let (1, Some(spec)) = (remaining, speculative) {
                // Room after the real next token: the budget, max_tokens, the context.
                let left = seq.params.max_tokens.saturating_sub(seq.output().len() + 1);
                let room = max_model_len.saturating_sub(seq.tokens.len() + 1);
                let max = (budget - 1).min(left).min(room);
                seq.draft_room = match spec {
                    SpeculativeConfig::Ngram(c) => {
                        seq.draft = c.propose(&seq.tokens, max);
                        seq.draft.len()
                    }
                    SpeculativeConfig::DraftModel {
                        num_speculative_tokens,
                    } => max.min(*num_speculative_tokens),
                };
            }
            let n = n + seq.draft_room;
            if self.grow_or_preempt(i, n, blocks) {
                plan.push(Scheduled {
                    index: i,
                    num_tokens: n,
                });
                budget -= n;
                i += 1;
            }
        }
        // As vLLM, nothing is admitted in a step that preempted: the pool is short.
        let preempted = self.preemptions != preemptions_before;
        while !preempted && budget > 0 && self.running.len() < config.max_num_seqs {
            let Some(n) = self.admit_front(budget, blocks) else {
                break;
            };
            plan.push(Scheduled {
                index: self.running.len() - 1,
                num_tokens: n,
            });
            budget -= n;
        }
        plan
    }

    /// Allocates blocks for `running[i]`'s next `n` tokens, preempting the newest running
    /// sequences until they fit. False when `running[i]` itself was preempted.
    fn grow_or_preempt(&mut self, i: usize, n: usize, blocks: &mut BlockManager) -> bool {
        loop {
            let seq = &mut self.running[i];
            let need = seq.num_computed + n;
            if blocks.allocate(&mut seq.blocks, need) {
                return true;
            }
            let victim = self.running.pop().expect("running[i] exists");
            let was_self = self.running.len() == i;
            self.preempt(victim, blocks);
            if was_self {
                return false;
            }
        }
    }

    /// Frees `seq`'s blocks and puts it at the front of the queue, to be recomputed.
    fn preempt(&mut self, mut seq: Sequence, blocks: &mut BlockManager) {
        blocks.free(std::mem::take(&mut seq.blocks));
        seq.num_computed = 0;
        seq.draft_computed = 0;
        seq.draft_room = 0;
        seq.draft.clear();
        self.preemptions += 1;
        self.waiting.push_front(seq);
    }

    /// Moves the first waiting sequence into `running` with its first chunk of at most
    /// `budget` tokens (after its prefix-cache hit); `None` when its blocks do not fit.
    fn admit_front(&mut self, budget: usize, blocks: &mut BlockManager) -> Option<usize> {
        let seq = self.waiting.front_mut()?;
        let namespace = seq.cache_namespace();
        let mut hit = match seq.params.prompt_logprobs {
            None => blocks.lookup_prefix(&seq.tokens, namespace),
            Some(_) => SeqBlocks::new(namespace),
        };
        let computed = hit.table.len() * blocks.block_size();
        let n = (seq.tokens.len() - computed).min(budget);
        if !blocks.allocate(&mut hit, computed + n) {
            blocks.free(hit);
            return None;
        }
        let mut seq = self.waiting.pop_front().expect("front exists");
        seq.cached_tokens.get_or_insert(computed);
        seq.blocks = hit;
        seq.num_computed = computed;
        seq.draft_computed = computed;
        self.running.push(seq);
        Some(n)
    }
}
