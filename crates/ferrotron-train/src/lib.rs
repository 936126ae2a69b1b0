//! Training for Ferrotron: the run configuration (`ferrotron train --config run.toml`),
//! [`parallelize`] (a rank's model slice for any tp x pp x vp layout), the [`trainer`]
//! (single rank, data, tensor and pipeline parallel), the [`pipeline`] schedules, the
//! [`metrics`] writers, and [`run`]: one rank's whole run of a configuration (model, data,
//! trainer, checkpoints, validation, HF export).

pub mod config;
pub mod metrics;
mod parallelize;
pub mod pipeline;
pub mod run;
pub mod trainer;

pub use parallelize::{ParallelizeError, ParallelizeOptions, parallelize};
