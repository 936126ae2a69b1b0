//! [`Run`]: one rank's run, built by [`Run::setup`] (Megatron's `setup_model_and_optimizer`
//! and `build_train_valid_test_data_iterators`), run by [`Run::train`] or
//! [`Run::evaluate_only`], ended by [`Run::finish`].

use super::data::{RunData, build_datasets};
use super::export::{ExportPlan, save_plan};
use super::model::{RunModel, build_model, precision};
use super::{Context, NoteSink, RunError, RunNote, first_then_others, resume};
use crate::config::requirements::{NO_EOD_ID, SKIP_TRAIN_WITHOUT_VALIDATION};
use crate::config::{LrDecayStyle, RunConfig};
use crate::trainer::{
    DataParallel, EvalLine, PipelineParallel, TrainError, TrainLog, TrainObserver, TrainSummary,
    Trainer, TrainerOptions,
};
use crate::{ParallelizeOptions, parallelize};
use ferrotron_comm::ProcessGroups;
use ferrotron_data::{DataLoader, LoaderConfig, MicroBatch};
use ferrotron_model::GptModel;
use ferrotron_model::module::ExpertTensorParallel;
use ferrotron_optim::{DynamicGradScalerConfig, LrDecayStyle as OptimDecay};
use std::borrow::Cow;
use std::io::{BufWriter, Write};
use std::path::PathBuf;

/// One rank's run of a [`RunConfig`] (see the [module docs](super)).
pub struct Run<'a> {
    rc: &'a RunConfig,
    /// World rank 0: writes the run directory, the metrics and the export.
    lead: bool,
    trainer: Trainer,
    /// This rank's data-parallel share of the training samples.
    loader: DataLoader,
    /// This rank's share of the validation samples, when validation runs.
    valid_loader: Option<DataLoader>,
    /// Micro-batches of one validation on this rank.
    micro_per_eval: usize,
    /// `OUTPUT/metrics.jsonl` on the logging rank, a sink elsewhere.
    metrics: Box<dyn Write>,
    metrics_path: PathBuf,
    export: ExportPlan,
}

