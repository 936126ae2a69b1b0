//! All-or-nothing output directories: files are written into `.<name>.tmp-<pid>` beside the
//! output and the directory is renamed into place only when everything succeeded. On an error
//! (or a panic) the staging directory is removed; after a kill it is left under its hidden name,
//! never under the output's name.

use std::fs;
use std::path::{Path, PathBuf};

use crate::CheckpointError;
use serde_json::Value;

/// Writes `v` as pretty JSON plus a newline to `dir/name` (transformers' layout for
/// `config.json` and friends); returns the bytes written.
pub(crate) fn write_json(dir: &Path, name: &str, v: &Value) -> Result<u64, CheckpointError> {
    let path = dir.join(name);
    let mut bytes = serde_json::to_vec_pretty(v).map_err(|e| CheckpointError::Format {
        file: name.to_string(),
        detail: format!("cannot serialize: {e}"),
    })?;
    bytes.push(b'\n');
    fs::write(&path, &bytes).map_err(|e| CheckpointError::io(&path, e))?;
    Ok(bytes.len() as u64)
}

/// A staging directory for `output`. Dropping it without [`StagingDir::commit`] removes it.
pub(crate) struct StagingDir {
    tmp: PathBuf,
    output: PathBuf,
    force: bool,
    committed: bool,
}

/// Whether `path` is an existing directory with no entries.
fn is_empty_dir(path: &Path) -> Result<bool, CheckpointError> {
    let mut it = fs::read_dir(path).map_err(|e| CheckpointError::io(path, e))?;
    Ok(it.next().is_none())
}

/// Checks that `output` may be written: absent, an empty directory, or (with `force`) any
/// directory.
pub(crate) fn check_output(output: &Path, force: bool) -> Result<(), CheckpointError> {
    match fs::symlink_metadata(output) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(CheckpointError::io(output, e)),
        Ok(m) if !m.is_dir() => Err(CheckpointError::OutputExists {
            path: output.to_path_buf(),
            detail: "exists and is not a directory".into(),
        }),
        Ok(_) if force || is_empty_dir(output)? => Ok(()),
        Ok(_) => Err(CheckpointError::OutputExists {
            path: output.to_path_buf(),
            detail: "exists and is not empty (pass force to replace it)".into(),
        }),
    }
}

impl StagingDir {
    /// Creates `.<name>.tmp-<pid>` in `output`'s parent (creating the parent if needed), after
    /// [`check_output`].
    pub(crate) fn create(output: &Path, force: bool) -> Result<StagingDir, CheckpointError> {
        let name = output
            .file_name()
            .map(|n| format!(".{}.tmp-{}", n.to_string_lossy(), std::process::id()))
            .unwrap_or_default();
        StagingDir::create_named(output, force, &name)
    }

    /// [`create`](Self::create) with the staging directory named `tmp_name` (beside
    /// `output`); an existing directory of that name (a stale staging directory) is removed.
    pub(crate) fn create_named(
        output: &Path,
        force: bool,
        tmp_name: &str,
    ) -> Result<StagingDir, CheckpointError> {
        check_output(output, force)?;
        output
            .file_name()
            .ok_or_else(|| CheckpointError::OutputExists {
                path: output.to_path_buf(),
                detail: "has no final component to name a directory".into(),
            })?;
        let parent = match output.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        fs::create_dir_all(&parent).map_err(|e| CheckpointError::io(&parent, e))?;
        let tmp = parent.join(tmp_name);
        if tmp.exists() {
            fs::remove_dir_all(&tmp).map_err(|e| CheckpointError::io(&tmp, e))?;
        }
        fs::create_dir(&tmp).map_err(|e| CheckpointError::io(&tmp, e))?;
        Ok(StagingDir {
            tmp,
            output: output.to_path_buf(),
            force,
            committed: false,
        })
    }

    /// The staging directory to write into.
    pub(crate) fn path(&self) -> &Path {
        &self.tmp
    }

    /// Moves the staging directory to the output path, replacing an empty directory there, or
    /// (with `force`) a non-empty one, which is first renamed aside and then deleted.
    pub(crate) fn commit(mut self) -> Result<(), CheckpointError> {
        check_output(&self.output, self.force)?;
        let mut old = None;
        if self.output.exists() {
            if is_empty_dir(&self.output)? {
                fs::remove_dir(&self.output).map_err(|e| CheckpointError::io(&self.output, e))?;
            } else {
                let aside = self.tmp.with_file_name(format!(
                    ".{}.old-{}",
                    self.output
                        .file_name()
                        .map(|n| n.to_string_lossy())
                        .unwrap_or_default(),
                    std::process::id()
                ));
                fs::rename(&self.output, &aside)
                    .map_err(|e| CheckpointError::io(&self.output, e))?;
                old = Some(aside);
            }
        }
        if let Err(e) = fs::rename(&self.tmp, &self.output) {
            if let Some(aside) = &old {
                // Put the previous output back; the staging dir is removed on drop.
                let _ = fs::rename(aside, &self.output);
            }
            return Err(CheckpointError::io(&self.output, e));
        }
        self.committed = true;
        if let Some(aside) = old {
            fs::remove_dir_all(&aside).map_err(|e| CheckpointError::io(&aside, e))?;
        }
        Ok(())
    }
}

impl Drop for StagingDir {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_dir_all(&self.tmp);
        }
    }
}
