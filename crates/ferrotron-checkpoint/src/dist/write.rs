//! [`CheckpointWriter`]: writes one iteration directory of a distributed checkpoint into a
//! staging directory, one safetensors file per call of [`CheckpointWriter::write_file`] (one
//! per rank and kind, e.g. `model_rank00000.safetensors`), then `metadata.json`, then renames the
//! staging directory into place ([`CheckpointWriter::commit`]). A kill at any point leaves no
//! directory under the final name.

use super::metadata::{
    CheckpointMetadata, FORMAT_NAME, FORMAT_VERSION, METADATA_FILE, ParallelLayout, ShardRecord,
    StoredDtype, TensorRecord, volume,
};
use crate::CheckpointError;
use crate::gguf::OutputDtype;
use crate::safetensors_writer::{TensorSpec, write_safetensors};
use crate::staging::StagingDir;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

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
    staging: StagingDir,
    output: PathBuf,
    tensors: BTreeMap<String, TensorRecord>,
}

fn format_err(file: &Path, detail: String) -> CheckpointError {
    CheckpointError::Format {
        file: file.display().to_string(),
        detail,
    }
}

impl CheckpointWriter {
    /// Starts writing the checkpoint directory `output` (e.g. `save/iter_0000100`), which must
    /// not exist or be empty unless `force` (then it is replaced on commit).
    ///
    /// # Errors
    /// `output` exists and is not empty (without `force`), or the staging directory cannot be
    /// created.
    pub fn create(output: &Path, force: bool) -> Result<CheckpointWriter, CheckpointError> {
        Ok(CheckpointWriter {
            staging: StagingDir::create(output, force)?,
            output: output.to_path_buf(),
            tensors: BTreeMap::new(),
        })
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
        let path = self.staging.path().join(file_name);
        if file_name.contains('/') || path.exists() || file_name == METADATA_FILE {
            return Err(format_err(
                &self.output.join(file_name),
                "file name is used twice or is not a plain name".into(),
            ));
        }
        let written: Vec<&ShardedTensor> = shards.iter().filter(|s| s.replica_id == 0).collect();
        let mut specs = Vec::with_capacity(written.len());
        for (i, s) in written.iter().enumerate() {
            if volume(&s.local_shape) != Some(s.data.len()) {
                return Err(format_err(
                    &path,
                    format!(
                        "tensor {}: {} values for local shape {:?}",
                        s.key,
                        s.data.len(),
                        s.local_shape
                    ),
                ));
            }
            let name = format!("{}#{i}", s.key);
            specs.push(TensorSpec {
                name: name.clone(),
                shape: s.local_shape.iter().map(|&d| d as u64).collect(),
            });
            let record = self
                .tensors
                .entry(s.key.clone())
                .or_insert_with(|| TensorRecord {
                    dtype,
                    global_shape: s.global_shape.clone(),
                    shards: Vec::new(),
                });
            if record.dtype != dtype || record.global_shape != s.global_shape {
                return Err(format_err(
                    &path,
                    format!(
                        "tensor {}: saved as {:?} {:?} before, now {:?} {:?}",
                        s.key, record.dtype, record.global_shape, dtype, s.global_shape
                    ),
                ));
            }
            record.shards.push(ShardRecord {
                file: file_name.to_string(),
                name,
                global_offset: s.global_offset.clone(),
                local_shape: s.local_shape.clone(),
            });
        }
        let out_dtype = match dtype {
            StoredDtype::F32 => OutputDtype::F32,
            StoredDtype::BF16 => OutputDtype::BF16,
            StoredDtype::F16 => OutputDtype::F16,
        };
        write_safetensors(&path, &specs, out_dtype, &[("format", "pt")], |i| {
            Ok(written[i].data.to_vec())
        })
    }

    /// Checks that every tensor's shards cover it exactly, writes `metadata.json` and renames
    /// the staging directory to the output path.
    ///
    /// # Errors
    /// Incomplete or overlapping shards (named), or an I/O failure (the staging directory is
    /// removed and nothing appears under the output name).
    pub fn commit(
        self,
        iteration: u64,
        parallel: ParallelLayout,
        content: serde_json::Value,
    ) -> Result<(), CheckpointError> {
        let meta_path = self.output.join(METADATA_FILE);
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
        let path = self.staging.path().join(METADATA_FILE);
        let io = |e| CheckpointError::io(&path, e);
        let mut f = std::fs::File::create(&path).map_err(io)?;
        std::io::Write::write_all(&mut f, &json).map_err(io)?;
        f.sync_all().map_err(io)?;
        self.staging.commit()
    }
}
