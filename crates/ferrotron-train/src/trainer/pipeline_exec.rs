//! Pipeline parallelism in the [`Trainer`](super::Trainer): each rank holds one stage of the
//! model ([`GptModel::pipeline_stage`](ferrotron_model::GptModel::pipeline_stage)) and runs
//! its 1F1B program ([`one_f_one_b`]) over the step's micro-batches, exchanging activations
//! and their gradients `[local rows, h]` with the neighbouring stages (Megatron-Core
//! `forward_backward_pipelining_without_interleaving`). A stage of several model chunks
//! ([`GptModel::pipeline_chunks`](ferrotron_model::GptModel::pipeline_chunks)) runs the
//! interleaved program ([`interleaved_one_f_one_b`], `..._with_interleaving`) instead: the
//! virtual stages form a ring, the last rank's chunk `c` feeding rank 0's chunk `c + 1`.
//! After the schedule, the tied embedding's two copies (first and last stage) have their
//! gradients all-reduced over the embedding group (`finalize_model_grads`), so they stay
//! equal.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use ferrotron_comm::{AsyncComm, Collectives, Communicator, ReduceOp};
use ferrotron_model::{
    DpoStats, GptModel, GradReady, LossStats, MoeLosses, Objective, StageForward, StageLogps,
    TrainBatch,
};

use super::activation_peak::ActivationPeak;
use super::data_parallel::comm_err;
use super::param_shards::UnitForward;
use super::{Result, TrainError, Trainer};
use crate::pipeline::{Action, PipelineRank, interleaved_one_f_one_b, one_f_one_b};

/// A rank's pipeline group and, on the first and last stage, the embedding group.
#[derive(Clone)]
pub struct PipelineParallel {
    comm: Arc<dyn Communicator>,
    embedding: Option<Arc<dyn Communicator>>,
}

impl std::fmt::Debug for PipelineParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelineParallel")
            .field("stage", &self.comm.rank())
            .field("stages", &self.comm.size())
            .finish()
    }
}

impl PipelineParallel {
    /// Stage `comm.rank()` of `comm.size()`; `embedding` is Megatron's embedding group
    /// (first + last stage), `None` on middle stages.
    pub fn new(comm: Arc<dyn Communicator>, embedding: Option<Arc<dyn Communicator>>) -> Self {
        PipelineParallel { comm, embedding }
    }

    /// This rank's stage.
    pub fn stage(&self) -> usize {
        self.comm.rank()
    }

    /// Pipeline stages.
    pub fn stages(&self) -> usize {
        self.comm.size()
    }

    /// The pipeline group.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// This rank in the (virtual) pipeline of `chunks` model chunks per stage.
    fn rank(&self, chunks: usize) -> PipelineRank {
        PipelineRank {
            pp: self.stages(),
            rank: self.stage(),
            vp: chunks,
        }
    }
}

/// Values in flight per (micro-batch, model chunk).
type Pending<T> = HashMap<(usize, usize), T>;

fn take<T>(m: &mut Pending<T>, key: (usize, usize), what: &str) -> Result<T> {
    m.remove(&key).ok_or_else(|| {
        TrainError::Config(format!(
            "pipeline schedule: no {what} for micro-batch {} chunk {}",
            key.0, key.1
        ))
    })
}

/// What the last stage's losses add up to, shared with every stage of the pipeline.
#[derive(Default)]
pub(super) struct PipelineSums {
    /// `Σ mask·CE` (or the pair losses' sum).
    pub loss_sum: f64,
    /// Under DPO or a reward model: the pairs' statistics.
    pub dpo: Option<DpoStats>,
    /// The MoE layers' balancing losses of every stage (each stage adds its own).
    pub moe: MoeLosses,
    /// Time this stage waited for ZeRO-3's parameter gathers.
    pub gather_wait: Duration,
    /// This stage's activation peak over the schedule (its own, not shared).
    pub activation_peak: u128,
}

