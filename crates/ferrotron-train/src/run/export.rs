//! What a run writes besides the metrics: the checkpoints' extra content (the run config,
//! the model's HF config and generation config, the tokenizer files: every checkpoint is
//! enough for `convert ckpt-to-hf` and `model.load` alone) and the HF export of the trained
//! model (`checkpoint.export_hf`), gathered over tensor and pipeline parallelism onto the
//! logging rank.

use super::{Context, NoteSink, RunError, RunNote};
use crate::config::{Precision, RunConfig};
use crate::trainer::{NamedParams, SavePlan, Trainer};
use ferrotron_checkpoint::convert::TOKENIZER_SUBDIR;
use ferrotron_checkpoint::{
    HfExportOptions, HfExportSource, OutputDtype, export_hf, tokenizer_files, write_peft_adapter,
};
use ferrotron_model::GptModel;
use ferrotron_model::families::hf_config_json;
use ferrotron_tensor::DType;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// `checkpoint.save` as the trainer's [`SavePlan`] (`None` without it); every checkpoint
/// carries the run config, `full`'s HF config (weights of `dtype`), the generation config
/// and the tokenizer files of `tokenizer`.
///
/// # Errors
/// The model's config has no HF form.
pub(super) fn save_plan(
    rc: &RunConfig,
    full: &GptModel,
    source: &HfExportSource,
    dtype: DType,
    tokenizer: Option<&Path>,
) -> Result<Option<SavePlan>, RunError> {
    let hf_config = hf_config_json(full.config(), &source.config, dtype)
        .context("the model's HF config.json")?;
    let extra = serde_json::json!({
        "run_config": rc.to_toml(),
        "hf_config": hf_config,
        "generation_config": source.generation_config,
    });
    let files = tokenizer
        .map(checkpoint_tokenizer_files)
        .unwrap_or_default();
    let ck = &rc.resolved.checkpoint;
    Ok(ck.save.as_ref().map(|save| SavePlan {
        dir: save.clone(),
        interval: ck.save_interval,
        keep_last: ck.keep_last.unwrap_or(0),
        extra,
        files,
    }))
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

/// What the exports at the end of a run need: the HF export (`checkpoint.export_hf`) and,
/// for a LoRA run, the PEFT adapter (`checkpoint.export_peft`).
pub(super) struct ExportPlan {
    /// The trained model is split over ranks (tensor or pipeline parallelism): its weights
    /// are gathered for the export.
    pub split: bool,
    /// `checkpoint.export_hf`.
    hf_dir: Option<PathBuf>,
    /// `checkpoint.export_peft`.
    peft_dir: Option<PathBuf>,
    /// The logging rank's copy of the full model's structure to load the gathered weights
    /// into (only when split and exporting).
    full_model: Option<GptModel>,
    /// `config.json` token ids and extra fields.
    source: HfExportSource,
    /// Where the tokenizer files to copy along are.
    tokenizer_dir: Option<PathBuf>,
}

impl ExportPlan {
    /// The plan of `rc` for the full model `full` (before it is split); `lead`: this is
    /// the logging rank.
    pub fn new(
        rc: &RunConfig,
        lead: bool,
        full: &GptModel,
        source: HfExportSource,
        tokenizer_dir: Option<PathBuf>,
    ) -> Self {
        let par = &rc.resolved.parallel;
        let split = par.tensor_model_parallel_size > 1 || par.pipeline_model_parallel_size > 1;
        let ck = &rc.resolved.checkpoint;
        let exporting = ck.export_hf.is_some() || ck.export_peft.is_some();
        ExportPlan {
            split,
            hf_dir: ck.export_hf.clone(),
            peft_dir: ck.export_peft.clone(),
            full_model: (lead && split && exporting).then(|| full.clone()),
            source,
            tokenizer_dir,
        }
    }

    /// Whether the run exports anything.
    pub fn exporting(&self) -> bool {
        self.hf_dir.is_some() || self.peft_dir.is_some()
    }

    /// Exports the trained model: `full_params` (gathered from every rank) loaded into the
    /// full model's structure when the model is split, the trainer's model otherwise; a
    /// LoRA model's adapters as a PEFT directory and merged into the HF export. `notes`
    /// hears what was written.
    ///
    /// # Errors
    /// A parameter missing from `full_params`, or a failed export (naming
    /// `checkpoint.export_hf` or `checkpoint.export_peft`).
    pub fn export(
        self,
        trainer: Trainer,
        full_params: Option<NamedParams>,
        rc: &RunConfig,
        notes: &mut NoteSink<'_>,
    ) -> Result<(), RunError> {
        let model = match (self.full_model, full_params) {
            (Some(mut full), Some(named)) => {
                let by_name: HashMap<String, Vec<f32>> = named.into_iter().collect();
                let values = full
                    .parameters()
                    .iter()
                    .map(|p| {
                        by_name.get(&p.name).cloned().ok_or_else(|| {
                            RunError::Config(format!(
                                "export: parameter {} was not gathered",
                                p.name
                            ))
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let views: Vec<&[f32]> = values.iter().map(Vec::as_slice).collect();
                full.load_parameters_from(&views)?;
                full
            }
            _ => trainer.into_model(),
        };
        if let Some(dir) = &self.peft_dir {
            let base = rc
                .resolved
                .model
                .load
                .as_ref()
                .map(|p| p.display().to_string());
            let context = || format!("checkpoint.export_peft {}", dir.display());
            let bytes = write_peft_adapter(&model, dir, &base.unwrap_or_default(), true)
                .with_context(context)?;
            notes(&RunNote::ExportedAdapter {
                dir: dir.clone(),
                bytes,
            });
        }
        let Some(dir) = &self.hf_dir else {
            return Ok(());
        };
        let model = match model.config().lora {
            Some(_) => model
                .merge_lora()
                .context("merging the LoRA adapters for checkpoint.export_hf")?,
            None => model,
        };
        export(&model, &self.source, self.tokenizer_dir, dir, rc, notes)
    }
}

/// `checkpoint.export_hf`: the trained model as an HF directory (weights in the run's
/// precision, f32 for fp32 runs), tokenizer files copied along.
fn export(
    model: &GptModel,
    source: &HfExportSource,
    tokenizer_dir: Option<PathBuf>,
    dir: &Path,
    rc: &RunConfig,
    notes: &mut NoteSink<'_>,
) -> Result<(), RunError> {
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
    notes(&RunNote::Exported {
        dir: report.output,
        tensors: report.tensors_written,
        bytes: report.bytes_written,
    });
    Ok(())
}
