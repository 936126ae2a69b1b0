//! Training for Ferrotron: the run configuration (`ferrotron train --config run.toml`) and,
//! later, the training loop built on it.

pub mod config;
pub mod metrics;
pub mod trainer;
