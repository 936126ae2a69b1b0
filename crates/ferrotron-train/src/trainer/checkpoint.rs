//! Saving and resuming a [`Trainer`] in the distributed checkpoint format
//! ([`ferrotron_checkpoint::dist`], `docs/checkpoint-format.md`): Megatron's `save_checkpoint`
//! / `load_checkpoint` (`megatron/training/checkpointing.py`) at one rank.
//!
//! Tensors (keys), all in the full model's shapes and stored as the boxes each rank holds
//! (see `sharded.rs`):
//! - `model.<param name>` in the parameter dtype, shaped as the parameter
//!   (`model.decoder.layers.0.self_attention.linear_qkv.weight: [qkv, h]`);
//! - `optimizer.exp_avg.<param name>`, `optimizer.exp_avg_sq.<param name>` and, with bf16/fp16
//!   params, `optimizer.master.<param name>`: f32, shaped as the parameter.
//!
//! A checkpoint without `content.trainer` (one made by `ferrotron convert hf-to-ckpt`)
//! holds weights only and always loads as [`LoadMode::Finetune`].
//!
//! `metadata.json` `content` holds a [`TrainerState`]: iteration, consumed train and
//! validation samples, the scheduler and optimizer scalars, the seed, and whatever the caller
//! adds (the run config, the model's HF config).

use super::step::{new_optimizer, with_params_in_buffer};
use super::{Result, TrainError, Trainer};
use ferrotron_checkpoint::dist::{
    CheckpointReader, CheckpointWriter, ParallelLayout, StoredDtype, iteration_dir,
    prune_checkpoints, write_tracker,
};
use ferrotron_model::module::ExpertTensorParallel;
use ferrotron_optim::{
    OptimizerMeta, ParamInfo, SchedulerLoadPolicy, SchedulerState, StateArray, StateDict, Stateful,
};
use ferrotron_tensor::DType;
use serde::{Deserialize, Serialize};
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
    /// Files copied into every checkpoint: (relative name, source), e.g. the tokenizer.
    pub files: Vec<(String, PathBuf)>,
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

/// Key prefix of model weights.
pub(super) const MODEL: &str = "model.";
/// Key prefix of optimizer state.
pub(super) const OPTIM: &str = "optimizer.";

pub(super) fn ckpt_err(e: impl std::fmt::Display) -> TrainError {
    TrainError::Checkpoint(e.to_string())
}

