//! [`GptModel::forward_trace`]: the hidden state after every decoder layer and the logits of
//! one forward pass, on a whole model, a tensor-parallel shard or a pipeline stage — what
//! Pai-Megatron-Patch's `check_hf_mg_forward` compares between an HF model and its sharded
//! Megatron checkpoint.

use super::TrainBatch;
use super::forward::Saved;
use super::memory::Ledger;
use crate::{GptModel, ModelError, Result};

/// One forward pass, layer by layer.
#[derive(Clone, Debug, PartialEq)]
pub struct ForwardTrace {
    /// Global index of each layer traced (the stage's layers).
    pub layer_ids: Vec<usize>,
    /// The residual stream after each of this model's layers, `[local rows, h]` each (`[s,
    /// b]` row order; all rows unless sequence parallel).
    pub layer_outputs: Vec<Vec<f32>>,
    /// The logits `[rows, v_local]` (this rank's vocabulary shard, padding columns
    /// included) on the last stage; `None` before it.
    pub logits: Option<Vec<f32>>,
}

impl GptModel {
    /// Runs the training forward over `batch` (from token ids on the first stage, from
    /// `input` `[local rows, h]` on later ones) and keeps every layer's output and the
    /// logits. Collective on a tensor-parallel shard. The loss is not computed.
    ///
    /// # Errors
    /// As [`GptModel::stage_forward`], activation recompute switched on (the layer outputs
    /// are then not kept), or a stage of several model chunks.
    pub fn forward_trace(
        &self,
        batch: &TrainBatch,
        input: Option<Vec<f32>>,
    ) -> Result<ForwardTrace> {
        if self.local_config().recompute_granularity.is_some() {
            return Err(ModelError::Input(
                "forward_trace needs recompute_granularity = none".into(),
            ));
        }
        if self.num_chunks() > 1 {
            return Err(ModelError::Input(
                "forward_trace runs one model chunk per stage (no interleaving)".into(),
            ));
        }
        batch.validate(self)?;
        let part = self.chunk_part(0)?;
        let acts = self.train_forward(batch, part, input, None, &mut Ledger::default())?;
        let mut layer_outputs: Vec<Vec<f32>> = acts
            .saved
            .into_iter()
            .skip(1)
            .map(|s| match s {
                Saved::Layer { acts, .. } => acts.x.into_host(),
                Saved::Input { x, .. } => x.into_host(),
            })
            .collect();
        if !self.layers().is_empty() {
            layer_outputs.push(acts.x_final.into_host());
        }
        Ok(ForwardTrace {
            layer_ids: self.layers().iter().map(|l| l.number).collect(),
            layer_outputs,
            logits: self.is_post_process().then(|| acts.dlogits.into_host()),
        })
    }
}