/// A model chunk's forward of one micro-batch, kept for its backward: in one piece, or
/// (ZeRO-3) layer group by layer group with their parameters gathered around each.
enum ChunkForward {
    Whole(Box<StageForward>),
    Units(UnitForward),
}

impl ChunkForward {
    fn loss(&self) -> Option<LossStats> {
        match self {
            ChunkForward::Whole(s) => s.loss(),
            ChunkForward::Units(u) => u.loss(),
        }
    }

    fn moe_losses(&self) -> MoeLosses {
        match self {
            ChunkForward::Whole(s) => s.moe_losses(),
            ChunkForward::Units(u) => u.moe_losses(),
        }
    }

    fn take_output(&mut self) -> Vec<f32> {
        match self {
            ChunkForward::Whole(s) => s.take_output(),
            ChunkForward::Units(u) => u.take_output(),
        }
    }
}

impl PipelineSums {
    fn add(&mut self, loss: &LossStats) {
        self.loss_sum += loss.loss_sum;
        if let Some(d) = &loss.dpo {
            self.dpo.get_or_insert_default().add(d);
        }
    }

    /// The sums over the pipeline group (the last stage's, on every stage); `pairs`: the
    /// batches are pairs, whose statistics every stage then reports. Collective.
    fn shared(self, comm: &dyn Communicator, pairs: bool) -> Result<PipelineSums> {
        let dpo = self.dpo.unwrap_or_default().to_array();
        let moe = self.moe;
        let mut v = [
            self.loss_sum,
            moe.load_balancing_loss,
            moe.z_loss,
            moe.layers,
            dpo[0],
            dpo[1],
            dpo[2],
            dpo[3],
            dpo[4],
            dpo[5],
        ];
        comm.all_reduce(&mut v, ReduceOp::Sum).map_err(comm_err)?;
        let [loss_sum, lb, z, layers, rest @ ..] = v;
        Ok(PipelineSums {
            loss_sum,
            dpo: pairs.then(|| DpoStats::from_array(rest)),
            moe: MoeLosses {
                load_balancing_loss: lb,
                z_loss: z,
                layers,
            },
            gather_wait: self.gather_wait,
            activation_peak: self.activation_peak,
        })
    }
}

/// Runs every micro-batch of `batches` forward only through the pipeline of `model`'s stages,
/// chunk by chunk in turn: each virtual stage receives its input (none on the first), runs
/// `stage(index, batch, chunk, input)` and passes what it returns on to the next virtual
/// stage; `stage` returns `None` on the last, having kept what it computed there.
/// Collective over the pipeline group.
fn forward_only(
    model: &GptModel,
    pp: &PipelineParallel,
    batches: &[TrainBatch],
    mut stage: impl FnMut(usize, &TrainBatch, usize, Option<Vec<f32>>) -> Result<Option<Vec<f32>>>,
) -> Result<()> {
    let comm = &pp.comm;
    let place = pp.rank(model.num_chunks());
    for (index, batch) in batches.iter().enumerate() {
        for chunk in 0..place.vp {
            let input = if place.is_first(chunk) {
                None
            } else {
                let mut x = vec![0f32; model.activation_len(batch)?];
                comm.recv(&mut x, place.prev_rank()).map_err(comm_err)?;
                Some(x)
            };
            if let Some(y) = stage(index, batch, chunk, input)? {
                comm.send(&y, place.next_rank()).map_err(comm_err)?;
            }
        }
    }
    Ok(())
}

/// Each batch's summed row log-probs through the pipeline, forward only (DPO's reference
/// log-probs, `model` being this stage of the reference): `Some` on the last stage, `None`
/// before it. Collective over the pipeline group.
pub(super) fn pipeline_logps(
    model: &GptModel,
    pp: &PipelineParallel,
    batches: &[TrainBatch],
) -> Result<Vec<Option<Vec<f64>>>> {
    let mut out = vec![None; batches.len()];
    forward_only(model, pp, batches, |i, batch, chunk, input| {
        Ok(match model.stage_sequence_logps(batch, chunk, input)? {
            StageLogps::Logps(l) => {
                out[i] = Some(l);
                None
            }
            StageLogps::Output(y) => Some(y),
        })
    })?;
    Ok(out)
}