pub(super) fn stored(dtype: DType) -> Result<StoredDtype> {
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
    /// checkpoints (0 = all). Every rank writes its own shards in parallel (see
    /// `sharded.rs`); the committing rank (data-, tensor- and pipeline-parallel rank 0)
    /// writes `metadata.json` with `extra` stored beside the trainer state in `content`
    /// (e.g. `{"run_config": ..., "hf_config": ...}`) and `files` (relative name, source
    /// path) copied in. Collective. Returns the directory.
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
        self.save_checkpoint_with_files(save, keep_last, extra, &[])
    }

    /// [`save_checkpoint`](Self::save_checkpoint) that also copies `files` (name inside the
    /// checkpoint, source path), e.g. the tokenizer, into the iteration directory.
    ///
    /// # Errors
    /// As [`save_checkpoint`](Self::save_checkpoint).
    pub fn save_checkpoint_with_files(
        &self,
        save: &Path,
        keep_last: usize,
        extra: serde_json::Value,
        files: &[(String, PathBuf)],
    ) -> Result<PathBuf> {
        self.require_params_current("save_checkpoint")?;
        let dir = iteration_dir(save, self.iteration);
        let committing = self.is_writer();
        let created = if committing {
            Some(CheckpointWriter::create_shared(&dir, true).map_err(ckpt_err)?)
        } else {
            None
        };
        self.barrier_all()?;
        let mut writer = match created {
            Some(w) => w,
            None => CheckpointWriter::join_shared(&dir).map_err(ckpt_err)?,
        };
        self.write_rank_shards(&mut writer)?;
        if !committing {
            self.gather_records(Some(writer.into_records()))?;
            self.barrier_all()?;
            return Ok(dir);
        }
        for records in self.gather_records(None)? {
            writer.merge_records(records).map_err(ckpt_err)?;
        }
        for (name, src) in files {
            writer.copy_file(src, name).map_err(ckpt_err)?;
        }
        let content = serde_json::json!({ "trainer": self.current_state(), "extra": extra });
        writer
            .commit(self.iteration, self.parallel_layout(), content)
            .map_err(ckpt_err)?;
        write_tracker(save, self.iteration).map_err(ckpt_err)?;
        prune_checkpoints(save, keep_last).map_err(ckpt_err)?;
        self.barrier_all()?;
        Ok(dir)
    }

    /// The layout this trainer runs under.
    pub(super) fn parallel_layout(&self) -> ParallelLayout {
        ParallelLayout {
            data_parallel_size: self.data_shard().1,
            context_parallel_size: self.context_parallel_size(),
            tensor_model_parallel_size: self.model.tensor_parallel().map_or(1, |t| t.group.size()),
            pipeline_model_parallel_size: self.pp.as_ref().map_or(1, |p| p.stages()),
            expert_model_parallel_size: self.model.expert_parallel().map_or(1, |e| e.shard().size),
            expert_tensor_parallel_size: self
                .model
                .tensor_parallel()
                .filter(|t| t.experts == ExpertTensorParallel::Whole)
                .map(|_| 1),
        }
    }

    /// Restores from the iteration directory `dir` (see [`LoadMode`]), whatever layout it was
    /// saved under: each rank reads the boxes of the full tensors its own shard covers. The
    /// model must have the checkpoint's parameters (names and full shapes; every mismatch is
    /// listed). With [`LoadMode::Resume`] the schedule settings must match the checkpoint's
    /// (Megatron's default check). A checkpoint without trainer state (converted from HF)
    /// loads its weights only. Returns the stored [`TrainerState`] (for a weights-only
    /// checkpoint: the trainer's fresh state).
    ///
    /// # Errors
    /// [`TrainError::Checkpoint`] for an unreadable or mismatching checkpoint; on error the
    /// trainer may hold partly loaded weights and must not be used.
    pub fn load_checkpoint(&mut self, dir: &Path, mode: LoadMode) -> Result<TrainerState> {
        // Gathers in flight would land on top of the loaded weights.
        self.finish_param_gather()?;
        let reader = CheckpointReader::open(dir).map_err(ckpt_err)?;
        let content = &reader.metadata().content;
        let stored_state: Option<TrainerState> = match content.get("trainer") {
            None => None,
            Some(v) => Some(
                serde_json::from_value(v.clone())
                    .map_err(|e| ckpt_err(format!("{}: content.trainer: {e}", dir.display())))?,
            ),
        };
        let params = self.buffer.params().to_vec();
        // A LoRA checkpoint holds the adapters: the frozen base comes from the base model.
        // Buffers (the routers' expert biases) are not trained but saved.
        let buffers: Vec<usize> = (0..params.len())
            .filter(|&i| self.model.is_buffer(i))
            .collect();
        let expected: Vec<(String, Vec<usize>)> = params
            .iter()
            .enumerate()
            .filter(|(i, p)| !p.flags.frozen || buffers.contains(i))
            .map(|(i, p)| {
                (
                    format!("{MODEL}{}", p.name),
                    self.model.global_param_shape(i),
                )
            })
            .collect();
        // A pipeline stage reads its own parameters; the others' are the other stages'.
        if self.pp.is_some() {
            reader.check_tensors_present(&expected).map_err(ckpt_err)?;
        } else {
            reader.check_tensors(MODEL, &expected).map_err(ckpt_err)?;
        }
        let mut buffer_state = StateDict::meta_only(self.buffer.meta());
        let mut flat = vec![0f32; self.buffer.numel()];
        for (i, p) in params.iter().enumerate().filter(|(_, p)| !p.flags.frozen) {
            let values = self.read_local(&reader, &format!("{MODEL}{}", p.name), i, 0..p.numel)?;
            flat[p.range()].copy_from_slice(&values);
        }
        buffer_state
            .arrays
            .insert("params".into(), StateArray::F32(flat));
        with_params_in_buffer(&mut self.model, &mut self.buffer, |buffer| {
            Ok(buffer.import_state(buffer_state)?)
        })?;
        for &i in &buffers {
            let key = format!("{MODEL}{}", params[i].name);
            let numel = self.model.param_table().numel(i);
            let values = self.read_local(&reader, &key, i, 0..numel)?;
            self.model
                .load_parameters_with(&[i], |_| std::borrow::Cow::Borrowed(&values))?;
        }
        let state = match (mode, stored_state) {
            (LoadMode::Resume, Some(state)) => {
                self.load_optimizer(&reader, &params, &state)?;
                self.scheduler
                    .import_with(state.scheduler.clone(), SchedulerLoadPolicy::RequireMatch)?;
                self.iteration = state.iteration;
                self.consumed_samples = state.consumed_samples;
                self.consumed_valid_samples = state.consumed_valid_samples;
                state
            }
            (_, stored) => {
                // Fresh optimizer state over the loaded weights (the master copy included).
                self.optimizer =
                    with_params_in_buffer(&mut self.model, &mut self.buffer, |buffer| {
                        new_optimizer(&self.options, buffer, &self.dp)
                    })?;
                stored.unwrap_or_else(|| self.current_state())
            }
        };
        Ok(state)
    }

    /// The trainer's counters and schedule/optimizer scalars now (what a checkpoint stores;
    /// after a weights-only load: the fresh state it reports).
    fn current_state(&self) -> TrainerState {
        TrainerState {
            iteration: self.iteration,
            consumed_samples: self.consumed_samples,
            consumed_valid_samples: self.consumed_valid_samples,
            seed: self.options.seed,
            scheduler: self.scheduler.state(),
            optimizer: self.optimizer.meta(),
        }
    }

    /// Imports the Adam moments (and master weights) of this rank's owned ranges of its
    /// shard, with the checkpoint's step, loss scaler and skip counter.
    fn load_optimizer(
        &mut self,
        reader: &CheckpointReader,
        params: &[ParamInfo],
        state: &TrainerState,
    ) -> Result<()> {
        let current = self.optimizer.meta();
        let owned = current.adam.owned.clone();
        let names: Vec<String> = current
            .adam
            .array_names()
            .into_iter()
            .map(String::from)
            .collect();
        let missing: Vec<String> = names
            .iter()
            .flat_map(|n| {
                let trainable = params.iter().filter(|p| !p.flags.frozen);
                trainable.map(move |p| format!("{OPTIM}{n}.{}", p.name))
            })
            .filter(|k| !reader.metadata().tensors.contains_key(k))
            .collect();
        if !missing.is_empty() {
            return Err(ckpt_err(format!(
                "{}: missing optimizer tensors {} (load it with checkpoint.finetune for the weights only)",
                reader.dir().display(),
                missing.join(", ")
            )));
        }
        let mut meta = state.optimizer.clone();
        meta.adam.owned = owned.clone();
        self.optimizer.import_meta(meta)?;
        // One array at a time: an offloaded state never comes into RAM whole.
        for name in names {
            let values = self.read_optimizer_array(reader, &name, &owned)?;
            self.optimizer.adam_mut().write_array(&name, &values)?;
        }
        Ok(())
    }
}
