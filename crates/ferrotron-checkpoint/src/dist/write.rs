//! [`CheckpointWriter`]: writes one iteration directory of a distributed checkpoint into a
//! staging directory, one safetensors file per [`CheckpointWriter::write_file`] or
//! [`CheckpointWriter::open_file`] (one per rank and kind, e.g. `model_rank00000.safetensors`),
//! then `metadata.json`, then renames the staging directory into place
//! ([`CheckpointWriter::commit`]). A kill at any point leaves no directory under the final name.
//!
//! Several ranks save in parallel: the committing rank opens the directory with
//! [`CheckpointWriter::create_shared`], the others (after a barrier) with
//! [`CheckpointWriter::join_shared`]; each writes its own files, sends its
//! [`CheckpointWriter::into_records`] to the committing rank, which merges them
//! ([`CheckpointWriter::merge_records`]) and commits.

use super::metadata::{
    CheckpointMetadata, FORMAT_NAME, FORMAT_VERSION, METADATA_FILE, ParallelLayout, ShardRecord,
    StoredDtype, TensorRecord, volume,
};
use crate::CheckpointError;
use crate::gguf::OutputDtype;
use crate::safetensors_writer::{SafetensorsStream, TensorSpec};
use crate::staging::StagingDir;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The box of one shard to save: `global_offset .. global_offset + local_shape` of the tensor
/// `key` of shape `global_shape`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardSpec {
    /// Checkpoint key.
    pub key: String,
    /// Shape of the whole tensor.
    pub global_shape: Vec<usize>,
    /// Offset of this shard in the whole tensor.
    pub global_offset: Vec<usize>,
    /// Shape of this shard.
    pub local_shape: Vec<usize>,
}

/// Every tensor's record by key: what one rank wrote, sent to the committing rank.
pub type TensorRecords = BTreeMap<String, TensorRecord>;

/// One shard to save: the box `global_offset .. global_offset + local_shape` of the tensor
/// `key` of shape `global_shape`, its values row-major in `data` (`volume(local_shape)` f32
/// values, rounded to the file's dtype on write).
#[derive(Clone, Debug)]
pub struct ShardedTensor<'a> {
    /// Checkpoint key, e.g. `model.decoder.layers.0.self_attention.linear_qkv.weight`.
    pub key: String,
    /// Shape of the whole tensor.
    pub global_shape: Vec<usize>,
    /// Offset of this shard in the whole tensor.
    pub global_offset: Vec<usize>,
    /// Shape of this shard.
    pub local_shape: Vec<usize>,
    /// 0 for the copy that is written; replicas (the same box held by other data-parallel
    /// ranks) pass their index and are skipped.
    pub replica_id: usize,
    /// The shard's values.
    pub data: &'a [f32],
}

impl<'a> ShardedTensor<'a> {
    /// A whole, unsharded tensor (one rank holds it all).
    pub fn full(key: impl Into<String>, shape: &[usize], data: &'a [f32]) -> ShardedTensor<'a> {
        ShardedTensor {
            key: key.into(),
            global_shape: shape.to_vec(),
            global_offset: vec![0; shape.len()],
            local_shape: shape.to_vec(),
            replica_id: 0,
            data,
        }
    }
}

/// Writes an iteration directory; see the module docs.
pub struct CheckpointWriter {
    /// The staging directory, owned by the committing rank (`None` on a joined rank).
    staging: Option<StagingDir>,
    /// Where this rank writes its files (the staging directory).
    dir: PathBuf,
    output: PathBuf,
    tensors: TensorRecords,
}

/// One safetensors file of shards being written by [`CheckpointWriter::open_file`]: push each
/// shard's values in the order of the specs, then [`ShardFile::finish`].
pub struct ShardFile {
    stream: SafetensorsStream,
}

impl ShardFile {
    /// Appends the next shard's values (`volume(local_shape)` f32 values, rounded to the
    /// file's dtype).
    ///
    /// # Errors
    /// A wrong value count, more shards than specs, or an I/O failure.
    pub fn push(&mut self, values: &[f32]) -> Result<(), CheckpointError> {
        self.stream.push(values)
    }

