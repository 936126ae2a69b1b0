//! [`Trainer::train`]: the iteration loop with interval logging, validation and
//! `metrics.jsonl` (Megatron's `train` + `training_log`).

use super::{
    EvalLine, FlopsModel, LogLine, Result, SavePlan, SavedLine, StepStats, TrainError, TrainLog,
    Trainer, num_floating_point_operations,
};
use ferrotron_data::{DatasetError, MicroBatch};
use std::io::Write;
use std::time::Duration;

/// How a [`Trainer::train`] call ended.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainSummary {
    /// Iterations completed in total (including earlier calls).
    pub iterations: u64,
    /// Samples consumed in total.
    pub consumed_samples: u64,
    /// Loss of the last iteration (NaN when none ran).
    pub last_loss: f64,
    /// Last validation loss, if any validation ran.
    pub last_eval_loss: Option<f64>,
    /// The data ran out before `train_iters`.
    pub data_exhausted: bool,
    /// Stopped at `exit_interval` before `train_iters`.
    pub exited_early: bool,
}

/// Receives what [`Trainer::train`] reports. Any `FnMut(&TrainLog)` closure is one (and
/// ignores the per-iteration calls).
pub trait TrainObserver {
    /// A log, validation or checkpoint report, just before it is appended to the metrics.
    fn on_report(&mut self, log: &TrainLog);

    /// Every finished iteration (e.g. to advance a progress bar); nothing by default.
    fn on_iteration(&mut self, _stats: &StepStats) {}
}

impl<F: FnMut(&TrainLog)> TrainObserver for F {
    fn on_report(&mut self, log: &TrainLog) {
        self(log)
    }
}

/// Interval accumulators of `training_log`.
#[derive(Default)]
struct Interval {
    iterations: u64,
    advanced: u64,
    loss_sum: f64,
    tokens: usize,
    elapsed: Duration,
    skipped: u64,
    nan: u64,
    comm_wait: Duration,
}

/// Hands `log` to `on_log` and appends it to `metrics` as one JSON line (flushed).
fn emit(log: TrainLog, metrics: &mut dyn Write, on_log: &mut dyn TrainObserver) -> Result<()> {
    on_log.on_report(&log);
    let json = serde_json::to_string(&log)
        .map_err(|e| TrainError::Config(format!("metrics JSON: {e}")))?;
    writeln!(metrics, "{json}")?;
    metrics.flush()?;
    Ok(())
}

