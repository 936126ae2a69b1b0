//! What a user sees of a run: Megatron-style log lines on stdout, a progress bar with ETA on
//! stderr when it is a terminal, TensorBoard event files (`OUTPUT/tensorboard/`) and the loss
//! curve (`OUTPUT/loss.png`, redrawn at every log and validation line).

use anyhow::{Context, Result};
use ferrotron_train::metrics::{LossPlot, TensorBoardWriter};
use ferrotron_train::trainer::{StepStats, TrainLog, TrainObserver};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::path::Path;

/// The CLI's [`TrainObserver`].
pub struct RunObserver {
    bar: Option<ProgressBar>,
    tensorboard: Option<TensorBoardWriter>,
    plot: Option<LossPlot>,
}

impl RunObserver {
    /// Sinks for a run writing into `out_dir`, `done` of `train_iters` iterations done.
    /// `tensorboard`: write event files to `out_dir/tensorboard`.
    ///
    /// # Errors
    /// The TensorBoard directory or event file cannot be created.
    pub fn new(out_dir: &Path, tensorboard: bool, done: u64, train_iters: u64) -> Result<Self> {
        let tensorboard = if tensorboard {
            let dir = out_dir.join("tensorboard");
            Some(
                TensorBoardWriter::create(&dir)
                    .with_context(|| format!("logging.tensorboard: {}", dir.display()))?,
            )
        } else {
            None
        };
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::with_draw_target(
                Some(train_iters),
                ProgressDrawTarget::stderr_with_hz(4),
            )
            .with_style(
                ProgressStyle::with_template(
                    "{bar:40} {pos}/{len} iterations | {elapsed_precise} elapsed, ETA {eta_precise} | {msg}",
                )
                .expect("a valid template"),
            );
            bar.set_position(done);
            bar.reset_eta();
            bar
        });
        let mut plot = LossPlot::new(out_dir.join("loss.png"));
        if done > 0 {
            // A resumed run: the curve continues from the points of the run it resumes.
            let metrics = out_dir.join("metrics.jsonl");
            if let Ok(text) = std::fs::read_to_string(&metrics) {
                for log in text
                    .lines()
                    .filter_map(|l| serde_json::from_str::<TrainLog>(l).ok())
                {
                    plot.push(&log);
                }
            }
        }
        Ok(RunObserver {
            bar,
            tensorboard,
            plot: Some(plot),
        })
    }

    /// Prints a line above the progress bar (or plainly without one).
    fn println(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => println!("{line}"),
        }
    }

    /// Clears the progress bar.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

impl TrainObserver for RunObserver {
    fn on_report(&mut self, log: &TrainLog) {
        self.println(&log.to_string());
        // A metrics sink that fails is reported once and dropped; training goes on.
        if let Some(tb) = &mut self.tensorboard
            && let Err(e) = tb.record(log)
        {
            eprintln!("warning: TensorBoard events are no longer written: {e}");
            self.tensorboard = None;
        }
        if let Some(plot) = &mut self.plot
            && let Err(e) = plot.record(log)
        {
            eprintln!("warning: the loss plot is no longer drawn: {e}");
            self.plot = None;
        }
    }

    fn on_iteration(&mut self, stats: &StepStats) {
        if let Some(bar) = &self.bar {
            bar.set_position(stats.iteration);
            bar.set_message(format!("lm loss {:.4}", stats.loss));
        }
    }
}
