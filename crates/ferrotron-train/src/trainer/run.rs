//! [`Trainer::train`]: the iteration loop with interval logging, validation and
//! `metrics.jsonl` (Megatron's `train` + `training_log`).

use super::{
    DpoMetrics, EvalLine, FlopsModel, LogLine, Result, SavePlan, SavedLine, StepStats, TrainError,
    TrainLog, Trainer, num_floating_point_operations,
};
use ferrotron_data::{DatasetError, MicroBatch};
use ferrotron_model::DpoStats;
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
    /// DPO's metric sums over the interval's advanced iterations.
    dpo: Option<DpoStats>,
    /// The MoE losses summed over the interval's advanced iterations.
    moe: Option<super::MoeMetrics>,
    /// The last step's offload statistics, bytes moved summed over the interval.
    offload: Option<super::OffloadStats>,
}

impl Interval {
    /// Counts one finished iteration (its loss only when the optimizer did not skip it).
    fn add(&mut self, stats: &StepStats) {
        self.iterations += 1;
        self.tokens += stats.tokens;
        if let Some(o) = stats.offload {
            let moved = self.offload.map_or(0, |p| p.moved_bytes);
            self.offload = Some(super::OffloadStats {
                moved_bytes: moved + o.moved_bytes,
                ..o
            });
        }
        self.elapsed += stats.elapsed;
        self.comm_wait += stats.comm_wait;
        if stats.skipped {
            self.skipped += 1;
        } else {
            self.advanced += 1;
            self.loss_sum += stats.loss;
            if let Some(d) = &stats.dpo {
                self.dpo.get_or_insert_default().add(d);
            }
            if let Some(m) = &stats.moe {
                self.moe.get_or_insert_default().add(m);
            }
        }
        if !stats.loss.is_finite() {
            self.nan += 1;
        }
    }
}

/// The validation micro-batches of one evaluation, asked for when one is due.
type ValidProvider<'a> = dyn FnMut() -> Result<Vec<MicroBatch>> + 'a;

/// Hands `log` to `on_log` and appends it to `metrics` as one JSON line (flushed).
fn emit(log: TrainLog, metrics: &mut dyn Write, on_log: &mut dyn TrainObserver) -> Result<()> {
    on_log.on_report(&log);
    let json = serde_json::to_string(&log)
        .map_err(|e| TrainError::Config(format!("metrics JSON: {e}")))?;
    writeln!(metrics, "{json}")?;
    metrics.flush()?;
    Ok(())
}

