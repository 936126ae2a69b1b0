//! LoRA adapters served by name over the one base model (vLLM's LoRA serving: `--lora-modules`,
//! `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`): PEFT adapter directories loaded at
//! start or, when the server allows it, while it runs; a request whose `model` names an
//! adapter runs with it ([`ferrotron_infer::engine::LoraRequest`]), beside requests of other
//! adapters and of the base in the same batches.
//!
//! Each load gets a fresh id, so an adapter unloaded and loaded again under its name never
//! meets the prefix-cache blocks of its earlier weights; requests in flight keep the weights
//! they started with.

use crate::error::ApiError;
use crate::state::AppState;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use ferrotron_checkpoint::peft::PeftAdapter;
use ferrotron_infer::engine::LoraRequest;
use ferrotron_model::GptModel;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, RwLock};

/// One adapter being served.
struct ServedAdapter {
    request: LoraRequest,
    /// The directory it was read from (`root` in `/v1/models`).
    path: PathBuf,
    /// Requests that selected it.
    requests: AtomicU64,
}

/// What `/v1/models` and `/metrics` show of an adapter.
#[derive(Clone, Debug, PartialEq)]
pub struct AdapterInfo {
    pub name: String,
    pub path: PathBuf,
    pub rank: usize,
    pub requests: u64,
}

/// The adapters the server serves, by name.
pub struct LoraRegistry {
    /// The base model the adapters are read for.
    base: Arc<GptModel>,
    /// The base model's served name (no adapter may take it).
    base_name: String,
    adapters: RwLock<BTreeMap<String, ServedAdapter>>,
    /// The id of the next load (ids start at 1: 0 is the base model's cache namespace).
    next_id: AtomicU64,
    /// Whether `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` may change the set
    /// (vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`).
    runtime_updates: bool,
}

impl LoraRegistry {
    /// No adapters yet, over `base` served as `base_name`.
    pub fn new(base: Arc<GptModel>, base_name: &str, runtime_updates: bool) -> LoraRegistry {
        LoraRegistry {
            base,
            base_name: base_name.to_string(),
            adapters: RwLock::default(),
            next_id: AtomicU64::new(1),
            runtime_updates,
        }
    }

    /// Reads the PEFT adapter directory `path` for the base model and serves it as `name`.
    ///
    /// # Errors
    /// An empty name, the base model's or one already served (400), or an adapter that cannot be read or does
    /// not fit the base (400, naming the file, key or tensor).
    pub fn load(&self, name: &str, path: &Path) -> Result<(), ApiError> {
        if name.is_empty() {
            return Err(ApiError::bad_request(
                "lora_name is empty",
                Some("lora_name"),
            ));
        }
        if name == self.base_name || self.read().contains_key(name) {
            let m = format!("The lora adapter '{name}' has already been loaded.");
            return Err(ApiError::bad_request(m, Some("lora_name")));
        }
        let weights = PeftAdapter::read(path)
            .and_then(|a| a.served_weights(&self.base))
            .map_err(|e| {
                let m = format!("LoRA adapter {}: {e}", path.display());
                ApiError::bad_request(m, Some("lora_path"))
            })?;
        let request = LoraRequest {
            name: name.to_string(),
            id: self.next_id.fetch_add(1, Relaxed),
            weights: Arc::new(weights),
        };
        let mut adapters = self.adapters.write().unwrap_or_else(|e| e.into_inner());
        if adapters.contains_key(name) {
            let m = format!("The lora adapter '{name}' has already been loaded.");
            return Err(ApiError::bad_request(m, Some("lora_name")));
        }
        let served = ServedAdapter {
            request,
            path: path.to_path_buf(),
            requests: AtomicU64::new(0),
        };
        adapters.insert(name.to_string(), served);
        Ok(())
    }

    /// Stops serving `name` (requests in flight finish with it).
    ///
    /// # Errors
    /// A name not served (404).
    pub fn unload(&self, name: &str) -> Result<(), ApiError> {
        let mut adapters = self.adapters.write().unwrap_or_else(|e| e.into_inner());
        match adapters.remove(name) {
            Some(_) => Ok(()),
            None => Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!("The lora adapter '{name}' cannot be found."),
                param: Some("lora_name".into()),
            }),
        }
    }

    /// The adapter served as `name`; `None` when there is none.
    pub fn get(&self, name: &str) -> Option<LoraRequest> {
        Some(self.read().get(name)?.request.clone())
    }

    /// Counts a request that runs with the adapter served as `name` (if it still is).
    pub fn count_request(&self, name: &str) {
        if let Some(a) = self.read().get(name) {
            a.requests.fetch_add(1, Relaxed);
        }
    }

    /// The adapters served, by name.
    pub fn list(&self) -> Vec<AdapterInfo> {
        self.read()
            .iter()
            .map(|(name, a)| AdapterInfo {
                name: name.clone(),
                path: a.path.clone(),
                rank: a.request.weights.rank(),
                requests: a.requests.load(Relaxed),
            })
            .collect()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, ServedAdapter>> {
        self.adapters.read().unwrap_or_else(|e| e.into_inner())
    }

    /// A 403 unless the server allows loading and unloading at run time.
    fn check_runtime_updates(&self) -> Result<(), ApiError> {
        match self.runtime_updates {
            true => Ok(()),
            false => Err(ApiError {
                status: StatusCode::FORBIDDEN,
                message: "loading and unloading LoRA adapters at run time is off: start the \
                          server with --allow-runtime-lora-updating"
                    .into(),
                param: None,
            }),
        }
    }
}

/// `POST /v1/load_lora_adapter` body (vLLM's `LoadLoRAAdapterRequest`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LoadRequest {
    lora_name: String,
    lora_path: PathBuf,
}

/// `POST /v1/unload_lora_adapter` body (vLLM's `UnloadLoRAAdapterRequest`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UnloadRequest {
    lora_name: String,
}

/// `POST /v1/load_lora_adapter`: `{"lora_name", "lora_path"}`; answers vLLM's plain-text
/// success line.
pub async fn load_adapter(State(state): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    let run = async {
        state.adapters.check_runtime_updates()?;
        let req: LoadRequest = crate::error::parse_body(&body)?;
        let name = req.lora_name.clone();
        let loading = state.clone();
        tokio::task::spawn_blocking(move || loading.adapters.load(&req.lora_name, &req.lora_path))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))??;
        eprintln!("ferrotron serve: loaded LoRA adapter {name}");
        Ok::<_, ApiError>(format!(
            "Success: LoRA adapter '{name}' added successfully."
        ))
    };
    match run.await {
        Ok(text) => text.into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/unload_lora_adapter`: `{"lora_name"}`.
pub async fn unload_adapter(
    State(state): State<Arc<AppState>>,
    body: axum::body::Bytes,
) -> Response {
    let run = || {
        state.adapters.check_runtime_updates()?;
        let req: UnloadRequest = crate::error::parse_body(&body)?;
        state.adapters.unload(&req.lora_name)?;
        eprintln!("ferrotron serve: unloaded LoRA adapter {}", req.lora_name);
        Ok::<_, ApiError>(format!(
            "Success: LoRA adapter '{}' removed successfully.",
            req.lora_name
        ))
    };
    match run() {
        Ok(text) => text.into_response(),
        Err(e) => e.into_response(),
    }
}