    /// Flushes and fsyncs the file; returns its size in bytes.
    ///
    /// # Errors
    /// Shards never pushed, or an I/O failure.
    pub fn finish(self) -> Result<u64, CheckpointError> {
        self.stream.finish()
    }
}

fn format_err(file: &Path, detail: String) -> CheckpointError {
    CheckpointError::Format {
        file: file.display().to_string(),
        detail,
    }
}

fn to_output_dtype(dtype: StoredDtype) -> OutputDtype {
    match dtype {
        StoredDtype::F32 => OutputDtype::F32,
        StoredDtype::BF16 => OutputDtype::BF16,
        StoredDtype::F16 => OutputDtype::F16,
    }
}

/// Name of the shared staging directory of `output` (`.iter_0000100.staging` beside it).
fn shared_staging_name(output: &Path) -> String {
    let name = output
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!(".{name}.staging")
}

/// Adds `record` (shards of `key` from one file or rank) to `tensors`, checking it has the
/// dtype and global shape recorded before.
fn add_record(
    tensors: &mut TensorRecords,
    key: &str,
    record: TensorRecord,
    path: &Path,
) -> Result<(), CheckpointError> {
    match tensors.get_mut(key) {
        None => {
            tensors.insert(key.to_string(), record);
        }
        Some(t) if t.dtype == record.dtype && t.global_shape == record.global_shape => {
            t.shards.extend(record.shards);
        }
        Some(t) => {
            return Err(format_err(
                path,
                format!(
                    "tensor {key}: saved as {:?} {:?} before, now {:?} {:?}",
                    t.dtype, t.global_shape, record.dtype, record.global_shape
                ),
            ));
        }
    }
    Ok(())
}

impl CheckpointWriter {
    /// Starts writing the checkpoint directory `output` (e.g. `save/iter_0000100`) from one
    /// process; `output` must not exist or be empty unless `force` (then it is replaced on
    /// commit).
    ///
    /// # Errors
    /// `output` exists and is not empty (without `force`), or the staging directory cannot be
    /// created.
    pub fn create(output: &Path, force: bool) -> Result<CheckpointWriter, CheckpointError> {
        let staging = StagingDir::create(output, force)?;
        Ok(CheckpointWriter {
            dir: staging.path().to_path_buf(),
            staging: Some(staging),
            output: output.to_path_buf(),
            tensors: BTreeMap::new(),
        })
    }

    /// [`create`](Self::create) for the committing rank of a save by several ranks: the
    /// staging directory has a fixed name (`.<name>.staging` beside `output`) that the other
    /// ranks find with [`join_shared`](Self::join_shared); a stale one from a killed save is
    /// replaced.
    ///
    /// # Errors
    /// As [`create`](Self::create).
    pub fn create_shared(output: &Path, force: bool) -> Result<CheckpointWriter, CheckpointError> {
        let staging = StagingDir::create_named(output, force, &shared_staging_name(output))?;
        Ok(CheckpointWriter {
            dir: staging.path().to_path_buf(),
            staging: Some(staging),
            output: output.to_path_buf(),
            tensors: BTreeMap::new(),
        })
    }

    /// A writer for a rank that adds its files to the save the committing rank opened with
    /// [`create_shared`](Self::create_shared) (call after a barrier). It cannot commit.
    ///
    /// # Errors
    /// The shared staging directory does not exist.
    pub fn join_shared(output: &Path) -> Result<CheckpointWriter, CheckpointError> {
        let parent = match output.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let dir = parent.join(shared_staging_name(output));
        if !dir.is_dir() {
            return Err(format_err(
                &dir,
                "the shared staging directory does not exist (the committing rank creates it first)"
                    .into(),
            ));
        }
        Ok(CheckpointWriter {
            staging: None,
            dir,
            output: output.to_path_buf(),
            tensors: BTreeMap::new(),
        })
    }

    /// Starts the safetensors file `file_name` holding one shard per spec (in order) in
    /// `dtype`, records the shards, and returns the file to push their values into. Memory:
    /// one shard at a time.
    ///
    /// # Errors
    /// A file name used twice or not plain, a key already recorded with another dtype or
    /// global shape, or an I/O failure.
    pub fn open_file(
        &mut self,
        file_name: &str,
        dtype: StoredDtype,
        specs: &[ShardSpec],
    ) -> Result<ShardFile, CheckpointError> {
        let path = self.dir.join(file_name);
        if file_name.contains('/') || path.exists() || file_name == METADATA_FILE {
            return Err(format_err(
                &self.output.join(file_name),
                "file name is used twice or is not a plain name".into(),
            ));
        }
        let mut tensor_specs = Vec::with_capacity(specs.len());
        for (i, s) in specs.iter().enumerate() {
            let name = format!("{}#{i}", s.key);
            tensor_specs.push(TensorSpec {
                name: name.clone(),
                shape: s.local_shape.iter().map(|&d| d as u64).collect(),
            });
            let record = TensorRecord {
                dtype,
                global_shape: s.global_shape.clone(),
                shards: vec![ShardRecord {
                    file: file_name.to_string(),
                    name,
                    global_offset: s.global_offset.clone(),
                    local_shape: s.local_shape.clone(),
                }],
            };
            add_record(&mut self.tensors, &s.key, record, &path)?;
        }
        let stream = SafetensorsStream::create(
            &path,
            tensor_specs,
            to_output_dtype(dtype),
            &[("format", "pt")],
        )?;
        Ok(ShardFile { stream })
    }

