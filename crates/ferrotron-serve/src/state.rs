//! What every handler shares: the served model's tokenizer and metadata, the engine thread,
//! the server's metrics, and the shutdown flag.

use crate::error::ApiError;
use crate::lora::LoraRegistry;
use crate::metrics::ServerMetrics;
use ferrotron_data::Tokenizer;
use ferrotron_data::chat::ChatTemplate;
use ferrotron_infer::engine::{EngineHandle, LoraRequest};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The model as the API presents it.
pub struct ServedModel {
    /// The name clients pass as `model` (`--served-model-name`, else the model path).
    pub name: String,
    pub tokenizer: Arc<Tokenizer>,
    /// `tokenizer_config.json`'s chat template (none: `/v1/chat/completions` is a 400).
    pub chat_template: Option<ChatTemplate>,
    /// Ids that end generation unless `ignore_eos` (config, generation_config, tokenizer EOS).
    pub eos_token_ids: Vec<u32>,
}

/// What a request's `model` selects: the base model, or one of its LoRA adapters.
#[derive(Clone, Debug)]
pub struct Target {
    /// The name responses carry (`model`).
    pub name: String,
    pub lora: Option<LoraRequest>,
}

/// Shared by every handler.
pub struct AppState {
    pub model: ServedModel,
    pub engine: EngineHandle,
    /// The LoRA adapters served over the model.
    pub adapters: LoraRegistry,
    pub metrics: ServerMetrics,
    /// Most choices (`n`) per prompt: the engine's `max_num_seqs`.
    pub max_n: usize,
    /// Unix time the server started (`created` of `/v1/models`).
    pub created: u64,
    draining: AtomicBool,
    /// Seeds for requests without one.
    seeds: AtomicU64,
}

impl AppState {
    /// State for `model` served by `engine`, with the LoRA adapters of `adapters`.
    pub fn new(
        model: ServedModel,
        engine: EngineHandle,
        adapters: LoraRegistry,
        max_n: usize,
    ) -> AppState {
        let now = since_epoch();
        AppState {
            model,
            engine,
            adapters,
            metrics: ServerMetrics::default(),
            max_n,
            created: now.as_secs(),
            draining: AtomicBool::new(false),
            seeds: AtomicU64::new(now.as_nanos() as u64),
        }
    }

    /// What the request's `model` names: the base model when absent or its served name, or
    /// a LoRA adapter served by that name.
    ///
    /// # Errors
    /// A 404 for any other name.
    pub fn resolve_model(&self, model: Option<&str>) -> Result<Target, ApiError> {
        let base = Target {
            name: self.model.name.clone(),
            lora: None,
        };
        match model {
            None => Ok(base),
            Some(m) if m == self.model.name => Ok(base),
            Some(m) => match self.adapters.get(m) {
                Some(lora) => Ok(Target {
                    name: m.to_string(),
                    lora: Some(lora),
                }),
                None => Err(ApiError::model_not_found(m)),
            },
        }
    }

    /// The seed of choice `i`: `seed + i` when the request gives one (reproducible), else a
    /// fresh one.
    pub fn seed(&self, requested: Option<i64>, i: usize) -> u64 {
        match requested {
            Some(s) => (s as u64).wrapping_add(i as u64),
            None => self
                .seeds
                .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed),
        }
    }

    /// Marks the server as shutting down (new requests get a 503).
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// True once shutdown began.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }
}

fn since_epoch() -> std::time::Duration {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
}

/// Seconds since the Unix epoch (OpenAI's `created`).
pub fn unix_now() -> u64 {
    since_epoch().as_secs()
}