/// The next `n` micro-batches of `data` (one global batch of this rank); `None` when the
/// data ends first.
fn next_global_batch(
    data: &mut dyn Iterator<Item = std::result::Result<MicroBatch, DatasetError>>,
    n: usize,
) -> Result<Option<Vec<MicroBatch>>> {
    let mut global = Vec::with_capacity(n);
    for item in (&mut *data).take(n) {
        global.push(item?);
    }
    Ok((global.len() == n).then_some(global))
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
        let flops_model = FlopsModel {
            reference_forward: self.options.dpo.is_some(),
            ..FlopsModel::from(self.model.config())
        };
        let mut acc = Interval::default();
        let mut summary = TrainSummary {
            iterations: self.iteration,
            consumed_samples: self.consumed_samples,
            last_loss: f64::NAN,
            last_eval_loss: None,
            data_exhausted: false,
            exited_early: false,
        };
        let (mut last_eval_at, mut last_save_at) = (None, None);
        while self.iteration < opts.train_iters {
            let Some(global) = next_global_batch(data, opts.num_microbatches())? else {
                summary.data_exhausted = true;
                break;
            };
            let stats = self.train_step(&global)?;
            summary.last_loss = stats.loss;
            acc.add(&stats);
            on_log.on_iteration(&stats);
            let last = self.iteration == opts.train_iters;
            if self.iteration.is_multiple_of(opts.log_interval) || last {
                let line = self.log_line(&acc, &flops_model, global[0].seq_length, &stats);
                emit(TrainLog::Train(line), metrics, on_log)?;
                acc = Interval::default();
            }
            let eval_now =
                opts.eval_interval > 0 && self.iteration.is_multiple_of(opts.eval_interval);
            if let Some(provider) = valid.as_mut()
                && eval_now
            {
                self.finish_param_gather()?;
                summary.last_eval_loss = Some(self.validate(provider, metrics, on_log)?);
                last_eval_at = Some(self.iteration);
            }
            if self.save_due() {
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
        let ends = (last_eval_at, last_save_at);
        self.end_of_training(valid, ends, summary, metrics, on_log)
    }

    /// The end of [`Trainer::train`]: the last parameter all-gathers (the caller gets
    /// current weights), a final validation unless the last iteration was just validated
    /// (or training stopped at `exit_interval`), a final save unless the last iteration was
    /// just saved. `last_at`: the iterations of the last validation and the last save.
    fn end_of_training(
        &mut self,
        valid: Option<&mut ValidProvider<'_>>,
        last_at: (Option<u64>, Option<u64>),
        mut summary: TrainSummary,
        metrics: &mut dyn Write,
        on_log: &mut dyn TrainObserver,
    ) -> Result<TrainSummary> {
        let (last_eval_at, last_save_at) = last_at;
        self.finish_param_gather()?;
        if let Some(provider) = valid
            && self.options.eval_interval > 0
            && self.iteration > 0
            && !summary.exited_early
            && last_eval_at != Some(self.iteration)
        {
            summary.last_eval_loss = Some(self.validate(provider, metrics, on_log)?);
        }
        if self.save_plan.is_some() && self.iteration > 0 && last_save_at != Some(self.iteration) {
            emit(TrainLog::Saved(self.save_planned()?), metrics, on_log)?;
        }
        summary.iterations = self.iteration;
        summary.consumed_samples = self.consumed_samples;
        Ok(summary)
    }

    /// Megatron's `training_log` line over the iterations of `acc`, the last of which
    /// gave `stats` (its grad norm) on sequences of `seq_length` tokens.
    fn log_line(
        &self,
        acc: &Interval,
        flops_model: &FlopsModel,
        seq_length: usize,
        stats: &StepStats,
    ) -> LogLine {
        let opts = &self.options;
        let secs = acc.elapsed.as_secs_f64().max(1e-12);
        let per_iter = secs / acc.iterations as f64;
        let flops = num_floating_point_operations(
            flops_model,
            opts.global_batch_size as u64,
            seq_length as u64,
        );
        LogLine {
            iteration: self.iteration,
            train_iters: opts.train_iters,
            consumed_samples: self.consumed_samples,
            elapsed_ms_per_iteration: per_iter * 1e3,
            tflops: flops / per_iter / 1e12 / self.parallel_layout().world_size() as f64,
            tokens_per_second: acc.tokens as f64 / secs,
            learning_rate: self.scheduler.lr(),
            global_batch_size: opts.global_batch_size,
            lm_loss: acc.loss_sum / acc.advanced.max(1) as f64,
            loss_scale: self.optimizer.grad_scaler().map(|g| g.scale()),
            grad_norm: stats.grad_norm,
            skipped_iterations: acc.skipped,
            nan_iterations: acc.nan,
            comm_wait_ms: acc.comm_wait.as_secs_f64() * 1e3 / acc.iterations as f64,
            model_state_bytes: self.resident_model_state_bytes() as u64,
            peak_rss_bytes: ferrotron_tensor::pages::peak_resident_set_bytes(),
            dpo: acc.dpo.as_ref().and_then(DpoMetrics::from_sums),
            moe: acc.moe.map(|m| m.mean(acc.advanced)),
            offload: acc.offload.map(|o| super::OffloadStats {
                moved_bytes: o.moved_bytes / acc.iterations.max(1),
                ..o
            }),
        }
    }

    /// One validation of the micro-batches `provider` gives, reported as an [`EvalLine`];
    /// returns its loss.
    fn validate(
        &mut self,
        provider: &mut ValidProvider<'_>,
        metrics: &mut dyn Write,
        on_log: &mut dyn TrainObserver,
    ) -> Result<f64> {
        let (loss, dpo) = self.evaluate_counted(&provider()?)?;
        let mut line = EvalLine::new(self.iteration, loss);
        line.dpo = dpo.as_ref().and_then(DpoMetrics::from_sums);
        let line = TrainLog::Valid(line);
        emit(line, metrics, on_log)?;
        Ok(loss)
    }

    /// A checkpoint is due after this iteration (the save plan's `interval`).
    fn save_due(&self) -> bool {
        self.save_plan.as_ref().is_some_and(|p| {
            p.interval
                .is_some_and(|n| n > 0 && self.iteration.is_multiple_of(n))
        })
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

    /// [`Trainer::evaluate_with_dpo`], counting the samples into `consumed_valid_samples`.
    fn evaluate_counted(&mut self, batches: &[MicroBatch]) -> Result<(f64, Option<DpoStats>)> {
        let out = self.evaluate_with_dpo(batches)?;
        let local: u64 = batches.iter().map(|b| b.micro_batch_size as u64).sum();
        self.consumed_valid_samples += local * self.data_shard().1 as u64;
        Ok(out)
    }
}
