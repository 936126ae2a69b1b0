//! The validated, typed view of a run configuration.

use super::sections::RawConfig;
use std::path::PathBuf;

/// Explicit architecture (all defaults resolved).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelDims {
    /// The skeleton's family (`model.family`).
    pub family: ferrotron_model::ModelFamily,
    /// Transformer layers.
    pub num_layers: usize,
    /// Model width.
    pub hidden_size: usize,
    /// MLP inner width.
    pub ffn_hidden_size: usize,
    /// Attention heads.
    pub num_attention_heads: usize,
    /// KV heads.
    pub num_query_groups: usize,
    /// Per-head dimension.
    pub kv_channels: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Longest supported position.
    pub max_position_embeddings: usize,
}

/// Where the model comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelSource {
    /// An HF directory or checkpoint (`model.load`).
    Load(PathBuf),
    /// Built from the explicit `[model]` keys.
    Explicit(ModelDims),
}

/// `data.dataset_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DatasetType {
    /// Pretraining on Megatron indexed `.bin/.idx` data.
    Gpt,
    /// SFT from chat JSONL files.
    SftRaw,
    /// SFT from pre-tokenised indexed data.
    SftMmap,
    /// DPO on preference pairs from a JSONL file.
    Dpo,
    /// A reward model on the same preference pairs.
    Reward,
}

/// `optimizer.lr_decay_style`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LrDecayStyle {
    /// No decay.
    Constant,
    /// Linear to `min_lr`.
    Linear,
    /// Cosine to `min_lr`.
    Cosine,
    /// `lr * sqrt(warmup) / sqrt(step)`.
    InverseSquareRoot,
    /// Warmup-stable-decay.
    Wsd,
}

/// Compute/storage precision from `[precision]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// f32 everywhere (default).
    Fp32,
    /// bf16 weights and matmuls (f32 accumulation), f32 master weights and gradients.
    Bf16,
    /// fp16 with loss scaling.
    Fp16,
}

/// `training.recompute_method`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecomputeMethod {
    /// Recompute groups of `num_layers` layers across the whole stack.
    Uniform,
    /// Recompute the first `num_layers` layers only.
    Block,
}

/// Activation recomputation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recompute {
    /// Keep all activations.
    None,
    /// Recompute attention internals only.
    Selective,
    /// Recompute whole layers.
    Full {
        /// Grouping of recomputed layers.
        method: RecomputeMethod,
        /// Layers per group (uniform) or recomputed layers (block).
        num_layers: usize,
    },
}

/// A validated run configuration. `resolved` holds the sections with defaults and derived
/// values filled in (what [`RunConfig::to_toml`] prints); the other fields are typed views.
#[derive(Debug, Clone, PartialEq)]
pub struct RunConfig {
    /// The sections with derived defaults filled in.
    pub resolved: RawConfig,
    /// Where the model comes from.
    pub model: ModelSource,
    /// Training sequence length in tokens.
    pub seq_length: usize,
    /// `(weight, path)` of each blend component, weights as written.
    pub blend: Vec<(f64, PathBuf)>,
    /// Train/valid/test split weights.
    pub split: [f64; 3],
    /// Kind of dataset.
    pub dataset_type: DatasetType,
    /// Data-parallel replicas: `parallel.data_parallel_size` (1 when unset; under `mpirun`
    /// the world decides it, see [`RunConfig::data_parallel_size_for_world`]).
    pub data_parallel_size: usize,
    /// Samples per optimizer step.
    pub global_batch_size: usize,
    /// Micro-batches accumulated per step: global / (micro x data_parallel).
    pub grad_accum_steps: usize,
    /// Optimizer steps to run.
    pub train_iters: u64,
    /// Warmup in iterations (from whichever unit was given).
    pub lr_warmup_iters: u64,
    /// Decay length in iterations.
    pub lr_decay_iters: u64,
    /// Peak learning rate.
    pub lr: f64,
    /// Decay schedule.
    pub lr_decay_style: LrDecayStyle,
    /// Precision mode.
    pub precision: Precision,
    /// Activation recomputation.
    pub recompute: Recompute,
    /// `[lora]` when enabled: the adapters to add to the loaded model (unless
    /// `lora.adapter` gives them).
    pub lora: Option<ferrotron_model::LoraConfig>,
    /// `[dpo]` when `data.dataset_type = "dpo"`.
    pub dpo: Option<crate::trainer::DpoOptions>,
    /// `[reward]` when `data.dataset_type = "reward"`.
    pub reward: Option<crate::trainer::RewardOptions>,
    /// `[moe]`: the MoE layers of a model built from `[model]`, or options for a loaded one.
    pub moe: super::MoeSettings,
    /// `[mla]`: multi-latent attention of a model built from `[model]`.
    pub mla: Option<super::MlaSettings>,
    /// `parallel.cp_comm_type`.
    pub cp_comm_type: ferrotron_nn::CpCommType,
    /// `parallel.data_parallel_sharding_strategy` (or what `use_distributed_optimizer`
    /// says).
    pub sharding: crate::trainer::ShardingStrategy,
    /// `[optimizer]`'s offload keys.
    pub offload: ferrotron_optim::offload::OffloadConfig,
}

impl RunConfig {
    /// Rows of a training sample: 2 for DPO and reward models (a pair's chosen and rejected
    /// rows), else 1. The loader, the trainer and `consumed samples` count rows.
    pub fn rows_per_sample(&self) -> usize {
        if self.dpo.is_some() || self.reward.is_some() {
            2
        } else {
            1
        }
    }
}
