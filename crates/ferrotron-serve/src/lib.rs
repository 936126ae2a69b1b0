//! The OpenAI-compatible HTTP server over the serving engine
//! ([`ferrotron_infer::engine`]), vLLM's `vllm serve` API on axum: `/v1/models`,
//! `/v1/completions`, `/v1/chat/completions` (whole or streamed as server-sent events),
//! `/tokenize`, `/detokenize`, `/health`, `/metrics` (Prometheus text), and LoRA adapters
//! selected per request by `model` ([`lora`], with `/v1/load_lora_adapter` and
//! `/v1/unload_lora_adapter`).
//!
//! Each HTTP request becomes one engine request per choice ([`generation`]); its outputs
//! come back over a channel, are detokenized incrementally and checked against the stop
//! strings; a client that disconnects cancels its requests, freeing their KV blocks. On
//! SIGTERM or Ctrl-C the server stops accepting connections, lets the requests in flight
//! finish, drains the engine and returns.

mod chat;
mod completions;
pub mod error;
pub mod generation;
pub mod lora;
pub mod metrics;
pub mod protocol;
pub mod state;
mod stream;
mod tokenize;

pub use error::ApiError;
pub use lora::LoraRegistry;
pub use state::{AppState, ServedModel};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

/// The routes over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/load_lora_adapter", post(lora::load_adapter))
        .route("/v1/unload_lora_adapter", post(lora::unload_adapter))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/health", get(health))
        .route("/metrics", get(metrics_page))
        .fallback(not_found)
        .with_state(state)
}

/// Serves `state` on `listener` until `shutdown` resolves, then lets the requests in flight
/// finish and drains the engine. Logs the engine's throughput every `log_every` while busy
/// (vLLM's periodic stats line).
///
/// # Errors
/// The listener failed.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    log_every: Option<Duration>,
) -> std::io::Result<()> {
    let logger = log_every.map(|every| tokio::spawn(log_stats(state.clone(), every)));
    let draining = state.clone();
    let signal = async move {
        shutdown.await;
        draining.start_draining();
        eprintln!("ferrotron serve: shutting down, finishing the requests in flight");
    };
    axum::serve(listener, router(state.clone()))
        .with_graceful_shutdown(signal)
        .await?;
    if let Some(l) = logger {
        l.abort();
    }
    tokio::task::spawn_blocking(move || state.engine.shutdown())
        .await
        .map_err(std::io::Error::other)?;
    Ok(())
}

/// Resolves on SIGTERM or Ctrl-C (SIGINT).
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

/// Prints prompt and generation throughput, queue sizes, KV usage and the prefix-cache hit
/// rate every `every` in which the engine did work.
async fn log_stats(state: Arc<AppState>, every: Duration) {
    let s = state.engine.stats();
    let read = || {
        [
            s.prompt_tokens_total.load(Relaxed),
            s.generation_tokens_total.load(Relaxed),
            s.prefix_cache_queries_total.load(Relaxed),
            s.prefix_cache_hits_total.load(Relaxed),
        ]
    };
    let mut last = read();
    let mut tick = tokio::time::interval(every);
    tick.tick().await;
    loop {
        tick.tick().await;
        let now = read();
        let running = s.num_requests_running.load(Relaxed);
        if now == last && running == 0 {
            continue;
        }
        let secs = every.as_secs_f64();
        let queries = (now[2] - last[2]).max(1) as f64;
        eprintln!(
            "ferrotron serve: avg prompt throughput: {:.1} tokens/s, avg generation throughput: \
             {:.1} tokens/s, running: {running} reqs, waiting: {} reqs, KV cache usage: {:.1}%, \
             prefix cache hit rate: {:.1}%",
            (now[0] - last[0]) as f64 / secs,
            (now[1] - last[1]) as f64 / secs,
            s.num_requests_waiting.load(Relaxed),
            100.0 * s.kv_cache_usage(),
            100.0 * (now[3] - last[3]) as f64 / queries,
        );
        last = now;
    }
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    let limits = state.engine.limits();
    let card = |id: &str, root: &str, parent: Option<&str>| {
        json!({
            "id": id,
            "object": "model",
            "created": state.created,
            "owned_by": "ferrotron",
            "root": root,
            "parent": parent,
            "max_model_len": limits.max_model_len,
        })
    };
    let base = &state.model.name;
    let adapters = state.adapters.list();
    let data: Vec<_> = std::iter::once(card(base, base, None))
        .chain(
            adapters
                .iter()
                .map(|a| card(&a.name, &a.path.to_string_lossy(), Some(base))),
        )
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    match state.is_draining() {
        true => ApiError::unavailable("shutting down").into_response(),
        false => StatusCode::OK.into_response(),
    }
}

async fn metrics_page(State(state): State<Arc<AppState>>) -> Response {
    let headers = [("content-type", "text/plain; version=0.0.4")];
    (headers, metrics::render(&state)).into_response()
}

async fn not_found(uri: axum::http::Uri) -> Response {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!("no route {uri}"),
        param: None,
    }
    .into_response()
}
