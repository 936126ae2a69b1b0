//! Starting the ranks of a `train` run: one rank in this thread, `tp x cp x pp x dp` rank
//! threads in this process ([`ferrotron_comm::run_local`], the cores split between them), or
//! one rank per `mpirun` process (`--dist-backend mpi`).

use super::rank::run_rank;
#[cfg(feature = "mpi")]
use anyhow::Context;
use anyhow::{Result, anyhow};
use ferrotron_comm::{
    Communicator, FailureCause, ParallelConfig, ParallelState, ProcessGroups, SingleRankComm,
    run_local, threads_per_rank,
};
use ferrotron_train::config::RunConfig;
use std::process::ExitCode;
use std::sync::Arc;

/// Where the ranks of a run live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DistBackend {
    /// Threads of this process over shared memory (the default).
    Local,
    /// One process per rank, started by `mpirun -np N` (build feature `mpi`).
    Mpi,
}

/// A rank's process groups and what follows from them.
pub struct RankContext {
    /// Its groups (world, data, tensor, pipeline, ...).
    pub groups: ProcessGroups,
}

impl RankContext {
    fn new(config: ParallelConfig, world: Arc<dyn Communicator>) -> Result<Self> {
        let state = ParallelState::new(world.size(), world.rank(), config)?;
        Ok(RankContext {
            groups: ProcessGroups::new(state, world)?,
        })
    }

    /// World rank 0 writes the run directory, the metrics and the log.
    pub fn is_logging_rank(&self) -> bool {
        self.groups.state.rank() == 0
    }
}

fn parallel_config(rc: &RunConfig) -> ParallelConfig {
    let p = &rc.resolved.parallel;
    ParallelConfig {
        tensor_model_parallel_size: p.tensor_model_parallel_size,
        pipeline_model_parallel_size: p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size: p.virtual_pipeline_model_parallel_size,
        context_parallel_size: p.context_parallel_size,
        expert_model_parallel_size: p.expert_model_parallel_size,
    }
}

/// Ranks in the run: `tp · cp · pp · dp`.
fn world_size(rc: &RunConfig) -> usize {
    let p = &rc.resolved.parallel;
    p.tensor_model_parallel_size
        * p.context_parallel_size
        * p.pipeline_model_parallel_size
        * rc.data_parallel_size
}

/// Trains `rc` with every rank in this process; returns rank 0's exit code.
///
/// # Errors
/// The first rank's failure, named `rank N: ...`.
pub fn run_in_process(rc: &RunConfig) -> Result<ExitCode> {
    let config = parallel_config(rc);
    let world = world_size(rc);
    if world == 1 {
        let ctx = RankContext::new(config, Arc::new(SingleRankComm))?;
        return run_rank(rc, &ctx);
    }
    let threads = threads_per_rank(world);
    eprintln!(
        "running {world} ranks in this process (tensor {} x pipeline {} x data {}), \
         {threads} thread(s) each",
        config.tensor_model_parallel_size,
        config.pipeline_model_parallel_size,
        rc.data_parallel_size
    );
    // run_local gives every rank its own pool of `threads` workers.
    let codes = run_local(world, |comm| -> Result<ExitCode> {
        let ctx = RankContext::new(config, Arc::new(comm))?;
        run_rank(rc, &ctx)
    })
    .map_err(|f| match f.cause {
        FailureCause::Error(e) => anyhow!("rank {}: {e:#}", f.rank),
        FailureCause::Panic(m) => anyhow!("rank {} panicked: {m}", f.rank),
    })?;
    Ok(codes[0])
}

/// Trains `rc` as this `mpirun` process's rank. A failing rank prints its error and ends
/// the whole job (`MPI_Abort`), so no rank waits forever for it.
#[cfg(feature = "mpi")]
pub fn run_mpi(rc: &RunConfig, world: ferrotron_comm::MpiComm) -> Result<ExitCode> {
    let rank = world.rank();
    let world: Arc<ferrotron_comm::MpiComm> = Arc::new(world);
    let local_ranks: usize = std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (cores / local_ranks.max(1)).max(1);
    let result = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .context("starting the rank's worker threads")
        .and_then(|pool| {
            pool.install(|| {
                let ctx = RankContext::new(parallel_config(rc), world.clone())?;
                run_rank(rc, &ctx)
            })
        });
    match result {
        Ok(code) => Ok(code),
        Err(e) => {
            eprintln!("error: rank {rank}: {e:#}");
            world.abort(1)
        }
    }
}
