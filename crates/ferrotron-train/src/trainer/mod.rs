//! The training loop of one rank: Megatron's `train_step` / `train` / `evaluate` /
//! `training_log` (`megatron/training/training.py`), with data parallelism
//! ([`DataParallel`]: DDP or the distributed optimizer) and pipeline parallelism
//! ([`PipelineParallel`]) composed around a model slice from
//! [`parallelize`](crate::parallelize).
//!
//! | here | mirrors (Megatron-LM) |
//! |---|---|
//! | [`TrainerOptions`] | the `--micro-batch-size`, `--global-batch-size`, `--train-iters`, `--lr*`, `--adam-*`, `--clip-grad`, `--log-interval`, `--eval-*` arguments |
//! | [`Trainer::train_step`] | `train_step` with `--calculate-per-token-loss` |
//! | [`Trainer::evaluate`] | `evaluate` (forward only) |
//! | [`Trainer::train`] | `train` (the iteration loop) |
//! | [`LogLine`], [`EvalLine`] | `training_log`, `evaluate_and_print_results` |
//! | [`num_floating_point_operations`] | `num_floating_point_operations` |
//!
//! Data flow of one step: the [`ParamAndGradBuffer`](ferrotron_optim::ParamAndGradBuffer)
//! holds the parameters (f32, or bf16/f16 with f32 master weights in the optimizer) and the
//! f32 gradients; every micro-batch's
//! [`GptModel::forward_backward`](ferrotron_model::GptModel::forward_backward) accumulates
//! into the buffer's gradient views, the [`Optimizer`](ferrotron_optim::Optimizer) updates
//! the buffer, and the updated weights are copied back into the model.
//! Packed rows (the loader's `segment_ids`) attend per document. Checkpoints: [`SavePlan`],
//! [`Trainer::save_checkpoint`], [`Trainer::load_checkpoint`].

mod activation_peak;
mod bucket_staging;
mod checkpoint;
mod data_parallel;
mod dpo;
mod evaluate;
mod flops;
mod full_state;
mod grad_shards;
mod log;
mod moe;
mod offload;
mod options;
mod overlap;
mod param_gather;
mod param_shards;
mod passes;
mod pipeline_exec;
mod run;
mod sharded;
mod sharding;
mod stats_reduce;
mod step;

pub use checkpoint::{LoadMode, SavePlan, TrainerState};
pub use data_parallel::DataParallel;
pub use dpo::{DpoMetrics, DpoOptions, DpoReference, RewardOptions};
pub use flops::{FlopsModel, num_floating_point_operations};
pub use full_state::NamedParams;
pub use log::{EvalLine, LogLine, SavedLine, TrainLog, format_sci};
pub use moe::MoeMetrics;
pub use offload::OffloadStats;
pub use options::TrainerOptions;
pub use pipeline_exec::PipelineParallel;
pub use run::{TrainObserver, TrainSummary};
pub use sharding::ShardingStrategy;
pub use step::{StepStats, Trainer};

use ferrotron_data::DatasetError;
use ferrotron_model::ModelError;
use ferrotron_optim::OptimError;

/// Errors of the training loop.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// Invalid [`TrainerOptions`] or batches that do not fit them.
    #[error("trainer: {0}")]
    Config(String),
    /// The model rejected a batch or the parameter views.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The optimizer or the scheduler failed.
    #[error(transparent)]
    Optim(#[from] OptimError),
    /// The data loader failed.
    #[error(transparent)]
    Data(#[from] DatasetError),
    /// Saving or loading a checkpoint failed (the message names the file and the problem).
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// A collective across ranks failed (often: another rank failed first).
    #[error("communication: {0}")]
    Comm(String),
    /// Writing metrics failed.
    #[error("writing metrics: {0}")]
    Io(#[from] std::io::Error),
}

/// Result of the training loop.
pub type Result<T> = std::result::Result<T, TrainError>;
