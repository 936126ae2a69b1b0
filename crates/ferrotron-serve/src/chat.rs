//! `POST /v1/chat/completions`: the messages rendered with the model's chat template
//! (`add_generation_prompt`, encoded without special tokens as `apply_chat_template` does),
//! `n` choices, streamed as `chat.completion.chunk` deltas or whole, with chat-style
//! `logprobs` (`content: [{token, logprob, bytes, top_logprobs}]`).

use crate::error::ApiError;
use crate::generation::{ChoiceEvent, Generation};
use crate::protocol::{ChatCompletionRequest, EndpointDefaults, check_logprobs, parse_request};
use crate::state::AppState;
use crate::stream::{Endpoint, Envelope, respond};
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use ferrotron_data::chat::ChatMessage;
use ferrotron_infer::engine::TokenOutput;
use serde_json::{Value, json};
use std::sync::Arc;

/// The handler.
pub async fn chat_completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    match run(state, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// The prompt's token ids: the messages through the chat template.
pub fn chat_prompt(state: &AppState, req: &ChatCompletionRequest) -> Result<Vec<u32>, ApiError> {
    let template = state.model.chat_template.as_ref().ok_or_else(|| {
        ApiError::bad_request(
            "the model has no chat template (tokenizer_config.json); use /v1/completions",
            Some("messages"),
        )
    })?;
    if req.messages.is_empty() {
        return Err(ApiError::bad_request("messages is empty", Some("messages")));
    }
    let messages = req
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| Ok(ChatMessage::new(m.role.clone(), m.text(i)?)))
        .collect::<Result<Vec<_>, ApiError>>()?;
    let text = template
        .render(&messages, true)
        .map_err(|e| ApiError::bad_request(format!("chat template: {e}"), Some("messages")))?;
    state
        .model
        .tokenizer
        .encode(&text, false)
        .map_err(|e| ApiError::bad_request(e.to_string(), Some("messages")))
}

async fn run(state: Arc<AppState>, body: &[u8]) -> Result<Response, ApiError> {
    let req: ChatCompletionRequest = parse_request(body)?;
    let f = &req.sampling;
    let target = state.resolve_model(f.model.as_deref())?;
    if req.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(ApiError::bad_request(
            "tools are not supported",
            Some("tools"),
        ));
    }
    let n = f.n(state.max_n)?;
    let top = check_logprobs(req.top_logprobs, "top_logprobs")?;
    let logprobs = match (req.logprobs.unwrap_or(false), top) {
        (true, top) => Some(top.unwrap_or(0)),
        (false, Some(_)) => {
            let m = "top_logprobs requires logprobs to be true";
            return Err(ApiError::bad_request(m, Some("top_logprobs")));
        }
        (false, None) => None,
    };
    let prompt = chat_prompt(&state, &req)?;
    let mut sampling = f.clone();
    sampling.max_tokens = req.max_completion_tokens.or(f.max_tokens);
    let limits = state.engine.limits();
    let choices = (0..n)
        .map(|i| {
            let defaults = EndpointDefaults {
                max_tokens: None,
                logprobs,
                prompt_logprobs: None,
            };
            let seed = state.seed(f.seed, i);
            let eos = &state.model.eos_token_ids;
            let params = sampling.choice_params(prompt.len(), limits, eos, defaults, seed)?;
            Ok((prompt.clone(), params))
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let generation = Generation::start(state.clone(), choices, target.lora)?;
    let envelope = Envelope::new(&state, &target.name, "chatcmpl", n);
    let endpoint = Chat {
        logprobs: logprobs.is_some(),
        started: vec![false; n],
    };
    respond(generation, endpoint, envelope, f).await
}

/// `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`.
fn chat_logprobs(g: &Generation, tokens: &[TokenOutput]) -> Value {
    let entry = |id: u32, lp: f32| {
        let text = g.token_text(id);
        json!({"token": text, "logprob": lp, "bytes": text.as_bytes()})
    };
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut e = entry(t.token, t.logprob.unwrap_or(f32::NAN));
            e["top_logprobs"] = t
                .top_logprobs
                .iter()
                .map(|&(id, lp)| entry(id, lp))
                .collect();
            e
        })
        .collect();
    json!({ "content": content })
}

/// Chat choices: a message whole; streamed, deltas with the role in each choice's first.
struct Chat {
    logprobs: bool,
    /// Per choice: whether a chunk (with the role) was sent.
    started: Vec<bool>,
}

impl Endpoint for Chat {
    const OBJECT: &'static str = "chat.completion";
    const CHUNK_OBJECT: &'static str = "chat.completion.chunk";

    fn whole_choice(&self, g: &Generation, i: usize, tokens: &[TokenOutput]) -> Value {
        let content = g.choices[i].text();
        json!({
            "message": {"role": "assistant", "content": content, "tool_calls": []},
            "logprobs": self.logprobs.then(|| chat_logprobs(g, tokens)),
        })
    }

    fn chunk_choice(&mut self, ev: &ChoiceEvent, g: &Generation) -> Option<Value> {
        let i = ev.index;
        let lp = ev.token.as_ref().filter(|t| t.logprob.is_some());
        let first = !self.started[i];
        if !first && ev.text.is_empty() && ev.finish.is_none() && lp.is_none() {
            return None;
        }
        self.started[i] = true;
        let mut delta = json!({"content": ev.text});
        if first {
            delta["role"] = json!("assistant");
        }
        let logprobs = lp.map(|t| chat_logprobs(g, std::slice::from_ref(t)));
        Some(json!({"delta": delta, "logprobs": logprobs}))
    }
}
