//! Driving a [`Generation`] to its end: collected into one response, or streamed as
//! server-sent events (`data: {chunk}` per output, an optional usage chunk with empty
//! `choices`, then `data: [DONE]`, as OpenAI streams).

use crate::error::ApiError;
use crate::generation::{ChoiceEvent, Finish, Generation};
use crate::protocol::SamplingFields;
use crate::state::{AppState, unix_now};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use ferrotron_infer::engine::TokenOutput;
use serde_json::{Value, json};
use std::convert::Infallible;

/// What every chunk and response of one request carries.
#[derive(Clone, Debug)]
pub struct Envelope {
    /// `cmpl-…` / `chatcmpl-…`.
    pub id: String,
    pub created: u64,
    pub model: String,
    /// Choices of one prompt (`n`): usage counts each prompt once.
    pub choices_per_prompt: usize,
}

impl Envelope {
    /// The envelope of a request to `model` (the base's or an adapter's name) with `n`
    /// choices per prompt, its id `{prefix}-` and 16 hex digits.
    pub fn new(state: &AppState, model: &str, prefix: &str, n: usize) -> Envelope {
        Envelope {
            id: format!("{prefix}-{:016x}", state.seed(None, 0)),
            created: unix_now(),
            model: model.to_string(),
            choices_per_prompt: n,
        }
    }

    /// `{"id", "object", "created", "model", "choices"}`.
    pub fn wrap(&self, object: &str, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }
}

/// How an endpoint shapes its choices, whole and streamed. Both leave out `index`,
/// `finish_reason` and `stop_reason`, which [`respond`] adds.
pub trait Endpoint: Send + 'static {
    /// The whole response's `object`.
    const OBJECT: &'static str;
    /// The chunks' `object`.
    const CHUNK_OBJECT: &'static str;
    /// Choice `index` of the whole response, `tokens` its generated tokens.
    fn whole_choice(&self, generation: &Generation, index: usize, tokens: &[TokenOutput]) -> Value;
    /// The chunk's choice for `event`, or `None` when it adds nothing to send.
    fn chunk_choice(&mut self, event: &ChoiceEvent, generation: &Generation) -> Option<Value>;
}

/// `choice` with its `index` and why it ended (`null`s while it runs).
fn with_finish(mut choice: Value, index: usize, finish: Option<&Finish>) -> Value {
    choice["index"] = json!(index);
    choice["finish_reason"] = json!(finish.map(|f| f.reason));
    choice["stop_reason"] = finish.map_or(Value::Null, |f| f.stop_reason.clone());
    choice
}

/// Runs `generation` to its end and answers with every choice and the usage, or, when the
/// request asks to `stream`, answers with its server-sent events.
///
/// # Errors
/// A failure while collecting a whole response (a streamed one reports it as an event).
pub async fn respond<E: Endpoint>(
    mut generation: Generation,
    endpoint: E,
    envelope: Envelope,
    fields: &SamplingFields,
) -> Result<Response, ApiError> {
    if fields.stream.unwrap_or(false) {
        let include_usage = fields
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage);
        return Ok(sse(generation, endpoint, envelope, include_usage));
    }
    let mut tokens = vec![Vec::new(); generation.choices.len()];
    while let Some(ev) = generation.next().await? {
        tokens[ev.index].extend(ev.token);
    }
    let choices = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let finish = generation.choices[i].finish.as_ref();
            with_finish(endpoint.whole_choice(&generation, i, t), i, finish)
        })
        .collect();
    let mut body = envelope.wrap(E::OBJECT, choices);
    body["usage"] = generation.usage(envelope.choices_per_prompt);
    Ok(axum::Json(body).into_response())
}

enum Phase {
    Running,
    Done,
    End,
}

/// Streams `generation` as server-sent events shaped by `endpoint`.
fn sse<E: Endpoint>(
    generation: Generation,
    endpoint: E,
    envelope: Envelope,
    include_usage: bool,
) -> Response {
    let start = (generation, endpoint, Phase::Running);
    let events = futures_util::stream::unfold(start, move |(mut g, mut f, phase)| {
        let envelope = envelope.clone();
        async move {
            let data = match phase {
                Phase::Running => loop {
                    match g.next().await {
                        Ok(Some(ev)) => {
                            let Some(choice) = f.chunk_choice(&ev, &g) else {
                                continue;
                            };
                            let choice = with_finish(choice, ev.index, ev.finish.as_ref());
                            let mut chunk = envelope.wrap(E::CHUNK_OBJECT, vec![choice]);
                            if include_usage {
                                chunk["usage"] = Value::Null;
                            }
                            break Some((chunk.to_string(), Phase::Running));
                        }
                        Ok(None) if include_usage => {
                            let mut chunk = envelope.wrap(E::CHUNK_OBJECT, vec![]);
                            chunk["usage"] = g.usage(envelope.choices_per_prompt);
                            break Some((chunk.to_string(), Phase::Done));
                        }
                        Ok(None) => break Some(("[DONE]".to_string(), Phase::End)),
                        Err(e) => break Some((e.body().to_string(), Phase::Done)),
                    }
                },
                Phase::Done => Some(("[DONE]".to_string(), Phase::End)),
                Phase::End => None,
            };
            data.map(|(d, next)| (Ok::<_, Infallible>(Event::default().data(d)), (g, f, next)))
        }
    });
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}