impl Trainer {
    /// Runs iterations until `train_iters` (from the current iteration on), until `data`
    /// ends, or until an iteration divisible by `exit_interval`, taking `num_microbatches` micro-batches per step.
    ///
    /// Every `log_interval` iterations (and at the last) a [`LogLine`] is reported; every
    /// `eval_interval` iterations (and at the end, when validation is configured) `valid`
    /// is asked for the micro-batches of one validation and an [`EvalLine`] is reported.
    /// With a [`SavePlan`] ([`Trainer::set_save_plan`]) a checkpoint is saved every `interval`
    /// iterations and at the end (unless the last iteration was just saved), each reported
    /// as a [`SavedLine`]. Each report goes to `on_log` and, as one JSON line, to `metrics`;
    /// `on_log` also hears of every finished iteration.
    ///
    /// # Errors
    /// A data, model, optimizer or write failure; training state stays consistent (the
    /// failing iteration is not counted).
    pub fn train(
        &mut self,
        data: &mut dyn Iterator<Item = std::result::Result<MicroBatch, DatasetError>>,
        mut valid: Option<&mut dyn FnMut() -> Result<Vec<MicroBatch>>>,
        metrics: &mut dyn Write,
        on_log: &mut dyn TrainObserver,
    ) -> Result<TrainSummary> {
        let opts = self.options.clone();
        let flops_model = FlopsModel::from(self.model.config());
        let mut acc = Interval::default();
        let mut summary = TrainSummary {
            iterations: self.iteration,
            consumed_samples: self.consumed_samples,
            last_loss: f64::NAN,
            last_eval_loss: None,
            data_exhausted: false,
            exited_early: false,
        };
        let mut last_eval_at = None;
        let mut last_save_at = None;
        while self.iteration < opts.train_iters {
            let mut global = Vec::with_capacity(opts.num_microbatches());
            for item in (&mut *data).take(opts.num_microbatches()) {
                global.push(item?);
            }
            if global.len() < opts.num_microbatches() {
                summary.data_exhausted = true;
                break;
            }
            let seq_length = global[0].seq_length;
            let stats = self.train_step(&global)?;
            summary.last_loss = stats.loss;
            acc.iterations += 1;
            acc.tokens += stats.tokens;
            acc.elapsed += stats.elapsed;
            acc.comm_wait += stats.comm_wait;
            if stats.skipped {
                acc.skipped += 1;
            } else {
                acc.advanced += 1;
                acc.loss_sum += stats.loss;
            }
            if !stats.loss.is_finite() {
                acc.nan += 1;
            }
            on_log.on_iteration(&stats);
            let last = self.iteration == opts.train_iters;
            if self.iteration.is_multiple_of(opts.log_interval) || last {
                let secs = acc.elapsed.as_secs_f64().max(1e-12);
                let per_iter = secs / acc.iterations as f64;
                let flops = num_floating_point_operations(
                    &flops_model,
                    opts.global_batch_size as u64,
                    seq_length as u64,
                );
                let line = LogLine {
                    iteration: self.iteration,
                    train_iters: opts.train_iters,
                    consumed_samples: self.consumed_samples,
                    elapsed_ms_per_iteration: per_iter * 1e3,
                    tflops: flops / per_iter / 1e12,
                    tokens_per_second: acc.tokens as f64 / secs,
                    learning_rate: self.scheduler.lr(),
                    global_batch_size: opts.global_batch_size,
                    lm_loss: acc.loss_sum / acc.advanced.max(1) as f64,
                    loss_scale: self.optimizer.grad_scaler().map(|g| g.scale()),
                    grad_norm: stats.grad_norm,
                    skipped_iterations: acc.skipped,
                    nan_iterations: acc.nan,
                    comm_wait_ms: acc.comm_wait.as_secs_f64() * 1e3 / acc.iterations as f64,
                };
                emit(TrainLog::Train(line), metrics, on_log)?;
                acc = Interval::default();
            }
            let eval_now =
                opts.eval_interval > 0 && self.iteration.is_multiple_of(opts.eval_interval);
            if let Some(provider) = valid.as_mut()
                && eval_now
            {
                self.finish_param_gather()?;
                let loss = self.evaluate_counted(&provider()?)?;
                summary.last_eval_loss = Some(loss);
                last_eval_at = Some(self.iteration);
                emit(
                    TrainLog::Valid(EvalLine::new(self.iteration, loss)),
                    metrics,
                    on_log,
                )?;
            }
            let save_now = self.save_plan.as_ref().is_some_and(|p| {
                p.interval
                    .is_some_and(|n| n > 0 && self.iteration.is_multiple_of(n))
            });
            if save_now {
                self.finish_param_gather()?;
                emit(TrainLog::Saved(self.save_planned()?), metrics, on_log)?;
                last_save_at = Some(self.iteration);
            }
            if opts
                .exit_interval
                .is_some_and(|n| self.iteration.is_multiple_of(n))
            {
                summary.exited_early = self.iteration < opts.train_iters;
                break;
            }
        }
        // The caller gets current weights.
        self.finish_param_gather()?;
        if let Some(provider) = valid.as_mut()
            && opts.eval_interval > 0
            && self.iteration > 0
            && !summary.exited_early
            && last_eval_at != Some(self.iteration)
        {
            let loss = self.evaluate_counted(&provider()?)?;
            summary.last_eval_loss = Some(loss);
            emit(
                TrainLog::Valid(EvalLine::new(self.iteration, loss)),
                metrics,
                on_log,
            )?;
        }
        if self.save_plan.is_some() && self.iteration > 0 && last_save_at != Some(self.iteration) {
            emit(TrainLog::Saved(self.save_planned()?), metrics, on_log)?;
        }
        summary.iterations = self.iteration;
        summary.consumed_samples = self.consumed_samples;
        Ok(summary)
    }
}

impl Trainer {
    /// Saves or clears where [`Trainer::train`] writes checkpoints.
    pub fn set_save_plan(&mut self, plan: Option<SavePlan>) {
        self.save_plan = plan;
    }

    /// Saves per the plan now, timing it.
    fn save_planned(&self) -> Result<SavedLine> {
        let plan = self.save_plan.as_ref().expect("called with a save plan");
        let start = std::time::Instant::now();
        let dir = self.save_checkpoint_with_files(
            &plan.dir,
            plan.keep_last,
            plan.extra.clone(),
            &plan.files,
        )?;
        Ok(SavedLine {
            iteration: self.iteration,
            dir: dir.display().to_string(),
            elapsed_ms: start.elapsed().as_secs_f64() * 1e3,
        })
    }

    /// [`Trainer::evaluate`], counting the samples into `consumed_valid_samples`.
    fn evaluate_counted(&mut self, batches: &[MicroBatch]) -> Result<f64> {
        let loss = self.evaluate(batches)?;
        let local: u64 = batches.iter().map(|b| b.micro_batch_size as u64).sum();
        self.consumed_valid_samples += local * self.dp.size() as u64;
        Ok(loss)
    }
}
