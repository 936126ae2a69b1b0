//! A checkpoint (converted or saved by training, any layout) -> the same model's weights as a
//! checkpoint laid out for another tensor x pipeline-parallel size (Megatron's checkpoint
//! resharding tools): the source is read through HF names ([`CheckpointWeights`]) and written
//! as `hf_to_ckpt` writes, one parameter at a time. Weights only: optimizer state reshards on
//! load anyway (every layout reads any other's boxes).

use std::path::Path;

use ferrotron_tensor::DType;

use super::hf_to_ckpt::{LayoutExtras, plan_layout, write_layout};
use super::{CheckpointWeights, ConvertReport, HfToCkptOptions, HfToCkptPlan};
use crate::CheckpointError;

/// The plan of [`reshard_ckpt`] (for a dry run): reads the checkpoint's metadata only.
///
/// # Errors
/// No checkpoint at `ckpt`, one without an HF config, or a layout the model cannot take.
pub fn plan_reshard(ckpt: &Path, opts: &HfToCkptOptions) -> Result<HfToCkptPlan, CheckpointError> {
    plan_for(&CheckpointWeights::open(ckpt, DType::F32)?, opts)
}

fn plan_for(
    weights: &CheckpointWeights,
    opts: &HfToCkptOptions,
) -> Result<HfToCkptPlan, CheckpointError> {
    plan_layout(
        weights.dir(),
        weights.info().config.clone(),
        weights.hf_config().clone(),
        weights.hf_tensors().into_iter().collect(),
        opts,
    )
}

/// Writes the weights of checkpoint `ckpt` (an iteration directory or a save directory) as a
/// new checkpoint at `output` laid out for `opts` (`output/iter_0000000`, a weights-only
/// checkpoint like `hf_to_ckpt`'s), with its HF config, generation config and tokenizer.
/// Staged and renamed at the end; memory: one parameter plus the pages being read.
///
/// # Errors
/// As [`plan_reshard`]; an existing non-empty `output` without `opts.force`; I/O failures.
pub fn reshard_ckpt(
    ckpt: &Path,
    output: &Path,
    opts: &HfToCkptOptions,
) -> Result<ConvertReport, CheckpointError> {
    let start = std::time::Instant::now();
    let mut weights = CheckpointWeights::open(ckpt, DType::F32)?;
    let plan = plan_for(&weights, opts)?;
    let dir = weights.dir().to_path_buf();
    let extras = LayoutExtras {
        origin: &dir,
        generation_config: weights.generation_config().cloned(),
        tokenizer_dir: weights.tokenizer_dir(),
    };
    write_layout(&plan, &mut weights, &extras, output, opts, start)
}