/// Whether `batches` are pairs (DPO or a reward model) rather than language modeling.
fn pairs(batches: &[TrainBatch]) -> bool {
    batches
        .iter()
        .any(|b| !matches!(b.objective, Objective::LanguageModel))
}

impl Trainer {
    /// Runs this stage's 1F1B program (interleaved when the stage holds several model
    /// chunks) over `batches` (every stage gets the same micro-batches; only the first reads
    /// tokens and the last labels), accumulating the stage's gradients (`ready` hears as
    /// each backward finishes them). Returns the loss sum
    /// (`Σ mask·CE`) and the pairs' statistics, shared over the pipeline group so every stage
    /// reports them.
    pub(super) fn run_pipeline(
        &mut self,
        pp: &PipelineParallel,
        batches: &[TrainBatch],
        total: f64,
        loss_scale: f32,
        ready: &mut (dyn GradReady + Send),
    ) -> Result<PipelineSums> {
        let place = pp.rank(self.model.num_chunks());
        let program = if place.vp > 1 {
            interleaved_one_f_one_b(place.pp, place.rank, batches.len(), place.vp)
                .map_err(TrainError::Config)?
        } else {
            one_f_one_b(place.pp, place.rank, batches.len())
        };
        let comm = pp.comm.clone();
        let mut inputs: Pending<Vec<f32>> = HashMap::new();
        let mut outputs: Pending<Vec<f32>> = HashMap::new();
        let mut douts: Pending<Vec<f32>> = HashMap::new();
        let mut dins: Pending<Vec<f32>> = HashMap::new();
        let mut states: Pending<ChunkForward> = HashMap::new();
        let mut sums = PipelineSums::default();
        let mut peak = ActivationPeak::default();
        let gather = self.dp.unit_gather_comm();
        for action in program {
            match action {
                Action::RecvForward { mb, chunk } => {
                    let mut x = vec![0f32; self.model.activation_len(&batches[mb])?];
                    comm.recv(&mut x, place.prev_rank()).map_err(comm_err)?;
                    inputs.insert((mb, chunk), x);
                }
                Action::Forward { mb, chunk } => {
                    let batch = &batches[mb];
                    let scale = if total > 0.0 {
                        (batch.loss_units() / total) as f32 * loss_scale
                    } else {
                        0.0
                    };
                    let input = inputs.remove(&(mb, chunk));
                    let io = (gather.as_deref(), &mut sums.gather_wait, &mut peak);
                    let mut state = self.chunk_forward(batch, chunk, input, scale, io)?;
                    sums.moe.add(&state.moe_losses());
                    match state.loss() {
                        Some(loss) => sums.add(&loss),
                        None => {
                            outputs.insert((mb, chunk), state.take_output());
                        }
                    }
                    states.insert((mb, chunk), state);
                }
                Action::SendForward { mb, chunk } => {
                    let y = take(&mut outputs, (mb, chunk), "output")?;
                    comm.send(&y, place.next_rank()).map_err(comm_err)?;
                }
                Action::RecvBackward { mb, chunk } => {
                    let mut d = vec![0f32; self.model.activation_len(&batches[mb])?];
                    comm.recv(&mut d, place.next_rank()).map_err(comm_err)?;
                    douts.insert((mb, chunk), d);
                }
                Action::Backward { mb, chunk } => {
                    let state = take(&mut states, (mb, chunk), "forward before the backward")?;
                    let dout = douts.remove(&(mb, chunk));
                    let batch = &batches[mb];
                    let io = (gather.as_deref(), &mut sums.gather_wait, &mut peak);
                    let din = self.chunk_backward(batch, state, dout, io, ready)?;
                    if let Some(d) = din {
                        dins.insert((mb, chunk), d);
                    }
                }
                Action::SendBackward { mb, chunk } => {
                    let d = take(&mut dins, (mb, chunk), "input gradient")?;
                    comm.send(&d, place.prev_rank()).map_err(comm_err)?;
                }
            }
        }
        sums.activation_peak = peak.peak();
        sums.shared(comm.as_ref(), pairs(batches))
    }

