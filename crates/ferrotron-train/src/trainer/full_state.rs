//! The full model's parameters gathered from the tensor-parallel shards and the pipeline
//! stages onto one rank (collective), e.g. to export the trained model to HF. Checkpoints do
//! not gather: every rank writes its own shards (`sharded.rs`).

use super::data_parallel::comm_err;
use super::{Result, TrainError, Trainer};

/// Full-model parameters in the order of [`ferrotron_model::GptModel::parameters`] (pipeline
/// stages after one another, the tied embedding's second copy dropped).
struct FullParams {
    /// Parameter names (Megatron's, global layer numbers).
    names: Vec<String>,
    /// Full shapes.
    shapes: Vec<Vec<usize>>,
    /// Weights, widened to f32.
    params: Vec<Vec<f32>>,
}

/// `(name, values)` of every parameter.
pub type NamedParams = Vec<(String, Vec<f32>)>;

impl Trainer {
    /// The rank that commits checkpoints and holds gathered state: data-, tensor- and
    /// pipeline-parallel rank 0.
    pub(super) fn is_writer(&self) -> bool {
        self.dp.rank() == 0 && self.tp_pp_rank() == (0, 0)
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

    /// The full model's named parameters (f32), gathered over tensor and pipeline
    /// parallelism: `Some` on world rank 0, `None` elsewhere. Collective (every rank calls
    /// it), e.g. to export the trained model.
    ///
    /// # Errors
    /// A failed collective.
    pub fn gather_model_parameters(&self) -> Result<Option<NamedParams>> {
        self.require_params_current("gather_model_parameters")?;
        let infos = self.buffer.params();
        let local = self.model.parameters_f32();
        let mut state = FullParams {
            names: infos.iter().map(|p| p.name.clone()).collect(),
            shapes: (0..infos.len())
                .map(|i| self.model.global_param_shape(i))
                .collect(),
            params: self.model.gather_tensor_parallel(local)?,
        };
        // Only the writer's pipeline (data- and tensor-parallel rank 0 on every stage) puts
        // the stages together; every rank of a pipeline shares those coordinates.
        if let Some(pp) = &self.pp
            && self.dp.rank() == 0
            && self.tp_pp_rank().0 == 0
        {
            state = gather_stages(pp, state)?;
        }
        Ok(self
            .is_writer()
            .then(|| state.names.into_iter().zip(state.params).collect()))
    }
}

/// Stage 0 of the pipeline gets every stage's parameters appended to its own (stage order;
/// a name seen before, the tied embedding's last-stage copy, is dropped); the other stages
/// keep theirs. Collective over the pipeline group: each later stage sends a JSON header
/// (names, shapes) and then every array to stage 0.
fn gather_stages(pp: &super::PipelineParallel, mut state: FullParams) -> Result<FullParams> {
    use ferrotron_comm::Collectives;
    let comm = pp.comm();
    let err = |e: serde_json::Error| TrainError::Checkpoint(format!("pipeline state header: {e}"));
    if pp.stage() > 0 {
        let header = serde_json::to_vec(&(&state.names, &state.shapes)).map_err(err)?;
        comm.send(&(header.len() as u64).to_le_bytes(), 0)
            .map_err(comm_err)?;
        comm.send(&header, 0).map_err(comm_err)?;
        for values in &state.params {
            comm.send(values, 0).map_err(comm_err)?;
        }
        return Ok(state);
    }
    for stage in 1..pp.stages() {
        let mut len = [0u8; 8];
        comm.recv(&mut len, stage).map_err(comm_err)?;
        let mut header = vec![0u8; u64::from_le_bytes(len) as usize];
        comm.recv(&mut header, stage).map_err(comm_err)?;
        let (names, shapes): (Vec<String>, Vec<Vec<usize>>) =
            serde_json::from_slice(&header).map_err(err)?;
        for (name, shape) in names.into_iter().zip(shapes) {
            let mut values = vec![0f32; shape.iter().product()];
            comm.recv(&mut values, stage).map_err(comm_err)?;
            if !state.names.contains(&name) {
                state.names.push(name);
                state.shapes.push(shape);
                state.params.push(values);
            }
        }
    }
    Ok(state)
}
