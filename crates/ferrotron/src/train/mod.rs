//! `train`: a pretraining or SFT run from a `run.toml` (Megatron's `pretrain_gpt.py`,
//! Pai-Megatron-Patch's SFT entry points): the arguments, the config, the ranks (`launch`)
//! and what a user sees of each (`rank`, `observer`); the run itself is
//! [`ferrotron_train::run`].

mod launch;
mod observer;
mod rank;

use anyhow::{Context, Result};
use clap::Args;
use ferrotron_train::config::{RunConfig, documented_keys};
pub use launch::DistBackend;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
#[command(
    after_long_help = "Every config key, its default and its meaning: ferrotron train --list-keys"
)]
pub struct TrainArgs {
    /// The run configuration (TOML with [model], [data], [training], [optimizer], [precision],
    /// [parallel], [checkpoint] and [logging] sections, Megatron argument names).
    #[arg(long, required_unless_present = "list_keys")]
    config: Option<PathBuf>,
    /// Override one key, `section.key=value` (TOML value; bare words are strings). Repeatable.
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
    /// Print the fully resolved configuration as TOML and exit without training.
    #[arg(long)]
    print_config: bool,
    /// Print every config key (section.key), its default and its documentation, then exit.
    #[arg(long)]
    list_keys: bool,
    /// Where the ranks run: `local` = threads of this process (tp x cp x pp x dp of the
    /// [parallel] section), `mpi` = one rank per process of
    /// `mpirun -np N ferrotron train --dist-backend mpi ...` (dp = N / (tp x cp x pp)).
    #[arg(long, value_enum, default_value = "local")]
    dist_backend: DistBackend,
}

/// The `section.key = default` lines and docs of every key.
fn keys_text() -> String {
    let mut out = String::new();
    for k in documented_keys() {
        out.push_str(&format!("{}.{} = {}\n", k.section, k.key, k.default));
        for line in k.doc.lines() {
            out.push_str(&format!("    {}\n", line.trim()));
        }
    }
    out
}

pub fn run(a: TrainArgs) -> Result<ExitCode> {
    if a.list_keys {
        print!("{}", keys_text());
        return Ok(ExitCode::SUCCESS);
    }
    let path = a.config.as_deref().context("--config is required")?;
    #[cfg(feature = "mpi")]
    let (rc, mpi_world) = if a.dist_backend == DistBackend::Mpi {
        use ferrotron_comm::Communicator;
        let world = ferrotron_comm::MpiComm::world()?;
        let rc = RunConfig::load(path, &a.set)?;
        let dp = rc.data_parallel_size_for_world(world.size())?;
        let mut sets = a.set.clone();
        sets.push(format!("parallel.data_parallel_size={dp}"));
        (RunConfig::load(path, &sets)?, Some(world))
    } else {
        (RunConfig::load(path, &a.set)?, None)
    };
    #[cfg(not(feature = "mpi"))]
    let rc = if a.dist_backend == DistBackend::Mpi {
        anyhow::bail!(
            "--dist-backend mpi: this ferrotron was built without MPI (cargo build --features mpi)"
        );
    } else {
        RunConfig::load(path, &a.set)?
    };
    if a.print_config {
        print!("{}", rc.to_toml());
        return Ok(ExitCode::SUCCESS);
    }
    #[cfg(feature = "mpi")]
    if let Some(world) = mpi_world {
        return launch::run_mpi(&rc, world);
    }
    launch::run_in_process(&rc)
}
