//! One rank's part of a training run from a [`RunConfig`] (Megatron-LM's `pretrain` in
//! `megatron/training/training.py`, Pai-Megatron-Patch's SFT entry points): the model
//! (`model.load` or Megatron's init from the `[model]` dimensions), this rank's slice of it
//! ([`parallelize`](crate::parallelize)), the datasets and this rank's data-parallel share
//! of the loader, the [`Trainer`](crate::trainer::Trainer) with its data-parallel and
//! pipeline groups, resuming
//! (`checkpoint.load`), saving, validation, `metrics.jsonl`, and the HF export of the
//! trained model (`checkpoint.export_hf`).
//!
//! [`Run::setup`] builds everything, [`Run::train`] (or [`Run::evaluate_only`] for
//! `training.skip_train`) runs it and [`Run::finish`] exports. Every rank of the run calls
//! them in the same order (they are collective over the rank's [`ProcessGroups`]); world
//! rank 0 (the logging rank) writes the run directory, the metrics and the export. The
//! library prints nothing: what a user should hear of comes as [`RunNote`]s, and the log
//! lines through the [`TrainObserver`](crate::trainer::TrainObserver) given to
//! [`Run::train`].

mod data;
mod export;
mod model;
mod resume;
mod setup;

pub use data::RunData;
pub use model::{RunModel, build_model};
pub use setup::Run;

use crate::ParallelizeError;
use crate::trainer::TrainError;
use ferrotron_comm::{CommError, ProcessGroups};
use ferrotron_data::DatasetError;
use ferrotron_data::sft::SftReport;
use ferrotron_model::ModelError;
use std::fmt;
use std::path::PathBuf;

#[cfg(doc)]
use crate::config::RunConfig;

