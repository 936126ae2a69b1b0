//! One rank's part of a distributed checkpoint (Megatron `dist_checkpointing` with the
//! distributed optimizer's `fully_sharded_model_space` format): every rank writes the boxes
//! of the full tensors it holds, each once, and reads back the boxes its own (possibly
//! different) layout needs.
//!
//! - Model weights: data-parallel rank 0 of every (tensor, pipeline) position writes
//!   `model_tp{t}_pp{p}.safetensors`: each parameter's tensor-parallel shard as boxes of the
//!   full tensor (`linear_fc1` as its gate and up boxes), replicated parameters by
//!   tensor-parallel rank 0 only, the last stage's copy of a tied embedding not at all.
//!   Under expert parallelism expert-parallel rank `e > 0` (data-parallel rank `e`) writes
//!   its experts' rows of every expert stack to `model_tp{t}_pp{p}_ep{e}.safetensors`.
//!   Buffers (the routers' expert biases, f32 whatever the weights' dtype) go to the writing
//!   rank's optimizer file, which is f32, under their model keys.
//! - Optimizer state (Adam moments, fp32 master weights): in the parameters' own full shapes;
//!   a distributed optimizer's flat owned ranges become boxes (a partial first row, whole
//!   rows, a partial last row), so every data-parallel rank writes
//!   `optim_tp{t}_pp{p}_dp{d}.safetensors` with just its shard; without it data-parallel
//!   rank 0 writes everything.
//!
//! The records of every rank's shards are gathered (data-parallel, then tensor-parallel, then
//! pipeline groups) to the committing rank, which writes `metadata.json`.

use ferrotron_checkpoint::convert::{expert_model_file, optim_file};
use ferrotron_checkpoint::dist::{
    CheckpointReader, CheckpointWriter, ShardFile, ShardSpec, StoredDtype, TensorRecords,
};
use ferrotron_comm::{Collectives, Communicator};
use ferrotron_model::ParamBox;
use ferrotron_optim::OwnedRanges;
use std::ops::Range;
use std::sync::Arc;

use super::checkpoint::{MODEL, OPTIM, ckpt_err, owned_parts, stored};
use super::data_parallel::comm_err;
use super::{Result, Trainer};

/// A shard to write: its spec and where its values come from.
struct Planned {
    spec: ShardSpec,
    /// Parameter index.
    param: usize,
    /// Start of the shard's values in the source array.
    start: usize,
}

impl Trainer {
    /// Tensor- and pipeline-parallel coordinates of this rank.
    pub(super) fn tp_pp_rank(&self) -> (usize, usize) {
        let tp = self.model.tensor_parallel().map_or(0, |t| t.group.rank());
        let pp = self.pp.as_ref().map_or(0, |p| p.stage());
        (tp, pp)
    }

    /// Writes this rank's model and optimizer shards through `writer`.
    pub(super) fn write_rank_shards(&self, writer: &mut CheckpointWriter) -> Result<()> {
        let (tp, pp) = self.tp_pp_rank();
        // Expert-parallel rank r (data-parallel rank r of the first expert-data-parallel
        // group, Megatron's grid) writes its experts; rank 0 everything else too.
        let ep = self.model.expert_parallel().map_or(1, |e| e.shard().size);
        if self.dp.rank() >= ep {
            return match self.dp.use_distributed_optimizer() {
                true => self.write_optimizer_shards(writer, &[]),
                false => Ok(()),
            };
        }
        let (weights, buffers) = self.plan_model();
        let specs: Vec<ShardSpec> = weights.iter().map(|p| p.spec.clone()).collect();
        let dtype = stored(self.buffer.param_dtype())?;
        let file = expert_model_file(tp, pp, self.dp.rank());
        let mut out = writer.open_file(&file, dtype, &specs).map_err(ckpt_err)?;
        self.push_model_boxes(&mut out, &weights)?;
        out.finish().map_err(ckpt_err)?;
        self.write_optimizer_shards(writer, &buffers)
    }

