//! `POST /v1/completions`: text completion of one or more prompts (strings or token ids),
//! `n` choices each, streamed or whole, with `echo` and per-token `logprobs` in OpenAI's
//! legacy format (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).

use crate::error::ApiError;
use crate::generation::{ChoiceEvent, Generation};
use crate::protocol::{CompletionRequest, EndpointDefaults, Prompt, check_logprobs, parse_request};
use crate::state::AppState;
use crate::stream::{ChunkFormat, Envelope, collect, sse};
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
    state.check_model(f.model.as_deref())?;
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
    let mut generation = Generation::start(state.clone(), choices)?;
    let envelope = Envelope {
        id: format!("cmpl-{:016x}", state.seed(None, 0)),
        created: unix_now(),
        model: state.model.name.clone(),
        choices_per_prompt: n,
    };
    // Per choice: the echoed text and, for its logprobs, the prompt's first token.
    let first_tokens: Vec<u32> = prompts
        .iter()
        .flat_map(|(ids, _)| std::iter::repeat_n(ids[0], n))
        .collect();
    let echo: Vec<String> = match echo {
        true => prompts
            .iter()
            .flat_map(|(_, t)| std::iter::repeat_n(t.clone(), n))
            .collect(),
        false => vec![String::new(); prompts.len() * n],
    };
    if f.stream.unwrap_or(false) {
        let include_usage = f.stream_options.as_ref().is_some_and(|o| o.include_usage);
        let first_tokens = echo
            .iter()
            .zip(&first_tokens)
            .map(|(e, &t)| echo_first(e, t))
            .collect();
        let format = CompletionChunks {
            echo,
            offsets: vec![0; prompts.len() * n],
            first_tokens,
        };
        return Ok(sse(generation, format, envelope, include_usage));
    }
    let tokens = collect(&mut generation).await?;
    let choices = generation
        .choices
        .iter()
        .zip(&tokens)
        .enumerate()
        .map(|(i, (c, toks))| {
            let finish = c.finish.clone().expect("collected to the end");
            let lp = logprobs.map(|_| {
                let mut all =
                    prompt_entries(echo_first(&echo[i], first_tokens[i]), &c.prompt_logprobs);
                all.extend(toks.iter().cloned());
                legacy_logprobs(&generation, &all, &mut 0)
            });
            json!({
                "index": i,
                "text": format!("{}{}", echo[i], c.text()),
                "logprobs": lp,
                "finish_reason": finish.reason,
                "stop_reason": finish.stop_reason,
            })
        })
        .collect();
    let mut body = envelope.wrap("text_completion", choices);
    body["usage"] = generation.usage(n);
    Ok(axum::Json(body).into_response())
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The prompt's first token when it is echoed (it has no log-probability).
fn echo_first(echo: &str, first: u32) -> Option<u32> {
    (!echo.is_empty()).then_some(first)
}

/// The echoed prompt's logprob entries: its first token (no log-probability, as OpenAI and
/// vLLM report it), then the rest with theirs.
fn prompt_entries(first: Option<u32>, rest: &[TokenOutput]) -> Vec<TokenOutput> {
    let Some(first) = first else {
        return Vec::new();
    };
    let head = TokenOutput {
        token: first,
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

/// Streamed completion choices: the echo first, then text as it is released.
struct CompletionChunks {
    echo: Vec<String>,
    offsets: Vec<usize>,
    /// The prompt's first token per choice while its echo is unsent (echo with logprobs).
    first_tokens: Vec<Option<u32>>,
}

impl ChunkFormat for CompletionChunks {
    const OBJECT: &'static str = "text_completion";

    fn choice(&mut self, ev: &ChoiceEvent, g: &Generation) -> Option<Value> {
        let i = ev.index;
        let lp = ev.token.as_ref().filter(|t| t.logprob.is_some());
        if ev.text.is_empty() && ev.finish.is_none() && lp.is_none() {
            return None;
        }
        let mut offset = self.offsets[i];
        let logprobs = lp.map(|t| {
            let first = self.first_tokens[i].take();
            let mut all = prompt_entries(first, &g.choices[i].prompt_logprobs);
            all.push(t.clone());
            legacy_logprobs(g, &all, &mut offset)
        });
        self.offsets[i] += self.echo[i].len();
        self.offsets[i] += ev.text.len();
        let text = format!("{}{}", std::mem::take(&mut self.echo[i]), ev.text);
        let finish = ev.finish.as_ref();
        Some(json!({
            "index": i,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish.map(|f| f.reason),
            "stop_reason": finish.map(|f| f.stop_reason.clone()),
        }))
    }
}