impl<'a> Run<'a> {
    /// Builds this rank's run of `rc` with its process groups `groups`: on the logging rank
    /// the output directory with the resolved `run.toml`; the model ([`build_model`]) and
    /// this rank's slice of it ([`parallelize`]); the datasets (world rank 0 first, so it
    /// writes the index caches); the trainer with its data-parallel and pipeline groups,
    /// restored from `checkpoint.load`, saving to `checkpoint.save`; the loaders from the
    /// consumed samples on; and `metrics.jsonl` (appended to when resuming). Collective.
    /// `notes` hears what the user should know (no validation split, the checkpoint loaded).
    ///
    /// # Errors
    /// A file of the run that cannot be read or written, a model or data that do not fit
    /// the configuration (naming the key), a failed collective.
    pub fn setup(
        rc: &'a RunConfig,
        groups: &ProcessGroups,
        notes: &mut NoteSink<'_>,
    ) -> Result<Run<'a>, RunError> {
        let r = &rc.resolved;
        let lead = groups.state.rank() == 0;
        if lead {
            write_run_dir(rc)?;
        }
        let run_model = build_model(rc)?;
        let d = &r.data;
        if run_model.eod.is_none()
            && (d.eod_mask_loss || d.reset_position_ids || d.reset_attention_mask)
        {
            return Err(RunError::Config(NO_EOD_ID.into()));
        }
        let data = datasets(rc, groups, &run_model, notes)?;
        let eval_iters = r.training.eval_iters as usize;
        if lead && data.valid.is_none() && r.training.eval_interval > 0 && eval_iters > 0 {
            notes(&RunNote::NoValidationSplit {
                split: d.split.clone(),
            });
        }
        let mut opts = trainer_options(rc, data.valid.is_some())?;
        let micro_per_eval = eval_iters * opts.num_microbatches();
        let has_valid = opts.eval_interval > 0;
        let RunModel {
            model,
            tokenizer_dir,
            mut export_source,
            ..
        } = run_model;
        if let Some(reward) = &mut opts.reward {
            // Rewards are read where HF reads them: before the model's pad token (the data's
            // padding when the model has none, which the export then names).
            let pad = export_source.config.pad_token_id.or(data.pad_id);
            reward.pad_token_id = pad;
            export_source.config.pad_token_id = pad;
        }
        let dtype = precision(rc).1;
        let save = save_plan(rc, &model, &export_source, dtype, tokenizer_dir.as_deref())?;
        let export = ExportPlan::new(rc, lead, &model, export_source, tokenizer_dir);
        let mut trainer = build_trainer(rc, model, groups, opts)?;
        if let Some(load) = &r.checkpoint.load {
            resume::load(&mut trainer, load, r.training.finetune, notes)?;
        }
        trainer.set_save_plan(save);
        let (loader, valid_loader) = loaders(rc, &trainer, data, has_valid)?;
        let (metrics, metrics_path) = open_metrics(rc, lead, trainer.iteration())?;
        Ok(Run {
            rc,
            lead,
            trainer,
            loader,
            valid_loader,
            micro_per_eval,
            metrics,
            metrics_path,
            export,
        })
    }

    /// The trainer (e.g. its iteration after a resume).
    pub fn trainer(&self) -> &Trainer {
        &self.trainer
    }

    /// This rank writes the run directory, the metrics and the export (world rank 0).
    pub fn is_logging_rank(&self) -> bool {
        self.lead
    }

    /// Trains to `train_iters` (or `exit_interval`, or the end of the data) with validation
    /// every `eval_interval` iterations when there is validation data, saving per
    /// `checkpoint.save`; every report goes to `observer` and `metrics.jsonl`. Collective.
    ///
    /// # Errors
    /// A failed step, validation, save or metrics write; validation data that runs out.
    pub fn train(&mut self, observer: &mut dyn TrainObserver) -> Result<TrainSummary, RunError> {
        let micro_per_eval = self.micro_per_eval;
        let valid_loader = &mut self.valid_loader;
        let has_valid = valid_loader.is_some();
        let mut provider = || {
            let loader = valid_loader.as_mut().expect("validation configured");
            validation_batches(loader, micro_per_eval)
        };
        let valid: Option<&mut dyn FnMut() -> Result<Vec<MicroBatch>, TrainError>> =
            if has_valid { Some(&mut provider) } else { None };
        Ok(self
            .trainer
            .train(&mut self.loader, valid, &mut self.metrics, observer)?)
    }

    /// `training.skip_train`: one validation of the loaded model, appended to
    /// `metrics.jsonl` and returned (for the caller to show). Collective.
    ///
    /// # Errors
    /// No validation data (naming the keys), a failed validation or metrics write.
    pub fn evaluate_only(&mut self) -> Result<TrainLog, RunError> {
        let Some(loader) = self.valid_loader.as_mut() else {
            return Err(RunError::Config(SKIP_TRAIN_WITHOUT_VALIDATION.into()));
        };
        let batches = validation_batches(loader, self.micro_per_eval)?;
        let loss = self.trainer.evaluate(&batches)?;
        let line = TrainLog::Valid(EvalLine::new(self.trainer.iteration(), loss));
        let json = serde_json::to_string(&line).context("metrics JSON")?;
        writeln!(self.metrics, "{json}")?;
        self.metrics.flush()?;
        Ok(line)
    }

    /// After [`Run::train`] ended with `summary`: the exports (`checkpoint.export_hf`,
    /// `checkpoint.export_peft`; not when training stopped at `exit_interval`), the weights gathered over tensor and
    /// pipeline parallelism onto the logging rank (collective), which writes it; `notes`
    /// hears how the run ended (logging rank).
    ///
    /// # Errors
    /// A failed gather or export.
    pub fn finish(self, summary: &TrainSummary, notes: &mut NoteSink<'_>) -> Result<(), RunError> {
        let rc = self.rc;
        let exporting = self.export.exporting() && !summary.exited_early;
        let full_params = match exporting {
            true if self.export.split => self.trainer.gather_model_parameters()?,
            _ => None,
        };
        if !self.lead {
            return Ok(());
        }
        if summary.exited_early {
            notes(&RunNote::ExitedEarly {
                iteration: summary.iterations,
            });
        }
        if summary.data_exhausted {
            notes(&RunNote::DataExhausted {
                iterations: summary.iterations,
                train_iters: rc.train_iters,
            });
        }
        let out_dir = &rc.resolved.logging.output_dir;
        notes(&RunNote::Done {
            iterations: summary.iterations,
            consumed_samples: summary.consumed_samples,
            metrics: self.metrics_path.clone(),
            loss_plot: out_dir.join("loss.png"),
        });
        match exporting {
            true => self.export.export(self.trainer, full_params, rc, notes),
            false => Ok(()),
        }
    }
}