    /// The boxes this rank writes of the model's weights (frozen ones, a LoRA model's base,
    /// come from the base model) and, apart, of its buffers (the routers' expert biases),
    /// which are kept in f32 and so go to the f32 optimizer file (Megatron saves the fp32
    /// `expert_bias` in fp32 too).
    fn plan_model(&self) -> (Vec<Planned>, Vec<Planned>) {
        let (mut weights, mut buffers) = (Vec::new(), Vec::new());
        for (i, p) in self.buffer.params().iter().enumerate() {
            let buffer = self.model.is_buffer(i);
            if self.model.is_param_replica(i) || (p.flags.frozen && !buffer) {
                continue;
            }
            // The gradient buffer holds no elements of a frozen parameter.
            match buffer {
                true => {
                    let numel = self.model.param_table().numel(i);
                    self.plan(&mut buffers, MODEL, &p.name, i, 0..numel, 0);
                }
                false => self.plan(&mut weights, MODEL, &p.name, i, 0..p.numel, 0),
            }
        }
        (weights, buffers)
    }

    /// Pushes the model's values of `planned` (a parameter's boxes consecutive: each
    /// parameter is widened to f32 once for all of them).
    fn push_model_boxes(&self, out: &mut ShardFile, planned: &[Planned]) -> Result<()> {
        for boxes in planned.chunk_by(|a, b| a.param == b.param) {
            let values = self.model.parameter_f32(boxes[0].param)?;
            push_boxes(out, boxes, &values)?;
        }
        Ok(())
    }

    /// Writes this rank's optimizer file: its shards of the optimizer state and the model's
    /// `buffers` (f32; see [`Trainer::plan_model`]).
    fn write_optimizer_shards(
        &self,
        writer: &mut CheckpointWriter,
        buffers: &[Planned],
    ) -> Result<()> {
        let (tp, pp) = self.tp_pp_rank();
        let infos = self.buffer.params();
        let meta = self.optimizer.meta();
        let owned = &meta.adam.owned;
        // Per optimizer array: the boxes of its owned parts; its values are read one array
        // at a time below (an offloaded state never comes into RAM whole).
        let mut per_array = Vec::new();
        for name in meta.adam.array_names() {
            let prefix = format!("{OPTIM}{name}.");
            let mut planned = Vec::new();
            for (i, p) in infos.iter().enumerate() {
                // Frozen parameters (a LoRA model's base) come from the base model. Each
                // data-parallel rank owns its own shard under the distributed optimizer.
                let replica = if self.dp.use_distributed_optimizer() {
                    self.model.is_model_parallel_replica(i)
                } else {
                    self.model.is_param_replica(i)
                };
                if replica || p.flags.frozen {
                    continue;
                }
                for (off, len, start) in owned_parts(p, owned) {
                    self.plan(&mut planned, &prefix, &p.name, i, off..off + len, start);
                }
            }
            per_array.push((name, planned));
        }
        let specs: Vec<ShardSpec> = per_array
            .iter()
            .flat_map(|(_, planned)| planned)
            .chain(buffers)
            .map(|p| p.spec.clone())
            .collect();
        let file = optim_file(tp, pp, self.dp.rank());
        let mut out = writer
            .open_file(&file, StoredDtype::F32, &specs)
            .map_err(ckpt_err)?;
        for (name, planned) in &per_array {
            let values = self.optimizer.adam().state_array(name)?;
            push_boxes(&mut out, planned, &values)?;
        }
        self.push_model_boxes(&mut out, buffers)?;
        out.finish().map_err(ckpt_err)?;
        Ok(())
    }

    /// Plans the boxes of parameter `i`'s local elements `range`, whose values start at
    /// `start` of their source array, under the key `prefix + name`.
    fn plan(
        &self,
        planned: &mut Vec<Planned>,
        prefix: &str,
        name: &str,
        i: usize,
        range: Range<usize>,
        start: usize,
    ) {
        let global_shape = self.model.global_param_shape(i);
        let first = range.start;
        for b in self.model.param_boxes(i, range) {
            planned.push(Planned {
                spec: ShardSpec {
                    key: format!("{prefix}{name}"),
                    global_shape: global_shape.clone(),
                    global_offset: b.global_offset,
                    local_shape: b.shape,
                },
                param: i,
                start: start + b.local_start - first,
            });
        }
    }