    /// A model chunk's forward of one micro-batch: layer group by layer group with ZeRO-3
    /// on a stage of one chunk (adding the time waited for gathers to `waited`), else whole;
    /// kept in `peak`.
    fn chunk_forward(
        &mut self,
        batch: &TrainBatch,
        chunk: usize,
        input: Option<Vec<f32>>,
        scale: f32,
        (gather, waited, peak): (Option<&AsyncComm>, &mut Duration, &mut ActivationPeak),
    ) -> Result<ChunkForward> {
        Ok(match self.param_shards.as_mut() {
            Some(shards) if self.model.num_chunks() == 1 => {
                let model = &mut self.model;
                let (units, w) = shards.forward(gather, model, batch, input, scale, peak)?;
                *waited += w;
                ChunkForward::Units(units)
            }
            _ => {
                let state = self.model.stage_forward(batch, chunk, input, scale)?;
                peak.forward(&state);
                ChunkForward::Whole(Box::new(state))
            }
        })
    }

    /// The backward of a [`Trainer::chunk_forward`] from `dout` (none on the last virtual
    /// stage), into the buffer's gradients, telling `ready`; returns the input's gradient
    /// (none on the first virtual stage).
    fn chunk_backward(
        &mut self,
        batch: &TrainBatch,
        state: ChunkForward,
        dout: Option<Vec<f32>>,
        (gather, waited, peak): (Option<&AsyncComm>, &mut Duration, &mut ActivationPeak),
        ready: &mut (dyn GradReady + Send),
    ) -> Result<Option<Vec<f32>>> {
        match (state, self.param_shards.as_mut()) {
            (ChunkForward::Units(units), Some(shards)) => {
                let (model, buffer) = (&mut self.model, &mut self.buffer);
                let io = (dout, peak);
                let (din, w) = shards.backward(gather, model, buffer, batch, units, io, ready)?;
                *waited += w;
                Ok(din)
            }
            (ChunkForward::Whole(state), _) => {
                let mut grads = self.buffer.grad_slices_mut();
                peak.backward(&self.model, batch, *state, (&mut grads, dout), ready)
            }
            (ChunkForward::Units(_), None) => Err(TrainError::Config(
                "a layer-group forward without sharded parameters".into(),
            )),
        }
    }

    /// Forward-only loss sum of `batches` through the pipeline (validation, [`forward_only`]):
    /// the last stage sums the losses (and the pairs' statistics), which the pipeline group
    /// then shares.
    pub(super) fn evaluate_pipeline(
        &self,
        pp: &PipelineParallel,
        batches: &[TrainBatch],
    ) -> Result<PipelineSums> {
        let mut sums = PipelineSums::default();
        forward_only(&self.model, pp, batches, |_, batch, chunk, input| {
            let mut state = self.model.stage_forward(batch, chunk, input, 0.0)?;
            Ok(match state.loss() {
                Some(loss) => {
                    sums.add(&loss);
                    None
                }
                None => Some(state.take_output()),
            })
        })?;
        sums.shared(pp.comm.as_ref(), pairs(batches))
    }

    /// `finalize_model_grads` for pipelines: the tied embedding's gradient summed over its
    /// two copies (first and last stage).
    pub(super) fn reduce_shared_embedding_grads(&mut self, pp: &PipelineParallel) -> Result<()> {
        let Some(group) = &pp.embedding else {
            return Ok(());
        };
        if group.size() < 2 || self.model.config().untie_embeddings_and_output_weights {
            return Ok(());
        }
        let id = self.buffer.id("embedding.word_embeddings.weight")?;
        group
            .all_reduce(self.buffer.grad_mut(id), ReduceOp::Sum)
            .map_err(comm_err)
    }
}
