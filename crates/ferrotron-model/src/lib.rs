//! The GPT (decoder-only) model of LLaMA-like architectures and the families expressed as
//! switches on the same skeleton (OLMo, OLMo2, Gemma, Phi-3, StarCoder2, Falcon, Bloom): [`TransformerConfig`] with
//! Megatron's names, the module tree whose kinds declare their parameters once
//! ([`module`]), [`GptModel`] (a parameter table in that layout, with the KV-cached forward
//! and the training passes), the per-layer [`KvCache`], the paged cache and ragged batches a
//! serving engine runs ([`PagedKvCache`], [`RaggedBatch`]), tensor-parallel shards and pipeline
//! stages, and `families/` mapping HuggingFace configs and weight names onto them.

mod config;
mod context_parallel;
mod error;
mod expert_bias;
mod expert_parallel;
pub mod families;
mod global_aux;
mod gpt_model;
mod inference;
mod init;
mod kv_cache;
pub mod lora;
pub mod module;
mod moe_options;
mod paged_kv;
mod param_table;
mod pipeline_stage;
pub mod tensor_parallel;
pub mod train;
mod upcycle;
mod vocab;

pub use config::{
    ActivationFunc, DropPolicy, ExpertCapacity, ExpertGroups, GroupScore, LoadBalancing, MlaConfig,
    ModelFamily, MoeConfig, Normalization, OutputHead, PositionEmbedding, RecomputeGranularity,
    RecomputeMethod, RouterConfig, ScoreFunction, TokenDispatcher, TransformerConfig,
};
pub use error::ModelError;
pub use expert_bias::updated_expert_bias;
pub use expert_parallel::ExpertParallel;
pub use gpt_model::GptModel;
pub use inference::{LogitsMode, NewTokens};
pub use init::InitConfig;
pub use kv_cache::KvCache;
pub use lora::LoraConfig;
pub use module::{ModelLayout, ParamDecl, ParamId, TransformerLayer};
pub use paged_kv::{PagedKvCache, RaggedBatch, RaggedSeq};
pub use param_table::{ParamHome, ParamTable, ParamValue};
pub use pipeline_stage::{StageInfo, stage_layers, virtual_stage_layers};
pub use tensor_parallel::{ParamBox, TpInfo, TpSplit, padded_vocab_size};
pub use train::{
    ActivationMemory, DpoStats, DpoTargets, ForwardTrace, GradReady, LossStats, MoeLosses,
    NoGradHook, Objective, ParamInfo, RewardTargets, StageBackward, StageForward, StageLogps,
    TrainBatch,
};
pub use upcycle::UpcycleOptions;
pub use vocab::NewToken;

/// Result alias for model construction and forward passes.
pub type Result<T> = std::result::Result<T, ModelError>;
