//! One HTTP request's choices in flight: submitted to the engine thread, their outputs
//! received on one channel, turned into text incrementally (transformers' streamer rule),
//! matched against the stop strings (text held back while it could still be the start of one,
//! as vLLM's detokenizer does), and cancelled in the engine when the request goes away (the
//! client disconnected, or a stop string ended a choice).

use crate::error::ApiError;
use crate::protocol::ChoiceParams;
use crate::state::AppState;
use ferrotron_data::{StreamDecoder, Tokenizer};
use ferrotron_infer::engine::{
    FinishReason, LoraRequest, Request, RequestId, RequestOutput, TokenOutput,
};
use serde_json::{Value, json};
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

/// Why a choice ended: OpenAI's `finish_reason` and vLLM's `stop_reason` (the stop string or
/// stop token id that ended it; null for EOS and length).
#[derive(Clone, Debug, PartialEq)]
pub struct Finish {
    pub reason: &'static str,
    pub stop_reason: Value,
}

/// What one engine output of a choice adds.
#[derive(Clone, Debug)]
pub struct ChoiceEvent {
    pub index: usize,
    /// Text released by this output (may be empty: held back, or a partial character).
    pub text: String,
    /// The generated token, with its log-probabilities when asked for.
    pub token: Option<TokenOutput>,
    pub finish: Option<Finish>,
}

/// The text state of one choice.
pub struct ChoiceText {
    decoder: StreamDecoder<Arc<Tokenizer>>,
    params: ChoiceParams,
    /// Text decoded so far (cut at a matched stop string).
    text: String,
    /// Bytes of `text` released to the client.
    sent: usize,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub finish: Option<Finish>,
    /// Prompt tokens `1..` with their log-probabilities (when asked for).
    pub prompt_logprobs: Vec<TokenOutput>,
    /// Seconds from the request's arrival to this choice's first token.
    pub first_token_seconds: Option<f64>,
}

impl ChoiceText {
    fn new(tokenizer: Arc<Tokenizer>, params: ChoiceParams, prompt_tokens: usize) -> Self {
        ChoiceText {
            decoder: StreamDecoder::new(tokenizer, true),
            params,
            text: String::new(),
            sent: 0,
            prompt_tokens,
            cached_tokens: 0,
            completion_tokens: 0,
            finish: None,
            prompt_logprobs: Vec::new(),
            first_token_seconds: None,
        }
    }

    /// The whole text generated (after the choice finished: all of it released).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Applies one engine output; returns the text it releases. Sets [`ChoiceText::finish`]
    /// when the engine ended the choice or a stop string matched.
    fn push(&mut self, out: &RequestOutput) -> Result<String, ApiError> {
        let terr = |e: ferrotron_data::TokenizerError| ApiError::internal(e.to_string());
        self.cached_tokens = out.cached_tokens;
        if !out.prompt_logprobs.is_empty() {
            self.prompt_logprobs = out.prompt_logprobs.clone();
        }
        let searched_from = self.text.len();
        if let Some(t) = &out.token {
            self.completion_tokens += 1;
            // A stop token's text is not part of the output (vLLM); EOS is special anyway.
            let stop_token = matches!(out.finished, Some(FinishReason::Stop(s)) if s == t.token);
            if !stop_token && let Some(piece) = self.decoder.push(t.token).map_err(terr)? {
                self.text.push_str(&piece);
            }
        }
        if let Some(reason) = out.finished {
            if let Some(rest) = self.decoder.finish().map_err(terr)? {
                self.text.push_str(&rest);
            }
            self.finish = Some(self.engine_finish(reason));
        }
        if let Some((at, stop)) = self.find_stop(searched_from) {
            self.text.truncate(at);
            self.finish = Some(Finish {
                reason: "stop",
                stop_reason: Value::String(stop),
            });
        }
        let end = if self.finish.is_some() {
            self.text.len()
        } else {
            self.releasable()
        };
        let piece = self.text[self.sent..end].to_string();
        self.sent = end;
        Ok(piece)
    }

    fn engine_finish(&self, reason: FinishReason) -> Finish {
        match reason {
            FinishReason::Stop(t) if self.params.eos_token_ids.contains(&t) => Finish {
                reason: "stop",
                stop_reason: Value::Null,
            },
            FinishReason::Stop(t) => Finish {
                reason: "stop",
                stop_reason: json!(t),
            },
            FinishReason::Length => Finish {
                reason: "length",
                stop_reason: Value::Null,
            },
            FinishReason::Abort => Finish {
                reason: "abort",
                stop_reason: Value::Null,
            },
        }
    }

    fn max_stop_len(&self) -> usize {
        self.params
            .stop_strings
            .iter()
            .map(String::len)
            .max()
            .unwrap_or(0)
    }

    /// The earliest stop string in the text that may include bytes added after
    /// `searched_from`: its byte offset and the string.
    fn find_stop(&self, searched_from: usize) -> Option<(usize, String)> {
        let mut start = searched_from.saturating_sub(self.max_stop_len());
        while !self.text.is_char_boundary(start) {
            start -= 1;
        }
        let hay = &self.text[start..];
        self.params
            .stop_strings
            .iter()
            .filter_map(|s| hay.find(s.as_str()).map(|i| (start + i, s.clone())))
            .min_by_key(|(i, _)| *i)
    }

