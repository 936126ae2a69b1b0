//! Distributed (sharded) training checkpoints, the on-disk format of `docs/checkpoint-format.md`.
//!
//! A `save` directory holds one directory per saved iteration plus Megatron's tracker file:
//!
//! ```text
//! save/
//!   latest_checkpointed_iteration.txt   "100\n", replaced atomically after each save
//!   iter_0000050/  iter_0000100/        one per kept iteration
//!     metadata.json                     format, version, layout, tensor -> shards, content
//!     model_rank00000.safetensors ...   the shards, one file per rank and kind
//! ```
//!
//! Every tensor is stored as non-overlapping shards, each recorded with the tensor's key, its
//! global shape and the shard's global offset and local shape (Megatron
//! `megatron/core/dist_checkpointing`'s `ShardedTensor`), so a checkpoint saved under one
//! parallel layout loads under any other by reading other boxes ([`CheckpointReader::read_box`]).
//!
//! | here | mirrors (Megatron-LM) |
//! |---|---|
//! | [`iteration_dir`] | `get_checkpoint_name` (`iter_{:07d}`) |
//! | [`read_tracker`], [`write_tracker`] | `read_metadata` / the tracker file of `save_checkpoint` |
//! | [`prune_checkpoints`] | keeping the last K checkpoints (`--ckpt-keep-last`-style retention) |

mod metadata;
mod read;
mod write;

pub use metadata::{
    CheckpointMetadata, FORMAT_NAME, FORMAT_VERSION, METADATA_FILE, ParallelLayout, ShardRecord,
    StoredDtype, TensorRecord,
};
pub use read::CheckpointReader;
pub use write::{CheckpointWriter, ShardFile, ShardSpec, ShardedTensor, TensorRecords};

use crate::CheckpointError;
use std::path::{Path, PathBuf};

/// Megatron's tracker file name inside a `save` directory.
pub const TRACKER_FILE: &str = "latest_checkpointed_iteration.txt";

/// `save/iter_0000100` for iteration 100 (seven digits, as Megatron).
pub fn iteration_dir(save: &Path, iteration: u64) -> PathBuf {
    save.join(format!("iter_{iteration:07}"))
}

/// The iteration in `save/latest_checkpointed_iteration.txt`, `None` when the file does not
/// exist.
///
/// # Errors
/// The file exists but cannot be read or does not hold an iteration number.
pub fn read_tracker(save: &Path) -> Result<Option<u64>, CheckpointError> {
    let path = save.join(TRACKER_FILE);
    match std::fs::read_to_string(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(CheckpointError::io(&path, e)),
        Ok(text) => text
            .trim()
            .parse::<u64>()
            .map(Some)
            .map_err(|_| CheckpointError::Format {
                file: path.display().to_string(),
                detail: format!("holds `{}`, expected an iteration number", text.trim()),
            }),
    }
}

/// Points the tracker at `iteration`: writes a temp file, fsyncs it and renames it over the
/// tracker, so a reader sees the old or the new number, never a partial one.
///
/// # Errors
/// An I/O failure (the previous tracker is then unchanged).
pub fn write_tracker(save: &Path, iteration: u64) -> Result<(), CheckpointError> {
    let path = save.join(TRACKER_FILE);
    let tmp = save.join(format!(".{TRACKER_FILE}.tmp-{}", std::process::id()));
    let io = |p: &Path, e| CheckpointError::io(p, e);
    {
        let mut f = std::fs::File::create(&tmp).map_err(|e| io(&tmp, e))?;
        std::io::Write::write_all(&mut f, format!("{iteration}\n").as_bytes())
            .map_err(|e| io(&tmp, e))?;
        f.sync_all().map_err(|e| io(&tmp, e))?;
    }
    std::fs::rename(&tmp, &path).map_err(|e| io(&path, e))?;
    if let Ok(dir) = std::fs::File::open(save) {
        // Make the rename durable; not every platform can fsync a directory.
        let _ = dir.sync_all();
    }
    Ok(())
}

/// The iteration directory `path` names: `path` itself when it holds a `metadata.json`, or
/// the one its tracker file points at (a `save` directory). `None` when `path` holds neither.
///
/// # Errors
/// An unreadable tracker, or a tracker naming an iteration that is not a complete checkpoint.
pub fn locate_checkpoint(path: &Path) -> Result<Option<PathBuf>, CheckpointError> {
    if path.join(METADATA_FILE).is_file() {
        return Ok(Some(path.to_path_buf()));
    }
    match read_tracker(path)? {
        Some(it) => {
            let dir = iteration_dir(path, it);
            if !dir.join(METADATA_FILE).is_file() {
                return Err(CheckpointError::Format {
                    file: path.join(TRACKER_FILE).display().to_string(),
                    detail: format!(
                        "names iteration {it} but {} is not a complete checkpoint",
                        dir.display()
                    ),
                });
            }
            Ok(Some(dir))
        }
        None => Ok(None),
    }
}

/// The iterations of the `iter_NNNNNNN` directories under `save` that hold a
/// `metadata.json` (complete checkpoints), ascending.
///
/// # Errors
/// `save` cannot be listed.
pub fn list_checkpoints(save: &Path) -> Result<Vec<u64>, CheckpointError> {
    let mut out = Vec::new();
    let entries = std::fs::read_dir(save).map_err(|e| CheckpointError::io(save, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| CheckpointError::io(save, e))?;
        let name = entry.file_name();
        let Some(num) = name.to_str().and_then(|n| n.strip_prefix("iter_")) else {
            continue;
        };
        if let Ok(it) = num.parse::<u64>()
            && entry.path().join(METADATA_FILE).is_file()
        {
            out.push(it);
        }
    }
    out.sort_unstable();
    Ok(out)
}

/// Removes all but the newest `keep_last` complete checkpoints under `save` (never the one
/// the tracker names). Returns the removed iterations. `keep_last == 0` keeps everything.
///
/// # Errors
/// Listing or removing failed; checkpoints removed before the failure stay removed.
pub fn prune_checkpoints(save: &Path, keep_last: usize) -> Result<Vec<u64>, CheckpointError> {
    if keep_last == 0 {
        return Ok(Vec::new());
    }
    let all = list_checkpoints(save)?;
    let latest = read_tracker(save)?;
    let mut removed = Vec::new();
    for &it in all.iter().rev().skip(keep_last) {
        if Some(it) == latest {
            continue;
        }
        // Rename first so a kill mid-removal never leaves a half-deleted `iter_*` directory
        // that looks complete.
        let dir = iteration_dir(save, it);
        let doomed = save.join(format!(".iter_{it:07}.removing"));
        std::fs::rename(&dir, &doomed).map_err(|e| CheckpointError::io(&dir, e))?;
        std::fs::remove_dir_all(&doomed).map_err(|e| CheckpointError::io(&doomed, e))?;
        removed.push(it);
    }
    removed.reverse();
    Ok(removed)
}
