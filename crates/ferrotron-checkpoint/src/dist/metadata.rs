//! `metadata.json` of a distributed checkpoint: the format version, the parallel layout it was
//! saved under, and for every tensor key its global shape and the shards that hold it
//! (Megatron `dist_checkpointing`'s `ShardedTensor`: key, global shape, global offset, local
//! shape, replica id).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `format` field of every Ferrotron distributed checkpoint.
pub const FORMAT_NAME: &str = "ferrotron-dist-checkpoint";

/// Version of the on-disk layout this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// File name of the metadata inside an iteration directory.
pub const METADATA_FILE: &str = "metadata.json";

/// Element type a tensor is stored with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StoredDtype {
    /// IEEE binary32.
    F32,
    /// bfloat16.
    BF16,
    /// IEEE binary16.
    F16,
}

impl StoredDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            StoredDtype::F32 => 4,
            StoredDtype::BF16 | StoredDtype::F16 => 2,
        }
    }

    /// The safetensors dtype tag.
    pub fn safetensors_name(self) -> &'static str {
        match self {
            StoredDtype::F32 => "F32",
            StoredDtype::BF16 => "BF16",
            StoredDtype::F16 => "F16",
        }
    }
}

/// The process grid a checkpoint was saved under (Megatron's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParallelLayout {
    /// `tensor_model_parallel_size`.
    pub tensor_model_parallel_size: usize,
    /// `pipeline_model_parallel_size`.
    pub pipeline_model_parallel_size: usize,
    /// `data_parallel_size`.
    pub data_parallel_size: usize,
    /// `expert_model_parallel_size` (1 when absent).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub expert_model_parallel_size: usize,
    /// `expert_tensor_parallel_size`; absent: the tensor-parallel size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_tensor_parallel_size: Option<usize>,
    /// `context_parallel_size` (1 when absent): its ranks hold the same weights, and with the
    /// distributed optimizer shard the optimizer state over data x context.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub context_parallel_size: usize,
}

fn one() -> usize {
    1
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

impl ParallelLayout {
    /// One rank.
    pub const SINGLE: ParallelLayout = ParallelLayout {
        tensor_model_parallel_size: 1,
        pipeline_model_parallel_size: 1,
        data_parallel_size: 1,
        expert_model_parallel_size: 1,
        context_parallel_size: 1,
        expert_tensor_parallel_size: None,
    };

    /// Ranks in the grid: `tp · pp · cp · dp` (Megatron's `world_size`).
    pub fn world_size(&self) -> usize {
        self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
            * self.data_parallel_size
    }
}

/// Where one shard of a tensor lives and which box of the global tensor it covers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardRecord {
    /// Safetensors file (relative to the iteration directory).
    pub file: String,
    /// Tensor name inside that file.
    pub name: String,
    /// Offset of the shard's first element in each dimension of the global tensor.
    pub global_offset: Vec<usize>,
    /// Shape of the shard.
    pub local_shape: Vec<usize>,
}

/// One logical tensor of the checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorRecord {
    /// Element type of every shard.
    pub dtype: StoredDtype,
    /// Shape of the whole (unsharded) tensor.
    pub global_shape: Vec<usize>,
    /// Non-overlapping shards that together cover the global shape exactly (replicas are
    /// written once, by replica 0).
    pub shards: Vec<ShardRecord>,
}

/// The whole `metadata.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMetadata {
    /// Always [`FORMAT_NAME`].
    pub format: String,
    /// [`FORMAT_VERSION`] of the writer.
    pub format_version: u32,
    /// Training iteration the checkpoint was taken after.
    pub iteration: u64,
    /// The layout the checkpoint was saved under (loading may use another one).
    pub parallel: ParallelLayout,
    /// Every tensor by key.
    pub tensors: BTreeMap<String, TensorRecord>,
    /// Caller-defined content: model config, trainer state, run config.
    pub content: serde_json::Value,
}

/// Number of elements of `shape`, `None` on overflow.
pub(crate) fn volume(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
}

impl TensorRecord {
    /// Checks that the shards lie inside the global shape, have its rank, do not overlap and
    /// cover it exactly; returns a description of the first problem.
    pub(crate) fn check_cover(&self) -> Result<(), String> {
        let rank = self.global_shape.len();
        let total = volume(&self.global_shape).ok_or("global shape overflows")?;
        let mut covered = 0usize;
        for (i, s) in self.shards.iter().enumerate() {
            if s.global_offset.len() != rank || s.local_shape.len() != rank {
                return Err(format!(
                    "shard {} of {:?}: offset {:?} / shape {:?} do not have rank {rank}",
                    s.name, self.global_shape, s.global_offset, s.local_shape
                ));
            }
            for d in 0..rank {
                if s.global_offset[d] + s.local_shape[d] > self.global_shape[d] {
                    return Err(format!(
                        "shard {} at {:?} of shape {:?} lies outside the global shape {:?}",
                        s.name, s.global_offset, s.local_shape, self.global_shape
                    ));
                }
            }
            for t in &self.shards[..i] {
                if boxes_overlap(s, t) {
                    return Err(format!("shards {} and {} overlap", t.name, s.name));
                }
            }
            covered += volume(&s.local_shape).ok_or("shard shape overflows")?;
        }
        if covered != total {
            return Err(format!(
                "shards cover {covered} of {total} elements of {:?}",
                self.global_shape
            ));
        }
        Ok(())
    }
}

fn boxes_overlap(a: &ShardRecord, b: &ShardRecord) -> bool {
    let nonempty = |s: &ShardRecord| s.local_shape.iter().all(|&d| d > 0);
    nonempty(a)
        && nonempty(b)
        && (0..a.global_offset.len()).all(|d| {
            a.global_offset[d] < b.global_offset[d] + b.local_shape[d]
                && b.global_offset[d] < a.global_offset[d] + a.local_shape[d]
        })
}
