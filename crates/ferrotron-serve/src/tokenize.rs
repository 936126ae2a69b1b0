//! `POST /tokenize` and `POST /detokenize` (vLLM's): a prompt or chat messages to token ids
//! with the context length, and token ids back to text.

use crate::chat::chat_prompt;
use crate::error::{ApiError, parse_body};
use crate::protocol::{ChatCompletionRequest, parse_request};
use crate::state::AppState;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use std::sync::Arc;

#[derive(Deserialize)]
struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    add_special_tokens: Option<bool>,
}

#[derive(Deserialize)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<u32>,
}

/// `{"prompt": str, "add_special_tokens"?}` or `{"messages": [...]}` ->
/// `{"count", "max_model_len", "tokens"}`.
pub async fn tokenize(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let run = || -> Result<Response, ApiError> {
        let v: serde_json::Value = parse_body(&body)?;
        let ids = if v.get("messages").is_some() {
            let req: ChatCompletionRequest = parse_request(&body)?;
            state.resolve_model(req.sampling.model.as_deref())?;
            chat_prompt(&state, &req)?
        } else {
            let req: TokenizeRequest = parse_body(&body)?;
            state.resolve_model(req.model.as_deref())?;
            let prompt = req.prompt.ok_or_else(|| {
                ApiError::bad_request("give a prompt or messages", Some("prompt"))
            })?;
            let special = req.add_special_tokens.unwrap_or(true);
            state
                .model
                .tokenizer
                .encode(&prompt, special)
                .map_err(|e| ApiError::bad_request(e.to_string(), Some("prompt")))?
        };
        let max_model_len = state.engine.limits().max_model_len;
        let body = json!({"count": ids.len(), "max_model_len": max_model_len, "tokens": ids});
        Ok(axum::Json(body).into_response())
    };
    run().unwrap_or_else(IntoResponse::into_response)
}

/// `{"tokens": [ids]}` -> `{"prompt": text}`.
pub async fn detokenize(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let run = || -> Result<Response, ApiError> {
        let req: DetokenizeRequest = parse_body(&body)?;
        state.resolve_model(req.model.as_deref())?;
        let vocab = state.engine.limits().vocab_size;
        if let Some(&t) = req.tokens.iter().find(|&&t| t as usize >= vocab) {
            let m = format!("token id {t} is outside the vocabulary ({vocab} ids)");
            return Err(ApiError::bad_request(m, Some("tokens")));
        }
        let text = state
            .model
            .tokenizer
            .decode(&req.tokens, false)
            .map_err(|e| ApiError::bad_request(e.to_string(), Some("tokens")))?;
        Ok(axum::Json(json!({ "prompt": text })).into_response())
    };
    run().unwrap_or_else(IntoResponse::into_response)
}
