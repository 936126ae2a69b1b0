//! `checkpoint.load` (Megatron `--load` / `--finetune`): find the checkpoint to start from and
//! restore the trainer from it.

use anyhow::{Context, Result, bail};
use ferrotron_checkpoint::dist::{METADATA_FILE, locate_checkpoint};
use ferrotron_train::trainer::{LoadMode, Trainer};
use std::path::{Path, PathBuf};

/// The iteration directory `load` names, `None` when `load` holds no checkpoint.
fn locate(load: &Path) -> Result<Option<PathBuf>> {
    locate_checkpoint(load).with_context(|| format!("checkpoint.load {}", load.display()))
}

/// Restores `trainer` from `load`: everything (resume) or, with `finetune`, the weights only.
/// Without a checkpoint there, a resume starts from scratch (as Megatron, with a note) and a
/// finetune is an error.
pub fn load(trainer: &mut Trainer, load: &Path, finetune: bool) -> Result<()> {
    let Some(dir) = locate(load)? else {
        if finetune {
            bail!(
                "checkpoint.load {}: no checkpoint (no {METADATA_FILE} and no latest_checkpointed_iteration.txt) to finetune from",
                load.display()
            );
        }
        eprintln!(
            "note: no checkpoint found in checkpoint.load {}: training from scratch",
            load.display()
        );
        return Ok(());
    };
    let mode = if finetune {
        LoadMode::Finetune
    } else {
        LoadMode::Resume
    };
    let state = trainer
        .load_checkpoint(&dir, mode)
        .with_context(|| format!("loading checkpoint {}", dir.display()))?;
    eprintln!(
        " successfully loaded checkpoint from {} at iteration {}{}",
        dir.display(),
        state.iteration,
        if finetune {
            " (weights only: --finetune)"
        } else {
            ""
        }
    );
    Ok(())
}