/// `logging.output_dir` with the resolved `run.toml` in it.
fn write_run_dir(rc: &RunConfig) -> Result<(), RunError> {
    let out_dir = &rc.resolved.logging.output_dir;
    std::fs::create_dir_all(out_dir)
        .with_context(|| format!("creating logging.output_dir {}", out_dir.display()))?;
    let path = out_dir.join("run.toml");
    std::fs::write(&path, rc.to_toml()).with_context(|| format!("writing {}", path.display()))
}

/// The datasets of the run in Megatron's sizes: every train sample, and `eval_iters`
/// global batches per evaluation (`train_iters / eval_interval` of them plus the final
/// one). World rank 0 builds them first (writing the index caches); the others then read.
fn datasets(
    rc: &RunConfig,
    groups: &ProcessGroups,
    run_model: &RunModel,
    notes: &mut NoteSink<'_>,
) -> Result<RunData, RunError> {
    // Rows: two per DPO pair.
    let (gbs, iters) = (rc.global_batch_size * rc.rows_per_sample(), rc.train_iters);
    let t = &rc.resolved.training;
    let evals = iters.checked_div(t.eval_interval).map_or(0, |n| n + 1);
    let valid_samples = t.eval_iters as usize * gbs * evals as usize;
    first_then_others(groups, || {
        build_datasets(
            rc,
            [gbs * iters as usize, valid_samples],
            run_model.eod,
            run_model.tokenizer_dir.as_deref(),
            notes,
        )
    })
}

/// The trainer's settings from `rc`; `has_valid_data`: the split has a validation part
/// (validation runs when it has and `eval_iters > 0`).
///
/// # Errors
/// A decay style the optimizer does not have.
fn trainer_options(rc: &RunConfig, has_valid_data: bool) -> Result<TrainerOptions, RunError> {
    let r = &rc.resolved;
    let (o, pr) = (&r.optimizer, &r.precision);
    let eval_iters = r.training.eval_iters as usize;
    let rows = rc.rows_per_sample();
    Ok(TrainerOptions {
        micro_batch_size: r.training.micro_batch_size * rows,
        global_batch_size: rc.global_batch_size * rows,
        data_parallel_size: rc.data_parallel_size,
        ddp_bucket_size: r.parallel.ddp_bucket_size,
        train_iters: rc.train_iters,
        log_interval: r.training.log_interval,
        // eval_iters = 0 turns validation off (Megatron skips evaluate then).
        eval_interval: if has_valid_data && eval_iters > 0 {
            r.training.eval_interval
        } else {
            0
        },
        eval_iters,
        lr: rc.lr,
        min_lr: o.min_lr,
        lr_warmup_iters: rc.lr_warmup_iters,
        lr_decay_iters: Some(rc.lr_decay_iters),
        lr_decay_style: decay_style(rc.lr_decay_style)?,
        weight_decay: o.weight_decay,
        adam_beta1: o.adam_beta1,
        adam_beta2: o.adam_beta2,
        adam_eps: o.adam_eps,
        clip_grad: o.clip_grad,
        precision: precision(rc).0,
        loss_scale: pr.loss_scale.map(|x| x as f32),
        dynamic_loss_scale: DynamicGradScalerConfig {
            initial_scale: pr.initial_loss_scale as f32,
            min_scale: pr.min_loss_scale as f32,
            growth_interval: pr.loss_scale_window as u32,
            hysteresis: pr.hysteresis as u32,
            ..DynamicGradScalerConfig::default()
        },
        exit_interval: r.training.exit_interval,
        seed: r.training.seed,
        dpo: rc.dpo,
        reward: rc.reward,
        offload: rc.offload.clone(),
    })
}

/// `optimizer.lr_decay_style` as the scheduler's.
fn decay_style(s: LrDecayStyle) -> Result<OptimDecay, RunError> {
    Ok(match s {
        LrDecayStyle::Constant => OptimDecay::Constant,
        LrDecayStyle::Linear => OptimDecay::Linear,
        LrDecayStyle::Cosine => OptimDecay::Cosine,
        LrDecayStyle::InverseSquareRoot => OptimDecay::InverseSquareRoot,
        LrDecayStyle::Wsd => {
            return Err(RunError::Config(
                "not supported yet: optimizer.lr_decay_style = \"WSD\"".into(),
            ));
        }
    })
}

