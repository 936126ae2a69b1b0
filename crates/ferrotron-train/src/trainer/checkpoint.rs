//! Saving and resuming a [`Trainer`] in the distributed checkpoint format
//! ([`ferrotron_checkpoint::dist`], `docs/checkpoint-format.md`): Megatron's `save_checkpoint`
//! / `load_checkpoint` (`megatron/training/checkpointing.py`) at one rank.
//!
//! Tensors (keys):
//! - `model.<param name>` in the parameter dtype, shaped as the parameter
//!   (`model.decoder.layers.0.self_attention.linear_qkv.weight: [qkv, h]`);
//! - `optimizer.exp_avg.<param name>`, `optimizer.exp_avg_sq.<param name>` and, with bf16/fp16
//!   params, `optimizer.master.<param name>`: f32, flattened to `[numel]` so a distributed
//!   optimizer's owned ranges are plain 1-D shards.
//!
//! `metadata.json` `content` holds a [`TrainerState`]: iteration, consumed train and
//! validation samples, the scheduler and optimizer scalars, the seed, and whatever the caller
//! adds (the run config, the model's HF config).

use super::{Result, TrainError, Trainer};
use ferrotron_checkpoint::dist::{
    CheckpointReader, CheckpointWriter, ParallelLayout, ShardedTensor, StoredDtype, iteration_dir,
    prune_checkpoints, write_tracker,
};
use ferrotron_optim::{
    OptimizerMeta, ParamInfo, SchedulerLoadPolicy, SchedulerState, StateArray, StateDict, Stateful,
};
use ferrotron_tensor::DType;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The trainer scalars stored in `metadata.json` `content.trainer`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Completed iterations.
    pub iteration: u64,
    /// Training samples consumed (the data loader resumes after them).
    pub consumed_samples: u64,
    /// Validation samples consumed (the validation loader resumes after them).
    pub consumed_valid_samples: u64,
    /// The run seed.
    pub seed: u64,
    /// LR/weight-decay schedule state.
    pub scheduler: SchedulerState,
    /// Optimizer scalars (step, precision, loss scaler, skipped iterations).
    pub optimizer: OptimizerMeta,
}

/// When and where [`Trainer::train`] saves (Megatron `--save`, `--save-interval`).
#[derive(Clone, Debug, PartialEq)]
pub struct SavePlan {
    /// The `save` directory.
    pub dir: PathBuf,
    /// Save every this many iterations (`None`: only at the end).
    pub interval: Option<u64>,
    /// Keep the newest K checkpoints; 0 keeps all.
    pub keep_last: usize,
    /// Stored as `content.extra` of every checkpoint (run config, model config).
    pub extra: serde_json::Value,
}

/// What to restore from a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadMode {
    /// Everything: weights, optimizer, scheduler, counters (continue the run).
    Resume,
    /// Weights only; iteration, samples, optimizer and schedule start fresh (Megatron
    /// `--finetune`).
    Finetune,
}

const MODEL: &str = "model.";
const OPTIM: &str = "optimizer.";

fn ckpt_err(e: impl std::fmt::Display) -> TrainError {
    TrainError::Checkpoint(e.to_string())
}

fn stored(dtype: DType) -> Result<StoredDtype> {
    match dtype {
        DType::F32 => Ok(StoredDtype::F32),
        DType::BF16 => Ok(StoredDtype::BF16),
        DType::F16 => Ok(StoredDtype::F16),
        #[allow(unreachable_patterns)]
        other => Err(ckpt_err(format!(
            "cannot store parameters of dtype {other:?}"
        ))),
    }
}

/// `(offset in the flattened parameter, length, start in the local state arrays)` of each part
/// of `p` held in the flat optimizer arrays described by `owned` (one per intersecting range).
pub(super) fn owned_parts(
    p: &ParamInfo,
    owned: &ferrotron_optim::OwnedRanges,
) -> Vec<(usize, usize, usize)> {
    let r = p.range();
    owned
        .iter()
        .filter_map(|(o, local_start)| {
            let (lo, hi) = (r.start.max(o.start), r.end.min(o.end));
            (lo < hi).then(|| (lo - p.offset, hi - lo, local_start + lo - o.start))
        })
        .collect()
}

impl Trainer {
    /// Validation samples consumed so far (see [`TrainerState`]).
    pub fn consumed_valid_samples(&self) -> u64 {
        self.consumed_valid_samples
    }

