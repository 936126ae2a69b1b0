//! The layout-independent training state: every parameter and optimizer array of the FULL
//! model, assembled from the data-parallel shards of the distributed optimizer and the
//! tensor-parallel shards of the model (collective). Checkpoints store this form, so a run
//! saved under one layout resumes under any other (each rank cuts its part back out).

use std::collections::BTreeMap;

use ferrotron_optim::{OptimizerMeta, OwnedRanges, ParamId, StateArray, StateDict, Stateful};

use super::checkpoint::owned_parts;
use super::data_parallel::comm_err;
use super::{Result, TrainError, Trainer};

/// Full-model arrays, one per parameter in the order of [`ferrotron_model::GptModel::parameters`].
pub(super) struct FullState {
    /// Weights, widened to f32.
    pub params: Vec<Vec<f32>>,
    /// Optimizer arrays by name (`exp_avg`, `exp_avg_sq`, `master`), each per parameter,
    /// flattened.
    pub optim: BTreeMap<String, Vec<Vec<f32>>>,
    /// Optimizer scalars (step, loss scaler, skipped steps).
    pub meta: OptimizerMeta,
}

/// One data-parallel rank's owned flat ranges and its optimizer arrays (name -> values).
type RankShard = (OwnedRanges, BTreeMap<String, Vec<f32>>);

impl Trainer {
    /// The rank that writes checkpoints: data-parallel and tensor-parallel rank 0.
    pub(super) fn is_writer(&self) -> bool {
        self.dp.rank() == 0
            && self
                .model
                .tensor_parallel()
                .is_none_or(|t| t.group.rank() == 0)
    }

    /// Waits for every rank of the data- and tensor-parallel groups.
    pub(super) fn barrier_all(&self) -> Result<()> {
        self.dp.barrier()?;
        if let Some(tp) = self.model.tensor_parallel() {
            tp.group.comm().barrier().map_err(comm_err)?;
        }
        Ok(())
    }

    /// Each parameter's full shape.
    pub(super) fn global_shapes(&self) -> Vec<Vec<usize>> {
        match self.model.tensor_parallel() {
            Some(tp) => tp.global_shapes.clone(),
            None => self
                .buffer
                .params()
                .iter()
                .map(|p| p.shape.clone())
                .collect(),
        }
    }

    /// The full state (collective over the data- and tensor-parallel groups; every rank
    /// gets it).
    ///
    /// # Errors
    /// A failed collective or a malformed optimizer export.
    pub(super) fn gather_full_state(&self) -> Result<FullState> {
        let optim = self.optimizer.export_state();
        let shards = self.gather_optimizer_shards(&optim)?;
        let infos = self.buffer.params();
        let params_local: Vec<Vec<f32>> = (0..infos.len())
            .map(|i| self.buffer.param_to_f32(ParamId(i)))
            .collect();
        let mut optim_local: BTreeMap<String, Vec<Vec<f32>>> = BTreeMap::new();
        for (owned, arrays) in &shards {
            for (name, values) in arrays {
                let per_param = optim_local
                    .entry(name.clone())
                    .or_insert_with(|| infos.iter().map(|p| vec![0f32; p.numel]).collect());
                for (p, dst) in infos.iter().zip(per_param.iter_mut()) {
                    for (off, len, start) in owned_parts(p, owned) {
                        dst[off..off + len].copy_from_slice(&values[start..start + len]);
                    }
                }
            }
        }
        let params = self.model.gather_tensor_parallel(params_local)?;
        let optim_full = optim_local
            .into_iter()
            .map(|(name, local)| Ok((name, self.model.gather_tensor_parallel(local)?)))
            .collect::<Result<_>>()?;
        Ok(FullState {
            params,
            optim: optim_full,
            meta: optim.meta,
        })
    }

    /// Every data-parallel rank's owned ranges and f32 optimizer arrays: this rank's alone,
    /// or, with the distributed optimizer, all ranks' shards gathered (collective; the shards
    /// have equal lengths because every bucket splits evenly over the group).
    fn gather_optimizer_shards(&self, optim: &StateDict<OptimizerMeta>) -> Result<Vec<RankShard>> {
        let mut mine = BTreeMap::new();
        for (name, arr) in &optim.arrays {
            let StateArray::F32(values) = arr else {
                return Err(TrainError::Checkpoint(format!(
                    "optimizer array {name} is not f32"
                )));
            };
            mine.insert(name.clone(), values.clone());
        }
        let (rank, size) = (self.dp.rank(), self.dp.size());
        if !self.dp.use_distributed_optimizer() || size == 1 {
            return Ok(vec![(optim.meta.adam.owned.clone(), mine)]);
        }
        let mut out: Vec<RankShard> = (0..size)
            .map(|r| {
                Ok((
                    OwnedRanges::distributed_shard(&self.buffer, r, size)?,
                    BTreeMap::new(),
                ))
            })
            .collect::<Result<_>>()?;
        for (name, values) in mine {
            let n = values.len();
            let mut all = vec![0f32; n * size];
            all[rank * n..(rank + 1) * n].copy_from_slice(&values);
            self.dp.all_gather_in_place(&mut all)?;
            for (r, (_, arrays)) in out.iter_mut().enumerate() {
                arrays.insert(name.clone(), all[r * n..(r + 1) * n].to_vec());
            }
        }
        Ok(out)
    }
}
