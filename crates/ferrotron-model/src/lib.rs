//! The GPT (decoder-only) model of LLaMA-family architectures: [`TransformerConfig`] with
//! Megatron's names, [`GptModel`] built from explicit layers, the per-layer [`KvCache`], and
//! `families/` that map HuggingFace configs and weight names onto them.

mod config;
mod error;
pub mod families;
mod gpt_model;
mod init;
mod kv_cache;
mod pipeline_stage;
pub mod tensor_parallel;
pub mod train;
mod transformer_layer;

pub use config::{ModelFamily, RecomputeGranularity, RecomputeMethod, TransformerConfig};
pub use error::ModelError;
pub use gpt_model::{GptModel, LogitsMode};
pub use init::InitConfig;
pub use kv_cache::KvCache;
pub use pipeline_stage::{StageInfo, stage_layers, virtual_stage_layers};
pub use tensor_parallel::{ParamBox, TpInfo, TpSplit, padded_vocab_size};
pub use train::{
    ActivationMemory, ForwardTrace, GradReady, LossStats, NoGradHook, ParamInfo, StageForward,
    TrainBatch,
};
pub use transformer_layer::TransformerLayer;

/// Result alias for model construction and forward passes.
pub type Result<T> = std::result::Result<T, ModelError>;
