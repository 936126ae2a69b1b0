//! What a client asks the engine for ([`Request`], [`RequestParams`]) and what it gets back,
//! token by token ([`RequestOutput`]), plus the engine's state of one request
//! ([`Sequence`]): its tokens, how many have keys and values in the cache, its blocks and its
//! sampler.

use super::block_manager::{CacheNamespace, SeqBlocks};
use crate::sampler::{Sampler, SamplingError, SamplingParams, log_softmax};
use ferrotron_model::lora::LoraWeights;
use std::ops::ControlFlow;
use std::sync::Arc;

/// A request's id, unique among the engine's live requests.
pub type RequestId = u64;

/// Per-request generation settings (the OpenAI / vLLM `SamplingParams` the engine runs).
#[derive(Clone, Debug, PartialEq)]
pub struct RequestParams {
    /// Most tokens to generate (OpenAI `max_tokens` / `max_completion_tokens`); generation
    /// also stops at the model's `max_position_embeddings`.
    pub max_tokens: usize,
    /// Greedy or sampled choice with HF semantics (`temperature`, `top_k`, `top_p`,
    /// `repetition_penalty` over prompt and output, `seed`).
    pub sampling: SamplingParams,
    /// OpenAI `presence_penalty` in [-2, 2]: subtracted from the logit of every token already
    /// generated (output tokens only, as vLLM).
    pub presence_penalty: f32,
    /// OpenAI `frequency_penalty` in [-2, 2]: subtracted once per earlier occurrence in the
    /// output.
    pub frequency_penalty: f32,
    /// Generation stops after any of these (the model's EOS and the request's
    /// `stop_token_ids`); the stop token is part of the output.
    pub stop_token_ids: Vec<u32>,
    /// Report the chosen token's log-probability and this many most likely alternatives
    /// (`None`: no log-probabilities).
    pub logprobs: Option<usize>,
    /// Report every prompt token's log-probability given the tokens before it, with this many
    /// alternatives (vLLM's `prompt_logprobs`; OpenAI's `echo` with `logprobs`). Such a
    /// request does not use the prefix cache (cached tokens have no logits).
    pub prompt_logprobs: Option<usize>,
}

impl Default for RequestParams {
    fn default() -> Self {
        RequestParams {
            max_tokens: 16,
            sampling: SamplingParams::greedy(),
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            stop_token_ids: Vec::new(),
            logprobs: None,
            prompt_logprobs: None,
        }
    }
}

/// The LoRA adapter a request runs with (vLLM's `LoRARequest`).
#[derive(Clone, Debug)]
pub struct LoraRequest {
    /// The name clients select it by (the API's `model`).
    pub name: String,
    /// Unique among the adapters the engine ever runs, and > 0 (a name loaded again gets a
    /// new id): the prefix-cache namespace of the request's blocks.
    pub id: CacheNamespace,
    pub weights: Arc<LoraWeights>,
}

/// One request: a tokenized prompt and its settings.
#[derive(Clone, Debug)]
pub struct Request {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub params: RequestParams,
    /// The LoRA adapter its rows take (`None`: the base model).
    pub lora: Option<LoraRequest>,
}

/// Why a request ended (OpenAI's `finish_reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was generated (`"stop"`, vLLM's `stop_reason` = the token id).
    Stop(u32),
    /// `max_tokens` or the context length was reached (`"length"`).
    Length,
    /// The client went away or the request was cancelled.
    Abort,
}

/// A generated token with its log-probabilities (natural log, over the model's raw logits,
/// as vLLM's default `raw_logprobs`).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenOutput {
    pub token: u32,
    /// `log p(token)` when log-probabilities were asked for.
    pub logprob: Option<f32>,
    /// The most likely tokens and their log-probabilities, most likely first.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// What the engine reports for a request after a step that produced a token (or ended it).
#[derive(Clone, Debug, PartialEq)]
pub struct RequestOutput {
    pub id: RequestId,
    /// The new token, if the step produced one.
    pub token: Option<TokenOutput>,
    /// Set on the request's last output.
    pub finished: Option<FinishReason>,
    /// Prompt tokens whose keys and values came from the prefix cache.
    pub cached_tokens: usize,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// With [`RequestParams::prompt_logprobs`], on the first output: prompt tokens `1..` with
    /// their log-probabilities given the tokens before them.
    pub prompt_logprobs: Vec<TokenOutput>,
}

/// Receives a request's outputs; `Break` cancels the request (the client is gone).
pub type OutputSink = Box<dyn FnMut(RequestOutput) -> ControlFlow<()> + Send>;

/// The engine's state of one request.
pub(crate) struct Sequence {
    pub id: RequestId,
    /// Prompt then generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens whose keys and values are in the cache (`<= tokens.len()`).
    pub num_computed: usize,
    pub blocks: SeqBlocks,
    /// Prompt tokens served from the prefix cache at its first admission (`None` before it;
    /// a preempted sequence keeps its first count).
    pub cached_tokens: Option<usize>,
    pub params: RequestParams,
    sampler: Sampler,
    pub sink: OutputSink,
    /// Tokens proposed to follow `tokens` in this step (speculative decoding).
    pub draft: Vec<u32>,
    /// How many tokens this step proposes (`draft.len()` once a draft model has filled it).
    pub draft_room: usize,
    /// Tokens whose keys and values the draft model holds (`<= num_computed` between steps).
    pub draft_computed: usize,
    /// Log-probabilities of prompt tokens `1..` computed so far (prompt_logprobs).
    pub prompt_logprobs: Vec<TokenOutput>,
    pub lora: Option<LoraRequest>,
}