/// Errors of a run; each names the config key or file it concerns.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The run cannot go on as configured or as its inputs are (the message names the keys).
    #[error("{0}")]
    Config(String),
    /// A step of the run failed: `context` names the key or file, `source` says why.
    #[error("{context}")]
    Context {
        /// What was being done, naming the key or file (e.g. `loading model.load DIR`).
        context: String,
        /// The cause.
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// The trainer failed (a step, validation, a checkpoint, metrics).
    #[error(transparent)]
    Train(#[from] TrainError),
    /// The model does not split into the run's layout.
    #[error(transparent)]
    Parallelize(#[from] ParallelizeError),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The data loader failed.
    #[error(transparent)]
    Data(#[from] DatasetError),
    /// A collective failed (often: another rank failed first).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// Writing the metrics failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Adds what was being done (naming the key or file) to an error: [`RunError::Context`].
pub(crate) trait Context<T> {
    /// The error with `context`.
    fn context(self, context: impl fmt::Display) -> Result<T, RunError>;
    /// The error with the context `f` makes (only on failure).
    fn with_context<C: fmt::Display>(self, f: impl FnOnce() -> C) -> Result<T, RunError>;
}

impl<T, E: std::error::Error + Send + Sync + 'static> Context<T> for Result<T, E> {
    fn context(self, context: impl fmt::Display) -> Result<T, RunError> {
        self.with_context(|| context)
    }

    fn with_context<C: fmt::Display>(self, f: impl FnOnce() -> C) -> Result<T, RunError> {
        self.map_err(|e| RunError::Context {
            context: f().to_string(),
            source: Box::new(e),
        })
    }
}

/// What a run tells its user besides the log lines (Megatron's `print_rank_0` notes and
/// warnings). `Display` gives the line(s) the CLI prints on stderr.
#[derive(Clone, Debug, PartialEq)]
pub enum RunNote {
    /// `data.split` gives no validation part, so no validation runs (logging rank).
    NoValidationSplit {
        /// `data.split` as written.
        split: String,
    },
    /// The `sft_raw` data was read and encoded (every rank).
    SftRawEncoded {
        /// What encoding did.
        report: SftReport,
        /// `model.seq_length`.
        seq_length: usize,
    },
    /// `checkpoint.load` holds no checkpoint: training starts from scratch (every rank).
    NoCheckpoint {
        /// `checkpoint.load`.
        load: PathBuf,
    },
    /// A checkpoint was loaded (every rank).
    CheckpointLoaded {
        /// Its iteration directory.
        dir: PathBuf,
        /// Its iteration.
        iteration: u64,
        /// Weights only (`training.finetune`).
        finetune: bool,
    },
    /// Training stopped at `training.exit_interval` (logging rank).
    ExitedEarly {
        /// Iterations done.
        iteration: u64,
    },
    /// The training data ran out before `train_iters` (logging rank).
    DataExhausted {
        /// Iterations done.
        iterations: u64,
        /// `train_iters`.
        train_iters: u64,
    },
    /// Training is over (logging rank).
    Done {
        /// Iterations done.
        iterations: u64,
        /// Samples consumed.
        consumed_samples: u64,
        /// `OUTPUT/metrics.jsonl`.
        metrics: PathBuf,
        /// `OUTPUT/loss.png`.
        loss_plot: PathBuf,
    },
    /// The preference pairs were read and tokenized (`data.dataset_type` "dpo" or "reward").
    PairsEncoded {
        /// Pairs read.
        pairs: usize,
        /// Sides cut to `seq_length`.
        truncated: usize,
        /// `model.seq_length`.
        seq_length: usize,
    },
    /// The trained LoRA adapters were exported (`checkpoint.export_peft`, logging rank).
    ExportedAdapter {
        /// The PEFT adapter directory.
        dir: PathBuf,
        /// Bytes of `adapter_model.safetensors`.
        bytes: u64,
    },
    /// The trained model was exported (`checkpoint.export_hf`, logging rank).
    Exported {
        /// The HF directory.
        dir: PathBuf,
        /// Tensors written.
        tensors: usize,
        /// Bytes written.
        bytes: u64,
    },
}

impl fmt::Display for RunNote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunNote::NoValidationSplit { split } => write!(
                f,
                "note: data.split `{split}` has no validation part: no validation"
            ),
            RunNote::SftRawEncoded { report, seq_length } => {
                write!(
                    f,
                    "sft_raw: {} records -> {} sequences of {seq_length} tokens, {} answer tokens \
                     ({} bad records, {} truncated)",
                    report.records,
                    report.sequences,
                    report.trained_tokens,
                    report.bad_records,
                    report.truncated
                )?;
                for ex in &report.bad_examples {
                    write!(f, "\n  skipped {ex}")?;
                }
                Ok(())
            }
            RunNote::NoCheckpoint { load } => write!(
                f,
                "note: no checkpoint found in checkpoint.load {}: training from scratch",
                load.display()
            ),
            RunNote::CheckpointLoaded {
                dir,
                iteration,
                finetune,
            } => write!(
                f,
                " successfully loaded checkpoint from {} at iteration {iteration}{}",
                dir.display(),
                if *finetune {
                    " (weights only: --finetune)"
                } else {
                    ""
                }
            ),
            RunNote::ExitedEarly { iteration } => write!(
                f,
                "exiting at iteration {iteration} (training.exit_interval); resume with \
                 checkpoint.load"
            ),
            RunNote::DataExhausted {
                iterations,
                train_iters,
            } => write!(
                f,
                "warning: the training data ran out after {iterations} of {train_iters} iterations"
            ),
            RunNote::Done {
                iterations,
                consumed_samples,
                metrics,
                loss_plot,
            } => write!(
                f,
                "done: {iterations} iterations, {consumed_samples} samples; metrics in {}, loss \
                 curve in {}",
                metrics.display(),
                loss_plot.display()
            ),
            RunNote::PairsEncoded {
                pairs,
                truncated,
                seq_length,
            } => write!(
                f,
                "preference data: {pairs} pairs, {truncated} sides cut to {seq_length} tokens"
            ),
            RunNote::ExportedAdapter { dir, bytes } => write!(
                f,
                "exported the LoRA adapters to {} (PEFT, {:.1} MB)",
                dir.display(),
                *bytes as f64 / 1e6
            ),
            RunNote::Exported {
                dir,
                tensors,
                bytes,
            } => write!(
                f,
                "exported the trained model to {} ({tensors} tensors, {:.1} MB)",
                dir.display(),
                *bytes as f64 / 1e6
            ),
        }
    }
}

/// Receives the [`RunNote`]s of a run (any `FnMut(&RunNote)` is one).
pub type NoteSink<'a> = dyn FnMut(&RunNote) + 'a;

/// Runs `f` on world rank 0 first, then on every other rank (e.g. building the dataset
/// index caches once instead of racing to write them). Collective over `groups.world`.
///
/// # Errors
/// `f`'s error, or a failed barrier.
pub fn first_then_others<T>(
    groups: &ProcessGroups,
    f: impl FnOnce() -> Result<T, RunError>,
) -> Result<T, RunError> {
    if groups.state.rank() == 0 {
        let value = f()?;
        groups.world.barrier()?;
        Ok(value)
    } else {
        groups.world.barrier()?;
        f()
    }
}
