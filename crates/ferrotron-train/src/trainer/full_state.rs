//! The layout-independent training state: every parameter and optimizer array of the FULL
//! model, assembled from the data-parallel shards of the distributed optimizer and the
//! tensor-parallel shards of the model (collective). Checkpoints store this form, so a run
//! saved under one layout resumes under any other (each rank cuts its part back out).

use std::collections::BTreeMap;

use ferrotron_optim::{OptimizerMeta, OwnedRanges, ParamId, StateArray, StateDict, Stateful};

use super::checkpoint::owned_parts;
use super::data_parallel::comm_err;
use super::{Result, TrainError, Trainer};

/// Full-model arrays, one per parameter in the order of [`ferrotron_model::GptModel::parameters`]
/// (pipeline stages after one another, the tied embedding's second copy dropped).
pub(super) struct FullState {
    /// Parameter names (Megatron's, global layer numbers).
    pub names: Vec<String>,
    /// Full shapes.
    pub shapes: Vec<Vec<usize>>,
    /// Weights, widened to f32.
    pub params: Vec<Vec<f32>>,
    /// Optimizer arrays by name (`exp_avg`, `exp_avg_sq`, `master`), each per parameter,
    /// flattened.
    pub optim: BTreeMap<String, Vec<Vec<f32>>>,
    /// Optimizer scalars (step, loss scaler, skipped steps).
    pub meta: OptimizerMeta,
}

/// `(name, values)` of every parameter.
pub type NamedParams = Vec<(String, Vec<f32>)>;

/// One data-parallel rank's owned flat ranges and its optimizer arrays (name -> values).
type RankShard = (OwnedRanges, BTreeMap<String, Vec<f32>>);

impl Trainer {
    /// The rank that writes checkpoints: data-, tensor- and pipeline-parallel rank 0.
    pub(super) fn is_writer(&self) -> bool {
        let tp_rank = self.model.tensor_parallel().map_or(0, |t| t.group.rank());
        let stage = self.pp.as_ref().map_or(0, |p| p.stage());
        self.dp.rank() == 0 && tp_rank == 0 && stage == 0
    }

    /// Waits for every rank of the data-, tensor- and pipeline-parallel groups.
    pub(super) fn barrier_all(&self) -> Result<()> {
        self.dp.barrier()?;
        if let Some(tp) = self.model.tensor_parallel() {
            tp.group.comm().barrier().map_err(comm_err)?;
        }
        if let Some(pp) = &self.pp {
            pp.comm().barrier().map_err(comm_err)?;
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
        self.gather_state(true)
    }

    /// The full model's named parameters (f32), gathered over tensor and pipeline
    /// parallelism: `Some` on the checkpoint writer (world rank 0), `None` elsewhere.
    /// Collective (every rank calls it), e.g. to export the trained model.
    ///
    /// # Errors
    /// A failed collective.
    pub fn gather_model_parameters(&self) -> Result<Option<NamedParams>> {
        let state = self.gather_state(false)?;
        Ok(self
            .is_writer()
            .then(|| state.names.into_iter().zip(state.params).collect()))
    }

    /// [`gather_full_state`](Self::gather_full_state), the optimizer arrays only when
    /// `with_optimizer`.
    fn gather_state(&self, with_optimizer: bool) -> Result<FullState> {
        let mut optim = self.optimizer.export_state();
        if !with_optimizer {
            optim.arrays.clear();
        }
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
        let state = FullState {
            names: infos.iter().map(|p| p.name.clone()).collect(),
            shapes: self.global_shapes(),
            params,
            optim: optim_full,
            meta: optim.meta,
        };
        // Only the writer's pipeline (data- and tensor-parallel rank 0 on every stage) needs
        // the stages put together; every rank of a pipeline shares those coordinates.
        let tp_rank = self.model.tensor_parallel().map_or(0, |t| t.group.rank());
        match &self.pp {
            Some(pp) if self.dp.rank() == 0 && tp_rank == 0 => gather_stages(pp, state),
            _ => Ok(state),
        }
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

/// Stage 0 of the pipeline gets every stage's full state appended to its own (stage order;
/// a name seen before, the tied embedding's last-stage copy, is dropped); the other stages
/// keep theirs. Collective over the pipeline group: each later stage sends a JSON header
/// (names, shapes, optimizer array names) and then every array to stage 0.
fn gather_stages(pp: &super::PipelineParallel, mut state: FullState) -> Result<FullState> {
    use ferrotron_comm::Collectives;
    let comm = pp.comm();
    let err = |e: serde_json::Error| TrainError::Checkpoint(format!("pipeline state header: {e}"));
    if pp.stage() > 0 {
        let arrays: Vec<&String> = state.optim.keys().collect();
        let header = serde_json::to_vec(&(&state.names, &state.shapes, arrays)).map_err(err)?;
        comm.send(&(header.len() as u64).to_le_bytes(), 0)
            .map_err(comm_err)?;
        comm.send(&header, 0).map_err(comm_err)?;
        for values in state.params.iter().chain(state.optim.values().flatten()) {
            comm.send(values, 0).map_err(comm_err)?;
        }
        return Ok(state);
    }
    for stage in 1..pp.stages() {
        let mut len = [0u8; 8];
        comm.recv(&mut len, stage).map_err(comm_err)?;
        let mut header = vec![0u8; u64::from_le_bytes(len) as usize];
        comm.recv(&mut header, stage).map_err(comm_err)?;
        let (names, shapes, arrays): (Vec<String>, Vec<Vec<usize>>, Vec<String>) =
            serde_json::from_slice(&header).map_err(err)?;
        let mut receive = |shape: &Vec<usize>| -> Result<Vec<f32>> {
            let mut v = vec![0f32; shape.iter().product()];
            comm.recv(&mut v, stage).map_err(comm_err)?;
            Ok(v)
        };
        let mut params: Vec<Vec<f32>> = shapes.iter().map(&mut receive).collect::<Result<_>>()?;
        let mut optim: Vec<Vec<Vec<f32>>> = Vec::with_capacity(arrays.len());
        for _ in &arrays {
            optim.push(shapes.iter().map(&mut receive).collect::<Result<_>>()?);
        }
        for (i, name) in names.iter().enumerate() {
            if state.names.contains(name) {
                continue;
            }
            state.names.push(name.clone());
            state.shapes.push(shapes[i].clone());
            state.params.push(std::mem::take(&mut params[i]));
            for (array, per_param) in arrays.iter().zip(optim.iter_mut()) {
                if let Some(dst) = state.optim.get_mut(array) {
                    dst.push(std::mem::take(&mut per_param[i]));
                }
            }
        }
    }
    Ok(state)
}