impl RequestOutput {
    /// The only output of a request the engine refused: it ends at once, with nothing.
    pub fn refused(request: &Request) -> RequestOutput {
        RequestOutput {
            id: request.id,
            token: None,
            finished: Some(FinishReason::Abort),
            cached_tokens: 0,
            prompt_tokens: request.prompt.len(),
            prompt_logprobs: Vec::new(),
        }
    }
}

impl Sequence {
    /// A waiting sequence for `request`.
    ///
    /// # Errors
    /// Invalid sampling parameters.
    pub fn new(request: Request, sink: OutputSink) -> Result<Sequence, SamplingError> {
        Ok(Sequence {
            id: request.id,
            prompt_len: request.prompt.len(),
            tokens: request.prompt,
            num_computed: 0,
            blocks: SeqBlocks::default(),
            cached_tokens: None,
            sampler: Sampler::new(request.params.sampling)?,
            params: request.params,
            sink,
            draft: Vec::new(),
            draft_room: 0,
            draft_computed: 0,
            prompt_logprobs: Vec::new(),
            lora: request.lora,
        })
    }

    /// The prefix-cache namespace of the sequence's blocks: its adapter's id, 0 for the base.
    pub fn cache_namespace(&self) -> CacheNamespace {
        self.lora.as_ref().map_or(0, |l| l.id)
    }

    /// Records the log-probabilities of the prompt tokens that the rows `rows` (logits of
    /// positions `first_pos..`) predict, skipping those already recorded (a recompute after
    /// preemption) and positions past the prompt.
    pub fn record_prompt_logprobs(&mut self, first_pos: usize, rows: &[&mut [f32]]) {
        let Some(n) = self.params.prompt_logprobs else {
            return;
        };
        if !self.output().is_empty() {
            return; // reported with the first output already
        }
        for (r, row) in rows.iter().enumerate() {
            let target = first_pos + r + 1;
            if target >= self.prompt_len || target != self.prompt_logprobs.len() + 1 {
                continue;
            }
            let mut lp = vec![0f32; row.len()];
            log_softmax(row, &mut lp);
            let token = self.tokens[target];
            self.prompt_logprobs.push(TokenOutput {
                token,
                logprob: Some(lp[token as usize]),
                top_logprobs: top_n(&lp, n),
            });
        }
    }

    /// Tokens generated so far.
    pub fn output(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// Picks the next token from `logits` (`[v]`, consumed): log-probabilities of the raw
    /// logits when asked for, then the OpenAI penalties over the output and the sampler —
    /// which, given a speculative `draft` token, keeps it with the probability that leaves
    /// the distribution unchanged ([`Sampler::verify`]).
    pub fn choose(&mut self, logits: &mut [f32], draft: Option<u32>) -> TokenOutput {
        let logprobs = self.params.logprobs.map(|_| {
            let mut lp = vec![0f32; logits.len()];
            log_softmax(logits, &mut lp);
            lp
        });
        apply_presence_frequency_penalty(
            logits,
            self.output(),
            self.params.presence_penalty,
            self.params.frequency_penalty,
        );
        let token = match draft {
            Some(d) => self.sampler.verify(logits, &self.tokens, d),
            None => self.sampler.sample(logits, &self.tokens),
        };
        let (logprob, top_logprobs) = match (&logprobs, self.params.logprobs) {
            (Some(lp), Some(n)) => (Some(lp[token as usize]), top_n(lp, n)),
            _ => (None, Vec::new()),
        };
        TokenOutput {
            token,
            logprob,
            top_logprobs,
        }
    }
}

/// OpenAI's presence and frequency penalties: `logit[j] -= count[j]·frequency + (count[j] >
/// 0)·presence` over the tokens generated so far (vLLM `apply_penalties`, output tokens only).
pub fn apply_presence_frequency_penalty(
    logits: &mut [f32],
    output: &[u32],
    presence: f32,
    frequency: f32,
) {
    if (presence == 0.0 && frequency == 0.0) || output.is_empty() {
        return;
    }
    let mut counts = std::collections::HashMap::<u32, u32>::new();
    for &t in output {
        *counts.entry(t).or_default() += 1;
    }
    for (t, n) in counts {
        if let Some(l) = logits.get_mut(t as usize) {
            *l -= n as f32 * frequency + presence;
        }
    }
}

/// The `n` largest entries of `values` as `(index, value)`, largest first (ties by index).
fn top_n(values: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut idx: Vec<u32> = (0..values.len() as u32).collect();
    let n = n.min(values.len());
    if n == 0 {
        return Vec::new();
    }
    let cmp = |a: &u32, b: &u32| {
        values[*b as usize]
            .total_cmp(&values[*a as usize])
            .then(a.cmp(b))
    };
    idx.select_nth_unstable_by(n - 1, cmp);
    idx.truncate(n);
    idx.sort_by(cmp);
    idx.into_iter().map(|i| (i, values[i as usize])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn penalties_follow_openai_and_touch_only_generated_tokens() {
        let mut logits = vec![1.0f32; 5];
        apply_presence_frequency_penalty(&mut logits, &[2, 2, 4], 0.5, 0.25);
        assert_eq!(logits, [1.0, 1.0, 1.0 - 0.5 - 0.5, 1.0, 1.0 - 0.25 - 0.5]);
    }

    #[test]
    fn top_n_orders_by_value_then_index() {
        let v = [0.1, 0.9, 0.5, 0.9, -1.0];
        assert_eq!(top_n(&v, 3), [(1, 0.9), (3, 0.9), (2, 0.5)]);
        assert!(top_n(&v, 0).is_empty());
        assert_eq!(top_n(&v, 9).len(), 5);
    }
}