    /// Saves the full training state as `save/iter_NNNNNNN` (staged and renamed), points
    /// `latest_checkpointed_iteration.txt` at it, then keeps only the newest `keep_last`
    /// checkpoints (0 = all). `extra` is stored beside the trainer state in the metadata
    /// `content` (e.g. `{"run_config": ..., "hf_config": ...}`). Returns the directory.
    ///
    /// # Errors
    /// [`TrainError::Checkpoint`] on any write failure; the previous checkpoints and the
    /// tracker are then unchanged.
    pub fn save_checkpoint(
        &self,
        save: &Path,
        keep_last: usize,
        extra: serde_json::Value,
    ) -> Result<PathBuf> {
        let dir = iteration_dir(save, self.iteration);
        let full = self.gather_full_state()?;
        if !self.is_writer() {
            // The writer stores the whole (gathered) model and optimizer state.
            self.barrier_all()?;
            return Ok(dir);
        }
        let (names, shapes) = (&full.names, &full.shapes);
        let mut writer = CheckpointWriter::create(&dir, true).map_err(ckpt_err)?;
        let model: Vec<ShardedTensor> = names
            .iter()
            .zip(shapes)
            .zip(&full.params)
            .map(|((name, shape), values)| {
                ShardedTensor::full(format!("{MODEL}{name}"), shape, values)
            })
            .collect();
        let dtype = stored(self.buffer.param_dtype())?;
        writer
            .write_file("model_rank00000.safetensors", dtype, &model)
            .map_err(ckpt_err)?;
        let mut shards = Vec::new();
        for (array, per_param) in &full.optim {
            for (name, values) in names.iter().zip(per_param) {
                let key = format!("{OPTIM}{array}.{name}");
                shards.push(ShardedTensor::full(key, &[values.len()], values));
            }
        }
        writer
            .write_file("optim_rank00000.safetensors", StoredDtype::F32, &shards)
            .map_err(ckpt_err)?;
        let state = TrainerState {
            iteration: self.iteration,
            consumed_samples: self.consumed_samples,
            consumed_valid_samples: self.consumed_valid_samples,
            seed: self.options.seed,
            scheduler: self.scheduler.export_state().meta,
            optimizer: full.meta,
        };
        let content = serde_json::json!({ "trainer": state, "extra": extra });
        let layout = ParallelLayout {
            data_parallel_size: self.dp.size(),
            tensor_model_parallel_size: self.model.tensor_parallel().map_or(1, |t| t.group.size()),
            pipeline_model_parallel_size: self.pp.as_ref().map_or(1, |p| p.stages()),
        };
        writer
            .commit(self.iteration, layout, content)
            .map_err(ckpt_err)?;
        write_tracker(save, self.iteration).map_err(ckpt_err)?;
        prune_checkpoints(save, keep_last).map_err(ckpt_err)?;
        self.barrier_all()?;
        Ok(dir)
    }

    /// Restores from the iteration directory `dir` (see [`LoadMode`]). The model must have
    /// the checkpoint's parameters (names and shapes; every mismatch is listed). With
    /// [`LoadMode::Resume`] the schedule settings must match the checkpoint's (Megatron's
    /// default check). Returns the stored [`TrainerState`].
    ///
    /// # Errors
    /// [`TrainError::Checkpoint`] for an unreadable or mismatching checkpoint; on error the
    /// trainer may hold partly loaded weights and must not be used.
    pub fn load_checkpoint(&mut self, dir: &Path, mode: LoadMode) -> Result<TrainerState> {
        let reader = CheckpointReader::open(dir).map_err(ckpt_err)?;
        let content = &reader.metadata().content;
        let state: TrainerState = serde_json::from_value(content["trainer"].clone())
            .map_err(|e| ckpt_err(format!("{}: content.trainer: {e}", dir.display())))?;
        let params = self.buffer.params().to_vec();
        let shapes = self.global_shapes();
        let expected: Vec<(String, Vec<usize>)> = params
            .iter()
            .zip(&shapes)
            .map(|(p, shape)| (format!("{MODEL}{}", p.name), shape.clone()))
            .collect();
        // A pipeline stage reads its own parameters; the others' are the other stages'.
        if self.pp.is_some() {
            reader.check_tensors_present(&expected).map_err(ckpt_err)?;
        } else {
            reader.check_tensors(MODEL, &expected).map_err(ckpt_err)?;
        }
        let full = params
            .iter()
            .map(|p| reader.read(&format!("{MODEL}{}", p.name)).map_err(ckpt_err))
            .collect::<Result<Vec<_>>>()?;
        let local = self.model.shard_tensor_parallel(full);
        let mut buffer_state = self.buffer.export_state();
        let mut flat = vec![0f32; self.buffer.numel()];
        for (p, values) in params.iter().zip(&local) {
            flat[p.range()].copy_from_slice(values);
        }
        buffer_state
            .arrays
            .insert("params".into(), StateArray::F32(flat));
        self.buffer.import_state(buffer_state)?;
        if mode == LoadMode::Resume {
            self.load_optimizer(&reader, &params, &state)?;
            self.scheduler
                .import_with(state.scheduler.clone(), SchedulerLoadPolicy::RequireMatch)?;
            self.iteration = state.iteration;
            self.consumed_samples = state.consumed_samples;
            self.consumed_valid_samples = state.consumed_valid_samples;
        } else {
            // Fresh optimizer state over the loaded weights (the master copy included).
            self.optimizer = super::step::new_optimizer(&self.options, &self.buffer, &self.dp)?;
        }
        self.sync_model_from_buffer()?;
        Ok(state)
    }

    /// Imports the Adam moments (and master weights) of every parameter, read whole and cut
    /// to this rank's tensor-parallel shard and owned ranges, with the checkpoint's step,
    /// loss scaler and skip counter.
    fn load_optimizer(
        &mut self,
        reader: &CheckpointReader,
        params: &[ParamInfo],
        state: &TrainerState,
    ) -> Result<()> {
        let current = self.optimizer.export_state();
        let owned = current.meta.adam.owned.clone();
        let mut arrays = BTreeMap::new();
        for name in current.arrays.keys() {
            let full = params
                .iter()
                .map(|p| {
                    reader
                        .read(&format!("{OPTIM}{name}.{}", p.name))
                        .map_err(ckpt_err)
                })
                .collect::<Result<Vec<_>>>()?;
            let local = self.model.shard_tensor_parallel(full);
            let mut values = vec![0f32; owned.local_len()];
            for (p, param_values) in params.iter().zip(&local) {
                for (off, len, start) in owned_parts(p, &owned) {
                    values[start..start + len].copy_from_slice(&param_values[off..off + len]);
                }
            }
            arrays.insert(name.clone(), StateArray::F32(values));
        }
        let mut meta = state.optimizer.clone();
        meta.adam.owned = owned;
        self.optimizer.import_state(StateDict { meta, arrays })?;
        Ok(())
    }
}