    /// Writes the shards with `replica_id == 0` to the safetensors file `file_name` in `dtype`
    /// (fsynced) and records them. Returns the bytes written.
    ///
    /// # Errors
    /// A shard whose data length does not match its local shape, a key already recorded with
    /// another dtype or global shape, a file name used twice, or an I/O failure.
    pub fn write_file(
        &mut self,
        file_name: &str,
        dtype: StoredDtype,
        shards: &[ShardedTensor<'_>],
    ) -> Result<u64, CheckpointError> {
        let written: Vec<&ShardedTensor> = shards.iter().filter(|s| s.replica_id == 0).collect();
        for s in &written {
            if volume(&s.local_shape) != Some(s.data.len()) {
                return Err(format_err(
                    &self.output.join(file_name),
                    format!(
                        "tensor {}: {} values for local shape {:?}",
                        s.key,
                        s.data.len(),
                        s.local_shape
                    ),
                ));
            }
        }
        let specs: Vec<ShardSpec> = written
            .iter()
            .map(|s| ShardSpec {
                key: s.key.clone(),
                global_shape: s.global_shape.clone(),
                global_offset: s.global_offset.clone(),
                local_shape: s.local_shape.clone(),
            })
            .collect();
        let mut file = self.open_file(file_name, dtype, &specs)?;
        for s in &written {
            file.push(s.data)?;
        }
        file.finish()
    }

    /// The records of every shard this writer wrote, to send to the committing rank.
    pub fn into_records(self) -> TensorRecords {
        self.tensors
    }

    /// Adds another rank's records (see [`into_records`](Self::into_records)).
    ///
    /// # Errors
    /// A key recorded with another dtype or global shape.
    pub fn merge_records(&mut self, records: TensorRecords) -> Result<(), CheckpointError> {
        let path = self.output.join(METADATA_FILE);
        for (key, record) in records {
            add_record(&mut self.tensors, &key, record, &path)?;
        }
        Ok(())
    }

    /// Copies the file `src` into the checkpoint as `name` (a relative path such as
    /// `tokenizer/tokenizer.json`; parent directories are created). Returns the bytes copied.
    ///
    /// # Errors
    /// `name` is absolute or leaves the directory, or an I/O failure.
    pub fn copy_file(&mut self, src: &Path, name: &str) -> Result<u64, CheckpointError> {
        let rel = Path::new(name);
        if rel.is_absolute()
            || rel
                .components()
                .any(|c| !matches!(c, std::path::Component::Normal(_)))
        {
            return Err(format_err(
                &self.output.join(name),
                "extra files must have a plain relative name".into(),
            ));
        }
        let dst = self.dir.join(rel);
        if let Some(parent) = dst.parent() {
            std::fs::create_dir_all(parent).map_err(|e| CheckpointError::io(parent, e))?;
        }
        std::fs::copy(src, &dst).map_err(|e| CheckpointError::io(src, e))
    }

    /// Checks that every tensor's shards cover it exactly, writes `metadata.json` and renames
    /// the staging directory to the output path.
    ///
    /// # Errors
    /// Incomplete or overlapping shards (named), a writer from
    /// [`join_shared`](Self::join_shared), or an I/O failure (the staging directory is removed
    /// and nothing appears under the output name).
    pub fn commit(
        self,
        iteration: u64,
        parallel: ParallelLayout,
        content: serde_json::Value,
    ) -> Result<(), CheckpointError> {
        let meta_path = self.output.join(METADATA_FILE);
        let Some(staging) = self.staging else {
            return Err(format_err(
                &meta_path,
                "only the rank that created the checkpoint commits it".into(),
            ));
        };
        for (key, t) in &self.tensors {
            t.check_cover()
                .map_err(|e| format_err(&meta_path, format!("tensor {key}: {e}")))?;
        }
        let metadata = CheckpointMetadata {
            format: FORMAT_NAME.into(),
            format_version: FORMAT_VERSION,
            iteration,
            parallel,
            tensors: self.tensors,
            content,
        };
        let json = serde_json::to_vec_pretty(&metadata)
            .map_err(|e| format_err(&meta_path, format!("cannot serialize: {e}")))?;
        let path = staging.path().join(METADATA_FILE);
        let io = |e| CheckpointError::io(&path, e);
        let mut f = std::fs::File::create(&path).map_err(io)?;
        std::io::Write::write_all(&mut f, &json).map_err(io)?;
        f.sync_all().map_err(io)?;
        staging.commit()
    }
}
