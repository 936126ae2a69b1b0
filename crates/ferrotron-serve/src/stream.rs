//! Driving a [`Generation`] to its end: collected into one response, or streamed as
//! server-sent events (`data: {chunk}` per output, an optional usage chunk with empty
//! `choices`, then `data: [DONE]`, as OpenAI streams).

use crate::error::ApiError;
use crate::generation::{ChoiceEvent, Generation};
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

/// How an endpoint turns one choice's output into a streamed choice.
pub trait ChunkFormat: Send + 'static {
    /// The chunks' `object`.
    const OBJECT: &'static str;
    /// The chunk's choice for `event`, or `None` when it adds nothing to send.
    fn choice(&mut self, event: &ChoiceEvent, generation: &Generation) -> Option<Value>;
}

/// Every choice's generated tokens (with log-probabilities when asked for), after running
/// the generation to its end.
pub async fn collect(generation: &mut Generation) -> Result<Vec<Vec<TokenOutput>>, ApiError> {
    let mut tokens = vec![Vec::new(); generation.choices.len()];
    while let Some(ev) = generation.next().await? {
        if let Some(t) = ev.token {
            tokens[ev.index].push(t);
        }
    }
    Ok(tokens)
}

enum Phase {
    Running,
    Done,
    End,
}

/// Streams `generation` as server-sent events in `format`.
pub fn sse<F: ChunkFormat>(
    generation: Generation,
    format: F,
    envelope: Envelope,
    include_usage: bool,
) -> Response {
    let start = (generation, format, Phase::Running);
    let events = futures_util::stream::unfold(start, move |(mut g, mut f, phase)| {
        let envelope = envelope.clone();
        async move {
            let data = match phase {
                Phase::Running => loop {
                    match g.next().await {
                        Ok(Some(ev)) => {
                            let Some(choice) = f.choice(&ev, &g) else {
                                continue;
                            };
                            let mut chunk = envelope.wrap(F::OBJECT, vec![choice]);
                            if include_usage {
                                chunk["usage"] = Value::Null;
                            }
                            break Some((chunk.to_string(), Phase::Running));
                        }
                        Ok(None) if include_usage => {
                            let mut chunk = envelope.wrap(F::OBJECT, vec![]);
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