    /// How far the text can be released while unfinished: all but the last
    /// `max_stop_len - 1` bytes (they may begin a stop string), on a character boundary.
    fn releasable(&self) -> usize {
        let mut end = self
            .text
            .len()
            .saturating_sub(self.max_stop_len().saturating_sub(1));
        while !self.text.is_char_boundary(end) {
            end -= 1;
        }
        end.max(self.sent)
    }
}

/// The choices of one HTTP request in flight. Dropping it cancels the unfinished ones.
pub struct Generation {
    state: Arc<AppState>,
    rx: UnboundedReceiver<(usize, RequestOutput)>,
    pub choices: Vec<ChoiceText>,
    ids: Vec<RequestId>,
    pub started: Instant,
}

impl Generation {
    /// Submits one engine request per `(prompt, params)`, all with the LoRA adapter `lora`
    /// (`None`: the base model); choice `i` is the `i`-th.
    ///
    /// # Errors
    /// A request the engine refuses (400), or an engine that has stopped (503).
    pub fn start(
        state: Arc<AppState>,
        choices: Vec<(Vec<u32>, ChoiceParams)>,
        lora: Option<LoraRequest>,
    ) -> Result<Generation, ApiError> {
        if let Some(l) = &lora {
            state.adapters.count_request(&l.name);
        }
        let (tx, rx) = unbounded_channel();
        let mut g = Generation {
            state: state.clone(),
            rx,
            choices: Vec::with_capacity(choices.len()),
            ids: Vec::with_capacity(choices.len()),
            started: Instant::now(),
        };
        for (index, (prompt, params)) in choices.into_iter().enumerate() {
            let id = state.engine.next_request_id();
            let tx = tx.clone();
            let sink = Box::new(move |out| match tx.send((index, out)) {
                Ok(()) => ControlFlow::Continue(()),
                Err(_) => ControlFlow::Break(()),
            });
            let tokenizer = state.model.tokenizer.clone();
            g.choices
                .push(ChoiceText::new(tokenizer, params.clone(), prompt.len()));
            g.ids.push(id);
            let request = Request {
                id,
                prompt,
                params: params.engine,
                lora: lora.clone(),
            };
            state
                .engine
                .submit(request, sink)
                .map_err(|e| match state.is_draining() {
                    true => ApiError::unavailable("the server is shutting down"),
                    false => ApiError::bad_request(e.to_string(), None),
                })?;
        }
        Ok(g)
    }

    /// The next output of any choice; `None` once every choice has finished.
    ///
    /// # Errors
    /// A detokenization failure (500).
    pub async fn next(&mut self) -> Result<Option<ChoiceEvent>, ApiError> {
        if self.choices.iter().all(|c| c.finish.is_some()) {
            return Ok(None);
        }
        let Some((index, out)) = self.rx.recv().await else {
            return Err(ApiError::internal(
                "the engine stopped before the request finished",
            ));
        };
        let choice = &mut self.choices[index];
        let was_finished = choice.finish.is_some();
        if was_finished {
            // Outputs the engine sent before a stop string cancelled the choice.
            return Ok(Some(ChoiceEvent {
                index,
                text: String::new(),
                token: None,
                finish: None,
            }));
        }
        if out.token.is_some() && choice.first_token_seconds.is_none() {
            choice.first_token_seconds = Some(self.started.elapsed().as_secs_f64());
        }
        let text = choice.push(&out)?;
        let finish = choice.finish.clone();
        if finish.is_some() {
            if out.finished.is_none() {
                self.state.engine.abort(self.ids[index]);
            }
            self.state.metrics.choice_finished(choice, self.started);
        }
        Ok(Some(ChoiceEvent {
            index,
            text,
            token: out.token,
            finish,
        }))
    }

    /// Prompt, completion and cached tokens over all choices (a prompt counted once per
    /// distinct prompt: `n` choices of one prompt share it, as OpenAI counts usage).
    pub fn usage(&self, choices_per_prompt: usize) -> Value {
        let per = choices_per_prompt.max(1);
        let prompt: usize = self
            .choices
            .iter()
            .step_by(per)
            .map(|c| c.prompt_tokens)
            .sum();
        let cached: usize = self
            .choices
            .iter()
            .step_by(per)
            .map(|c| c.cached_tokens)
            .sum();
        let completion: usize = self.choices.iter().map(|c| c.completion_tokens).sum();
        json!({
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        })
    }

    /// A token's text as the logprobs fields show it (the token decoded alone).
    pub fn token_text(&self, token: u32) -> String {
        self.state
            .model
            .tokenizer
            .decode(&[token], false)
            .unwrap_or_default()
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        for (c, &id) in self.choices.iter().zip(&self.ids) {
            if c.finish.is_none() {
                self.state.engine.abort(id);
            }
        }
    }
}
