//! `POST /v1/completions`: text completion of one or more prompts (strings or token ids),
//! `n` choices each, streamed or whole, with `echo` and per-token `logprobs` in OpenAI's
//! legacy format (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).

use crate::error::ApiError;
use crate::generation::{ChoiceEvent, Generation};
use crate::protocol::{CompletionRequest, EndpointDefaults, Prompt, check_logprobs, parse_request};
use crate::state::AppState;
use crate::stream::{Endpoint, Envelope, respond};
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use ferrotron_infer::engine::TokenOutput;
use serde_json::{Map, Value, json};
use std::sync::Arc;

/// The handler.
pub async fn completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    match run(state, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// The prompts as token ids with the text `echo` shows for each.
fn prompts(state: &AppState, prompt: &Prompt) -> Result<Vec<(Vec<u32>, String)>, ApiError> {
    let tok = &state.model.tokenizer;
    let encode = |s: &str| {
        tok.encode(s, true)
            .map(|ids| (ids, s.to_string()))
            .map_err(|e| ApiError::bad_request(e.to_string(), Some("prompt")))
    };
    let decode = |ids: &Vec<u32>| {
        let text = tok.decode(ids, false).unwrap_or_default();
        Ok((ids.clone(), text))
    };
    let list = match prompt {
        Prompt::Text(s) => vec![encode(s)?],
        Prompt::Texts(v) => v.iter().map(|s| encode(s)).collect::<Result<_, _>>()?,
        Prompt::Ids(ids) => vec![decode(ids)?],
        Prompt::IdLists(v) => v.iter().map(decode).collect::<Result<_, ApiError>>()?,
    };
    if list.is_empty() || list.iter().any(|(ids, _)| ids.is_empty()) {
        return Err(ApiError::bad_request("the prompt is empty", Some("prompt")));
    }
    Ok(list)
}

async fn run(state: Arc<AppState>, body: &[u8]) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_request(body)?;
    let f = &req.sampling;
    let target = state.resolve_model(f.model.as_deref())?;
    let n = f.n(state.max_n)?;
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::bad_request(
            "suffix is not supported",
            Some("suffix"),
        ));
    }
    if req.best_of.is_some_and(|b| b != n) {
        return Err(ApiError::bad_request(
            "best_of other than n is not supported",
            Some("best_of"),
        ));
    }
    let logprobs = check_logprobs(req.logprobs, "logprobs")?;
    let echo = req.echo.unwrap_or(false);
    let prompts = prompts(&state, &req.prompt)?;
    let limits = state.engine.limits();
    let mut choices = Vec::with_capacity(prompts.len() * n);
    for (ids, _) in &prompts {
        for i in 0..n {
            let defaults = EndpointDefaults {
                max_tokens: Some(16),
                logprobs,
                prompt_logprobs: logprobs.filter(|_| echo),
            };
            let seed = state.seed(f.seed, i);
            let eos = &state.model.eos_token_ids;
            let params = f.choice_params(ids.len(), limits, eos, defaults, seed)?;
            choices.push((ids.clone(), params));
        }
    }
    let generation = Generation::start(state.clone(), choices, target.lora)?;
    let envelope = Envelope::new(&state, &target.name, "cmpl", n);
    // Per choice: the echoed prompt (text, and its first token for the logprobs).
    let echo = prompts
        .iter()
        .flat_map(|(ids, text)| {
            let e = echo.then(|| Echo {
                text: text.clone(),
                first_token: ids[0],
            });
            std::iter::repeat_n(e, n)
        })
        .collect();
    let endpoint = Completions {
        echo,
        logprobs: logprobs.is_some(),
        offsets: vec![0; prompts.len() * n],
    };
    respond(generation, endpoint, envelope, f).await
}

/// A choice's echoed prompt.
#[derive(Clone)]
struct Echo {
    text: String,
    /// The prompt's first token (it has no log-probability).
    first_token: u32,
}

/// The logprob entries of `echo`'s prompt: its first token (no log-probability, as OpenAI
/// and vLLM report it), then `rest` (the others, with theirs); none without an echo.
fn prompt_entries(echo: Option<&Echo>, rest: &[TokenOutput]) -> Vec<TokenOutput> {
    let Some(echo) = echo else {
        return Vec::new();
    };
    let head = TokenOutput {
        token: echo.first_token,
        logprob: None,
        top_logprobs: Vec::new(),
    };
    std::iter::once(head).chain(rest.iter().cloned()).collect()
}

/// OpenAI's legacy completion logprobs of `tokens`, text offsets counted from `*offset`
/// (advanced past them).
fn legacy_logprobs(g: &Generation, tokens: &[TokenOutput], offset: &mut usize) -> Value {
    let (mut texts, mut offsets, mut logprobs, mut tops) = (vec![], vec![], vec![], vec![]);
    for t in tokens {
        let text = g.token_text(t.token);
        offsets.push(*offset);
        *offset += text.len();
        texts.push(text);
        logprobs.push(t.logprob);
        // The prompt's first token has neither a log-probability nor alternatives (null).
        tops.push(t.logprob.map(|_| {
            let top = t.top_logprobs.iter();
            top.map(|&(id, lp)| (g.token_text(id), json!(lp)))
                .collect::<Map<String, Value>>()
        }));
    }
    json!({"tokens": texts, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets})
}

/// Completion choices: the echo (when asked for) then the text; streamed, the echo goes
/// with the first chunk.
struct Completions {
    /// Per choice; taken by its first chunk when streaming.
    echo: Vec<Option<Echo>>,
    logprobs: bool,
    /// Per choice: the text bytes streamed so far (`text_offset`).
    offsets: Vec<usize>,
}

impl Endpoint for Completions {
    const OBJECT: &'static str = "text_completion";
    const CHUNK_OBJECT: &'static str = "text_completion";

    fn whole_choice(&self, g: &Generation, i: usize, tokens: &[TokenOutput]) -> Value {
        let (c, echo) = (&g.choices[i], self.echo[i].as_ref());
        let logprobs = self.logprobs.then(|| {
            let mut all = prompt_entries(echo, &c.prompt_logprobs);
            all.extend(tokens.iter().cloned());
            legacy_logprobs(g, &all, &mut 0)
        });
        let echoed = echo.map_or("", |e| e.text.as_str());
        json!({"text": format!("{echoed}{}", c.text()), "logprobs": logprobs})
    }

    fn chunk_choice(&mut self, ev: &ChoiceEvent, g: &Generation) -> Option<Value> {
        let i = ev.index;
        let lp = ev.token.as_ref().filter(|t| t.logprob.is_some());
        if ev.text.is_empty() && ev.finish.is_none() && lp.is_none() {
            return None;
        }
        let echo = self.echo[i].take();
        let mut offset = self.offsets[i];
        let logprobs = lp.map(|t| {
            let mut all = prompt_entries(echo.as_ref(), &g.choices[i].prompt_logprobs);
            all.push(t.clone());
            legacy_logprobs(g, &all, &mut offset)
        });
        let echoed = echo.map_or(String::new(), |e| e.text);
        self.offsets[i] += echoed.len() + ev.text.len();
        Some(json!({"text": format!("{echoed}{}", ev.text), "logprobs": logprobs}))
    }
}
