//! One rank of a `train` run: builds its model replica, the datasets and its data-parallel
//! share of the loader, trains, and — on the logging rank (world rank 0) only — writes the
//! run directory, metrics, log lines, plots and the HF export.

use super::launch::RankContext;
use super::{data, decay_style, model, observer::RunObserver, resume};
use anyhow::{Context, Result, bail};
use ferrotron_checkpoint::convert::TOKENIZER_SUBDIR;
use ferrotron_checkpoint::{
    HfExportOptions, HfExportSource, OutputDtype, export_hf, tokenizer_files,
};
use ferrotron_data::{DataLoader, LoaderConfig, MicroBatch};
use ferrotron_model::GptModel;
use ferrotron_model::families::hf_config_json;
use ferrotron_optim::DynamicGradScalerConfig;
use ferrotron_train::config::{Precision, RunConfig};
use ferrotron_train::trainer::{
    DataParallel, EvalLine, PipelineParallel, SavePlan, TrainError, TrainLog, Trainer,
    TrainerOptions,
};
use ferrotron_train::{ParallelizeOptions, parallelize};
use model::RunModel;
use std::borrow::Cow;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Trains `rc` as `rank`.
pub fn run_rank(rc: &RunConfig, rank: &RankContext) -> Result<ExitCode> {
    let r = &rc.resolved;
    let out_dir = &r.logging.output_dir;
    let lead = rank.is_logging_rank();
    if lead {
        std::fs::create_dir_all(out_dir)
            .with_context(|| format!("creating logging.output_dir {}", out_dir.display()))?;
        std::fs::write(out_dir.join("run.toml"), rc.to_toml())
            .with_context(|| format!("writing {}", out_dir.join("run.toml").display()))?;
    }

    let run_model = model::build(rc)?;
    let eod = run_model.eod;
    if eod.is_none()
        && (r.data.eod_mask_loss || r.data.reset_position_ids || r.data.reset_attention_mask)
    {
        bail!(
            "data.eod_mask_loss / reset_position_ids / reset_attention_mask need an end-of-document id: \
             give model.load an HF directory whose config.json has eos_token_id, or set data.tokenizer_model"
        );
    }

    let mbs = r.training.micro_batch_size;
    let gbs = rc.global_batch_size;
    let iters = rc.train_iters;
    let eval_iters = r.training.eval_iters as usize;
    let eval_interval = r.training.eval_interval;
    // Megatron's sizes: every train sample, and eval_iters global batches per evaluation
    // (train_iters / eval_interval of them plus the final one).
    let evals = iters.checked_div(eval_interval).map_or(0, |n| n + 1);
    let valid_samples = eval_iters * gbs * evals as usize;
    // Rank 0 builds the dataset index caches first; the others then read them.
    let build_data = || {
        data::build(
            rc,
            [gbs * iters as usize, valid_samples],
            eod,
            run_model.tokenizer_dir.as_deref(),
        )
    };
    let data = rank.first_then_others(build_data)?;
    if lead && data.valid.is_none() && eval_interval > 0 && eval_iters > 0 {
        eprintln!(
            "note: data.split `{}` has no validation part: no validation",
            r.data.split
        );
    }

    let par = &r.parallel;
    let opts = TrainerOptions {
        micro_batch_size: mbs,
        global_batch_size: gbs,
        data_parallel_size: rc.data_parallel_size,
        ddp_bucket_size: par.ddp_bucket_size,
        train_iters: iters,
        log_interval: r.training.log_interval,
        // eval_iters = 0 turns validation off (Megatron skips evaluate then).
        eval_interval: if data.valid.is_some() && eval_iters > 0 {
            eval_interval
        } else {
            0
        },
        eval_iters,
        lr: rc.lr,
        min_lr: r.optimizer.min_lr,
        lr_warmup_iters: rc.lr_warmup_iters,
        lr_decay_iters: Some(rc.lr_decay_iters),
        lr_decay_style: decay_style(rc.lr_decay_style)?,
        weight_decay: r.optimizer.weight_decay,
        adam_beta1: r.optimizer.adam_beta1,
        adam_beta2: r.optimizer.adam_beta2,
        adam_eps: r.optimizer.adam_eps,
        clip_grad: r.optimizer.clip_grad,
        precision: model::precision(rc).0,
        loss_scale: r.precision.loss_scale.map(|x| x as f32),
        dynamic_loss_scale: DynamicGradScalerConfig {
            initial_scale: r.precision.initial_loss_scale as f32,
            min_scale: r.precision.min_loss_scale as f32,
            growth_interval: r.precision.loss_scale_window as u32,
            hysteresis: r.precision.hysteresis as u32,
            ..DynamicGradScalerConfig::default()
        },
        exit_interval: r.training.exit_interval,
        seed: r.training.seed,
    };
    let micro_per_eval = eval_iters * opts.num_microbatches();
    let has_valid = opts.eval_interval > 0;
    let RunModel {
        model,
        tokenizer_dir,
        export_source,
        ..
    } = run_model;
    // Every checkpoint carries the model's HF config and tokenizer, so `convert ckpt-to-hf`
    // and `model.load` work on it alone.
    let hf_config = hf_config_json(
        model.config(),
        &export_source.config,
        model::precision(rc).1,
    )
    .context("the model's HF config.json")?;
    let checkpoint_extra = serde_json::json!({
        "run_config": rc.to_toml(),
        "hf_config": hf_config,
        "generation_config": export_source.generation_config,
    });
    let checkpoint_files = tokenizer_dir
        .as_deref()
        .map(checkpoint_tokenizer_files)
        .unwrap_or_default();
    // The logging rank keeps the full model's structure to export the gathered weights into
    // when the trained model is split over ranks.
    let split = par.tensor_model_parallel_size > 1 || par.pipeline_model_parallel_size > 1;
    let full_model = (lead && split && r.checkpoint.export_hf.is_some()).then(|| model.clone());
    // This rank's slice: its pipeline stage's layers (or model chunks under the interleaved
    // schedule), sharded over tensor parallelism.
    let pp = par.pipeline_model_parallel_size;
    let layout = ParallelizeOptions {
        sequence_parallel: par.sequence_parallel,
        make_vocab_size_divisible_by: r.model.make_vocab_size_divisible_by,
        decoder_first_pipeline_num_layers: par.decoder_first_pipeline_num_layers,
    };
    let model = parallelize(Cow::Owned(model), &rank.groups, &layout)?;
    let mut dp = DataParallel::new(rank.groups.data.clone(), par.use_distributed_optimizer);
    if par.overlap_grad_reduce {
        dp = dp.with_overlap_grad_reduce()?;
    }
    if par.overlap_param_gather {
        dp = dp.with_overlap_param_gather()?;
    }
    if !par.grad_reduce_in_fp32 {
        dp = dp.with_bf16_grad_reduce();
    }
    let (dp_rank, dp_size) = (dp.rank(), dp.size());
    let mut trainer = Trainer::new_data_parallel(model, opts, dp)?;
    if pp > 1 {
        let groups = &rank.groups;
        trainer.set_pipeline(PipelineParallel::new(
            groups.pipeline.clone(),
            groups.embedding.clone(),
        ))?;
    }
    if let Some(load) = &r.checkpoint.load {
        resume::load(&mut trainer, load, r.training.finetune)?;
    }
    if let Some(save) = &r.checkpoint.save {
        trainer.set_save_plan(Some(SavePlan {
            dir: save.clone(),
            interval: r.checkpoint.save_interval,
            keep_last: r.checkpoint.keep_last.unwrap_or(0),
            extra: checkpoint_extra,
            files: checkpoint_files,
        }));
    }
    let loader_cfg = |prefetch, consumed: u64| {
        let mut c = LoaderConfig::new(mbs, dp_rank, dp_size, consumed as usize);
        c.prefetch = prefetch;
        c
    };
    let mut loader = DataLoader::new(
        data.train,
        &loader_cfg(r.data.prefetch, trainer.consumed_samples()),
    )?;
    let mut valid_loader = match (data.valid, has_valid) {
        (Some(v), true) => Some(DataLoader::new(
            v,
            &loader_cfg(1, trainer.consumed_valid_samples()),
        )?),
        _ => None,
    };

    // A resumed run appends to the metrics of the run it continues.
    // Only the logging rank writes metrics, log lines and plots.
    let metrics_path = out_dir.join("metrics.jsonl");
    let mut metrics: Box<dyn Write> = if lead {
        let metrics_file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(trainer.iteration() > 0)
            .truncate(trainer.iteration() == 0)
            .open(&metrics_path)
            .with_context(|| format!("creating {}", metrics_path.display()))?;
        Box::new(BufWriter::new(metrics_file))
    } else {
        Box::new(std::io::sink())
    };
    let mut provider = || -> std::result::Result<Vec<MicroBatch>, TrainError> {
        let loader = valid_loader.as_mut().expect("validation configured");
        let batches = loader
            .by_ref()
            .take(micro_per_eval)
            .collect::<std::result::Result<Vec<_>, _>>()?;
        if batches.len() < micro_per_eval {
            return Err(TrainError::Config(format!(
                "the validation data ran out ({} of {micro_per_eval} micro-batches)",
                batches.len()
            )));
        }
        Ok(batches)
    };
    if r.training.skip_train {
        if !has_valid {
            bail!(
                "training.skip_train needs validation data: training.eval_iters > 0, training.eval_interval > 0 and a data.split with a validation part"
            );
        }
        let line = TrainLog::Valid(EvalLine::new(
            trainer.iteration(),
            trainer.evaluate(&provider()?)?,
        ));
        if lead {
            println!("{line}");
        }
        writeln!(metrics, "{}", serde_json::to_string(&line)?)?;
        metrics.flush()?;
        return Ok(ExitCode::SUCCESS);
    }
    let valid_arg: Option<&mut dyn FnMut() -> std::result::Result<Vec<MicroBatch>, TrainError>> =
        if has_valid { Some(&mut provider) } else { None };
    // Model, optimizer and data are in place: from here on, steps reuse the memory the last
    // one freed instead of faulting it in again.
    ferrotron_train::allocator::retain_freed_memory();
    let summary = if lead {
        let mut observer =
            RunObserver::new(out_dir, r.logging.tensorboard, trainer.iteration(), iters)?;
        let summary = trainer.train(&mut loader, valid_arg, &mut metrics, &mut observer);
        observer.finish();
        summary?
    } else {
        trainer.train(&mut loader, valid_arg, &mut metrics, &mut |_: &TrainLog| {})?
    };
    let export_dir = r
        .checkpoint
        .export_hf
        .as_ref()
        .filter(|_| !summary.exited_early);
    // The full weights for the export, gathered over tensor and pipeline parallelism
    // (collective; the logging rank gets them).
    let full_params = match export_dir {
        Some(_) if split => trainer.gather_model_parameters()?,
        _ => None,
    };
    if !lead {
        return Ok(ExitCode::SUCCESS);
    }
    if summary.exited_early {
        eprintln!(
            "exiting at iteration {} (training.exit_interval); resume with checkpoint.load",
            summary.iterations
        );
    }
    if summary.data_exhausted {
        eprintln!(
            "warning: the training data ran out after {} of {iters} iterations",
            summary.iterations
        );
    }
    eprintln!(
        "done: {} iterations, {} samples; metrics in {}, loss curve in {}",
        summary.iterations,
        summary.consumed_samples,
        metrics_path.display(),
        out_dir.join("loss.png").display()
    );
    if let Some(dir) = export_dir {
        let model = match (full_model, full_params) {
            (Some(mut full), Some(named)) => {
                let by_name: std::collections::HashMap<String, Vec<f32>> =
                    named.into_iter().collect();
                let values = full
                    .parameters()
                    .iter()
                    .map(|p| {
                        by_name.get(&p.name).cloned().ok_or_else(|| {
                            anyhow::anyhow!("export: parameter {} was not gathered", p.name)
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                let views: Vec<&[f32]> = values.iter().map(Vec::as_slice).collect();
                full.load_parameters_from(&views)?;
                full
            }
            _ => trainer.into_model(),
        };
        export(&model, &export_source, tokenizer_dir, dir, rc)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `checkpoint.export_hf`: the trained model as an HF directory (weights in the run's
/// precision, f32 for fp32 runs), tokenizer files copied along.
fn export(
    model: &GptModel,
    source: &HfExportSource,
    tokenizer_dir: Option<PathBuf>,
    dir: &Path,
    rc: &RunConfig,
) -> Result<()> {
    let dtype = match rc.precision {
        Precision::Fp32 => OutputDtype::F32,
        Precision::Bf16 => OutputDtype::BF16,
        Precision::Fp16 => OutputDtype::F16,
    };
    let opts = HfExportOptions {
        dtype,
        force: true,
        tokenizer_dir: tokenizer_dir.filter(|d| !tokenizer_files(d).is_empty()),
        ..HfExportOptions::default()
    };
    let report = export_hf(model, source, dir, &opts)
        .with_context(|| format!("checkpoint.export_hf {}", dir.display()))?;
    eprintln!(
        "exported the trained model to {} ({} tensors, {:.1} MB)",
        report.output.display(),
        report.tensors_written,
        report.bytes_written as f64 / 1e6
    );
    Ok(())
}

/// The tokenizer files of `tokenizer` (a directory, or a `tokenizer.json` file) as
/// (name inside a checkpoint, source) pairs.
fn checkpoint_tokenizer_files(tokenizer: &Path) -> Vec<(String, PathBuf)> {
    let named = |p: PathBuf| {
        let name = p.file_name()?.to_string_lossy().into_owned();
        Some((format!("{TOKENIZER_SUBDIR}/{name}"), p))
    };
    if tokenizer.is_file() {
        return named(tokenizer.to_path_buf()).into_iter().collect();
    }
    tokenizer_files(tokenizer)
        .into_iter()
        .filter_map(named)
        .collect()
}
