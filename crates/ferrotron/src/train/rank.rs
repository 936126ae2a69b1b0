//! One rank of a `train` run ([`ferrotron_train::run::Run`]): the library builds and runs
//! it; this rank prints its notes, and — on the logging rank (world rank 0) — its log lines,
//! progress bar, TensorBoard events and loss plot ([`RunObserver`]).

use super::launch::RankContext;
use super::observer::RunObserver;
use anyhow::Result;
use ferrotron_train::config::RunConfig;
use ferrotron_train::run::{Run, RunNote};
use ferrotron_train::trainer::TrainLog;
use std::process::ExitCode;

/// Trains `rc` as `rank`.
pub fn run_rank(rc: &RunConfig, rank: &RankContext) -> Result<ExitCode> {
    let lead = rank.is_logging_rank();
    let mut notes = |note: &RunNote| eprintln!("{note}");
    let mut run = Run::setup(rc, &rank.groups, &mut notes)?;
    if rc.resolved.training.skip_train {
        let line = run.evaluate_only()?;
        if lead {
            println!("{line}");
        }
        return Ok(ExitCode::SUCCESS);
    }
    // Model, optimizer and data are in place: from here on, steps reuse the memory the last
    // one freed instead of faulting it in again.
    ferrotron_tensor::allocator::retain_freed_memory();
    let summary = if lead {
        let logging = &rc.resolved.logging;
        let done = run.trainer().iteration();
        let mut observer = RunObserver::new(
            &logging.output_dir,
            logging.tensorboard,
            done,
            rc.train_iters,
        )?;
        let summary = run.train(&mut observer);
        observer.finish();
        summary?
    } else {
        run.train(&mut |_: &TrainLog| {})?
    };
    run.finish(&summary, &mut notes)?;
    Ok(ExitCode::SUCCESS)
}