/// The trainer of this rank: its slice of `model` ([`parallelize`]) in its data-parallel
/// group (distributed optimizer, overlapped reductions, bf16 reduction as `[parallel]`
/// says), running its pipeline stage with the other stages when `pp > 1`. Collective.
fn build_trainer(
    rc: &RunConfig,
    model: GptModel,
    groups: &ProcessGroups,
    opts: TrainerOptions,
) -> Result<Trainer, RunError> {
    let par = &rc.resolved.parallel;
    let layout = ParallelizeOptions {
        sequence_parallel: par.sequence_parallel,
        make_vocab_size_divisible_by: rc.resolved.model.make_vocab_size_divisible_by,
        decoder_first_pipeline_num_layers: par.decoder_first_pipeline_num_layers,
        expert_tensor_parallel: match par.expert_tensor_parallel_size {
            Some(1) if par.tensor_model_parallel_size > 1 => ExpertTensorParallel::Whole,
            _ => ExpertTensorParallel::Split,
        },
        cp_comm_type: rc.cp_comm_type,
    };
    let model = parallelize(Cow::Owned(model), groups, &layout)?;
    // Gradients (and the distributed optimizer's shards) span data x context parallelism
    // (Megatron's `get_data_parallel_group(with_context_parallel=True)`).
    let group = groups.data_context.clone();
    let mut dp = DataParallel::new(group, par.use_distributed_optimizer)
        .with_sharding_strategy(rc.sharding)?;
    if par.overlap_grad_reduce {
        dp = dp.with_overlap_grad_reduce()?;
    }
    if par.overlap_param_gather {
        dp = dp.with_overlap_param_gather()?;
    }
    if !par.grad_reduce_in_fp32 {
        dp = dp.with_bf16_grad_reduce();
    }
    let dp = dp.with_expert_parallel(groups.expert_data.clone(), groups.expert.clone())?;
    let mut trainer = Trainer::new_data_parallel(model, opts, dp)?;
    if par.pipeline_model_parallel_size > 1 {
        let pp = PipelineParallel::new(groups.pipeline.clone(), groups.embedding.clone());
        trainer.set_pipeline(pp)?;
    }
    Ok(trainer)
}

/// This rank's loaders (Megatron's `MegatronPretrainingSampler` over its data-parallel
/// share) from the samples the trainer has consumed: training, and validation when
/// `has_valid` and the split has a validation part.
fn loaders(
    rc: &RunConfig,
    trainer: &Trainer,
    data: RunData,
    has_valid: bool,
) -> Result<(DataLoader, Option<DataLoader>), RunError> {
    let mbs = rc.resolved.training.micro_batch_size * rc.rows_per_sample();
    let (dp_rank, dp_size) = trainer.data_shard();
    let config = |prefetch, consumed: u64| {
        let mut c = LoaderConfig::new(mbs, dp_rank, dp_size, consumed as usize);
        c.prefetch = prefetch;
        c
    };
    let prefetch = rc.resolved.data.prefetch;
    let train = DataLoader::new(data.train, &config(prefetch, trainer.consumed_samples()))?;
    let valid = match (data.valid, has_valid) {
        (Some(v), true) => Some(DataLoader::new(
            v,
            &config(1, trainer.consumed_valid_samples()),
        )?),
        _ => None,
    };
    Ok((train, valid))
}

/// `OUTPUT/metrics.jsonl` on the logging rank (appended to by a resumed run: `iteration >
/// 0`), a sink on the others.
fn open_metrics(
    rc: &RunConfig,
    lead: bool,
    iteration: u64,
) -> Result<(Box<dyn Write>, PathBuf), RunError> {
    let path = rc.resolved.logging.output_dir.join("metrics.jsonl");
    if !lead {
        return Ok((Box::new(std::io::sink()), path));
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(iteration > 0)
        .truncate(iteration == 0)
        .open(&path)
        .with_context(|| format!("creating {}", path.display()))?;
    Ok((Box::new(BufWriter::new(file)), path))
}

/// The next `micro_per_eval` validation micro-batches of this rank.
///
/// # Errors
/// A read error, or the validation data ran out.
fn validation_batches(
    loader: &mut DataLoader,
    micro_per_eval: usize,
) -> Result<Vec<MicroBatch>, TrainError> {
    let batches = loader
        .by_ref()
        .take(micro_per_eval)
        .collect::<Result<Vec<_>, _>>()?;
    if batches.len() < micro_per_eval {
        return Err(TrainError::Config(format!(
            "the validation data ran out ({} of {micro_per_eval} micro-batches)",
            batches.len()
        )));
    }
    Ok(batches)
}
