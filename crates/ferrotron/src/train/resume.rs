//! `checkpoint.load` (Megatron `--load` / `--finetune`): find the checkpoint to start from and
//! restore the trainer from it.

use anyhow::{Context, Result, bail};
use ferrotron_checkpoint::dist::{METADATA_FILE, iteration_dir, read_tracker};
use ferrotron_train::trainer::{LoadMode, Trainer};
use std::path::{Path, PathBuf};

/// The iteration directory `load` names: the one its tracker file points at, or `load`
/// itself when it is an iteration directory. `None` when `load` holds no checkpoint.
fn locate(load: &Path) -> Result<Option<PathBuf>> {
    if load.join(METADATA_FILE).is_file() {
        return Ok(Some(load.to_path_buf()));
    }
    match read_tracker(load).with_context(|| format!("checkpoint.load {}", load.display()))? {
        Some(it) => {
            let dir = iteration_dir(load, it);
            if !dir.join(METADATA_FILE).is_file() {
                bail!(
                    "checkpoint.load {}: the tracker names iteration {it} but {} is not a complete checkpoint",
                    load.display(),
                    dir.display()
                );
            }
            Ok(Some(dir))
        }
        None => Ok(None),
    }
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
