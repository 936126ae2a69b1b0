//! Pipeline parallelism in the [`Trainer`](super::Trainer): each rank holds one stage of the
//! model ([`GptModel::pipeline_stage`](ferrotron_model::GptModel::pipeline_stage)) and runs
//! its 1F1B program ([`one_f_one_b`]) over the step's micro-batches, exchanging activations
//! and their gradients `[local rows, h]` with the neighbouring stages (Megatron-Core
//! `forward_backward_pipelining_without_interleaving`). After the schedule, the tied
//! embedding's two copies (first and last stage) have their gradients all-reduced over the
//! embedding group (`finalize_model_grads`), so they stay equal.

use std::collections::HashMap;
use std::sync::Arc;

use ferrotron_comm::{Collectives, Communicator, ReduceOp};
use ferrotron_model::{StageForward, TrainBatch};

use super::data_parallel::comm_err;
use super::{Result, TrainError, Trainer};
use crate::pipeline::{Action, one_f_one_b};

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

    fn prev(&self) -> usize {
        self.stage() - 1
    }

    fn next(&self) -> usize {
        self.stage() + 1
    }
}

impl Trainer {
    /// Runs this stage's 1F1B program over `batches` (every stage gets the same
    /// micro-batches; only the first reads tokens and the last labels), accumulating the
    /// stage's gradients. Returns the loss sum (`Σ mask·CE`, summed over the pipeline group
    /// so every stage reports it).
    pub(super) fn run_pipeline(
        &mut self,
        pp: &PipelineParallel,
        batches: &[TrainBatch],
        total: f64,
        loss_scale: f32,
    ) -> Result<f64> {
        let program = one_f_one_b(pp.stages(), pp.stage(), batches.len());
        let comm = pp.comm.clone();
        let mut inputs: HashMap<usize, Vec<f32>> = HashMap::new();
        let mut outputs: HashMap<usize, Vec<f32>> = HashMap::new();
        let mut douts: HashMap<usize, Vec<f32>> = HashMap::new();
        let mut dins: HashMap<usize, Vec<f32>> = HashMap::new();
        let mut states: HashMap<usize, StageForward> = HashMap::new();
        let mut loss_sum = 0.0;
        let take = |m: &mut HashMap<usize, Vec<f32>>, mb: usize, what: &str| {
            m.remove(&mb).ok_or_else(|| {
                TrainError::Config(format!("pipeline schedule: no {what} for micro-batch {mb}"))
            })
        };
        for action in program {
            match action {
                Action::RecvForward { mb, .. } => {
                    let mut x = vec![0f32; self.model.activation_len(&batches[mb])?];
                    comm.recv(&mut x, pp.prev()).map_err(comm_err)?;
                    inputs.insert(mb, x);
                }
                Action::Forward { mb, .. } => {
                    let batch = &batches[mb];
                    let scale = if total > 0.0 {
                        (batch.loss_token_count() / total) as f32 * loss_scale
                    } else {
                        0.0
                    };
                    let mut state = self.model.stage_forward(batch, inputs.remove(&mb), scale)?;
                    match state.loss() {
                        Some(loss) => loss_sum += loss.loss_sum,
                        None => {
                            outputs.insert(mb, state.take_output());
                        }
                    }
                    states.insert(mb, state);
                }
                Action::SendForward { mb, .. } => {
                    let y = take(&mut outputs, mb, "output")?;
                    comm.send(&y, pp.next()).map_err(comm_err)?;
                }
                Action::RecvBackward { mb, .. } => {
                    let mut d = vec![0f32; self.model.activation_len(&batches[mb])?];
                    comm.recv(&mut d, pp.next()).map_err(comm_err)?;
                    douts.insert(mb, d);
                }
                Action::Backward { mb, .. } => {
                    let state = states.remove(&mb).ok_or_else(|| {
                        TrainError::Config(format!(
                            "pipeline schedule: backward of {mb} before its forward"
                        ))
                    })?;
                    let mut grads = self.buffer.grad_slices_mut();
                    let din = self.model.stage_backward(
                        &batches[mb],
                        state,
                        &mut grads,
                        douts.remove(&mb),
                    )?;
                    if let Some(d) = din {
                        dins.insert(mb, d);
                    }
                }
                Action::SendBackward { mb, .. } => {
                    let d = take(&mut dins, mb, "input gradient")?;
                    comm.send(&d, pp.prev()).map_err(comm_err)?;
                }
            }
        }
        comm.all_reduce_scalar(loss_sum, ReduceOp::Sum)
            .map_err(comm_err)
    }

    /// Forward-only loss sum of `batches` through the pipeline (validation): each stage
    /// receives, runs and passes on every micro-batch in turn; the last sums the losses,
    /// which the pipeline group then shares.
    pub(super) fn evaluate_pipeline(
        &self,
        pp: &PipelineParallel,
        batches: &[TrainBatch],
    ) -> Result<f64> {
        let comm = &pp.comm;
        let mut sum = 0.0;
        for batch in batches {
            let input = if self.model.is_pre_process() {
                None
            } else {
                let mut x = vec![0f32; self.model.activation_len(batch)?];
                comm.recv(&mut x, pp.prev()).map_err(comm_err)?;
                Some(x)
            };
            let mut state = self.model.stage_forward(batch, input, 0.0)?;
            match state.loss() {
                Some(loss) => sum += loss.loss_sum,
                None => comm
                    .send(&state.take_output(), pp.next())
                    .map_err(comm_err)?,
            }
        }
        comm.all_reduce_scalar(sum, ReduceOp::Sum).map_err(comm_err)
    }

    /// `finalize_model_grads` for pipelines: the tied embedding's gradient summed over its
    /// two copies (first and last stage).
    pub(super) fn reduce_shared_embedding_grads(&mut self, pp: &PipelineParallel) -> Result<()> {
        let Some(group) = &pp.embedding else {
            return Ok(());
        };
        if group.size() < 2 || self.model.output_layer.is_some() {
            return Ok(());
        }
        let id = self.buffer.id("embedding.word_embeddings.weight")?;
        group
            .all_reduce(self.buffer.grad_mut(id), ReduceOp::Sum)
            .map_err(comm_err)
    }
}
