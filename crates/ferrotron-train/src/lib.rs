//! Training for Ferrotron: the run configuration (`ferrotron train --config run.toml`), the
//! [`trainer`] (single rank, data and tensor parallel), the [`pipeline`] schedules and the
//! [`metrics`] writers.

pub mod allocator;
pub mod config;
pub mod metrics;
pub mod pipeline;
pub mod trainer;
