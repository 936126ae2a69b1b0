//! `checkpoint.load` (Megatron `--load` / `--finetune`): find the checkpoint to start from and
//! restore the trainer from it.

use super::{Context, NoteSink, RunError, RunNote};
use crate::trainer::{LoadMode, Trainer};
use ferrotron_checkpoint::dist::{METADATA_FILE, locate_checkpoint};
use std::path::Path;

/// Restores `trainer` from `load`: everything (resume) or, with `finetune`, the weights only.
/// Without a checkpoint there, a resume starts from scratch (as Megatron, with a note) and a
/// finetune is an error. `notes` hears which it was.
///
/// # Errors
/// An unreadable `checkpoint.load`, a finetune without a checkpoint, or a checkpoint the
/// trainer cannot load (named).
pub(super) fn load(
    trainer: &mut Trainer,
    load: &Path,
    finetune: bool,
    notes: &mut NoteSink<'_>,
) -> Result<(), RunError> {
    let located =
        locate_checkpoint(load).with_context(|| format!("checkpoint.load {}", load.display()))?;
    let Some(dir) = located else {
        if finetune {
            return Err(RunError::Config(format!(
                "checkpoint.load {}: no checkpoint (no {METADATA_FILE} and no latest_checkpointed_iteration.txt) to finetune from",
                load.display()
            )));
        }
        notes(&RunNote::NoCheckpoint {
            load: load.to_path_buf(),
        });
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
    notes(&RunNote::CheckpointLoaded {
        dir,
        iteration: state.iteration,
        finetune,
    });
    Ok(())
}