    /// The local elements `range` of parameter `i` read from the checkpoint tensor `key`
    /// (vocabulary padding rows zero). A tensor stored flattened to `[numel]` (optimizer
    /// state of format-1 checkpoints written before sharded saving) is read whole and cut.
    pub(super) fn read_local(
        &self,
        reader: &CheckpointReader,
        key: &str,
        i: usize,
        range: Range<usize>,
    ) -> Result<Vec<f32>> {
        let mut out = vec![0f32; range.len()];
        let first = range.start;
        let boxes: Vec<ParamBox> = self.model.param_boxes(i, range);
        let global_shape = self.model.global_param_shape(i);
        let stored_shape = reader
            .metadata()
            .tensors
            .get(key)
            .map(|t| t.global_shape.clone());
        if let Some(flat) = stored_shape.filter(|s| s.len() == 1 && *s != global_shape) {
            let all = reader.read(key).map_err(ckpt_err)?;
            if flat[0] != global_shape.iter().product::<usize>() {
                return Err(ckpt_err(format!(
                    "{}: tensor {key} has shape {flat:?}, expected {global_shape:?}",
                    reader.dir().display()
                )));
            }
            let cols: usize = global_shape[1..].iter().product();
            for b in &boxes {
                let width = b.shape[1..].iter().product::<usize>();
                for r in 0..b.shape[0] {
                    let col = b.global_offset.get(1).copied().unwrap_or(0);
                    let src = (b.global_offset[0] + r) * cols + col;
                    let dst = b.local_start - first + r * width;
                    out[dst..dst + width].copy_from_slice(&all[src..src + width]);
                }
            }
            return Ok(out);
        }
        let relative: Vec<ParamBox> = boxes
            .into_iter()
            .map(|b| ParamBox {
                local_start: b.local_start - first,
                ..b
            })
            .collect();
        reader
            .read_local(key, &relative, out.len())
            .map_err(ckpt_err)
    }

    /// This rank's local values (its owned parts, local indexing over `owned`) of the
    /// optimizer array `name`, read from the checkpoint.
    pub(super) fn read_optimizer_array(
        &self,
        reader: &CheckpointReader,
        name: &str,
        owned: &OwnedRanges,
    ) -> Result<Vec<f32>> {
        let mut values = vec![0f32; owned.local_len()];
        for (i, p) in self.buffer.params().iter().enumerate() {
            let key = format!("{OPTIM}{name}.{}", p.name);
            for (off, len, start) in owned_parts(p, owned) {
                let part = self.read_local(reader, &key, i, off..off + len)?;
                values[start..start + len].copy_from_slice(&part);
            }
        }
        Ok(values)
    }

    /// Sends `mine` (this rank's shard records; `None` on the committing rank, which keeps its
    /// own) towards the committing rank: gathered within the data-parallel group to its rank
    /// 0, then within the tensor-parallel group, then the pipeline group. The committing rank
    /// gets every other rank's records; the others get nothing. Collective.
    pub(super) fn gather_records(&self, mine: Option<TensorRecords>) -> Result<Vec<TensorRecords>> {
        let encode = |r: &TensorRecords| {
            serde_json::to_vec(r).map_err(|e| ckpt_err(format!("shard records: {e}")))
        };
        let mut held = mine
            .as_ref()
            .map(encode)
            .transpose()?
            .into_iter()
            .collect::<Vec<_>>();
        let mut levels: Vec<&Arc<dyn Communicator>> = vec![self.dp.comm()];
        if let Some(tp) = self.model.tensor_parallel() {
            levels.push(tp.group.comm());
        }
        if let Some(pp) = &self.pp {
            levels.push(pp.comm());
        }
        for comm in levels {
            if comm.rank() > 0 {
                for payload in &held {
                    comm.send(&(payload.len() as u64).to_le_bytes(), 0)
                        .map_err(comm_err)?;
                    comm.send(payload, 0).map_err(comm_err)?;
                }
                comm.send(&u64::MAX.to_le_bytes(), 0).map_err(comm_err)?;
                return Ok(Vec::new());
            }
            for src in 1..comm.size() {
                loop {
                    let mut len = [0u8; 8];
                    comm.recv(&mut len, src).map_err(comm_err)?;
                    let len = u64::from_le_bytes(len);
                    if len == u64::MAX {
                        break;
                    }
                    let mut payload = vec![0u8; len as usize];
                    comm.recv(&mut payload, src).map_err(comm_err)?;
                    held.push(payload);
                }
            }
        }
        held.iter()
            .map(|p| serde_json::from_slice(p).map_err(|e| ckpt_err(format!("shard records: {e}"))))
            .collect()
    }
}

/// Appends each planned box's values, taken from `values` (the array they start in).
fn push_boxes(out: &mut ShardFile, planned: &[Planned], values: &[f32]) -> Result<()> {
    for p in planned {
        let n: usize = p.spec.local_shape.iter().product();
        out.push(&values[p.start..p.start + n]).map_err(ckpt_err)?;
    }
    Ok(())
}
