//! Running a model one piece at a time: a pipeline stage's (or model chunk's) forward and
//! backward of one micro-batch ([`GptModel::stage_forward`], [`GptModel::stage_backward`]),
//! and the forward of a layer group ([`GptModel::part_forward`], for
//! `overlap_param_gather`). What the forward keeps waits in a [`StageForward`].

use super::{GradReady, LossStats, NoGradHook, TrainBatch, forward, memory};
use crate::{GptModel, ModelError, Result};

impl GptModel {
    /// A pipeline stage's forward of one micro-batch through model chunk `chunk` (0 without
    /// interleaving; see [`GptModel::pipeline_chunks`]): from token ids on the first virtual
    /// stage (`input = None`) or from the previous virtual stage's output `[local rows, h]`;
    /// on the last virtual stage also the loss and the gradient of `loss_scale · loss` with
    /// respect to the logits (as [`GptModel::forward_backward`]). The result waits for
    /// [`GptModel::stage_backward`]; take the output for the next stage from it first.
    ///
    /// # Errors
    /// As [`GptModel::forward_backward`], a chunk the stage does not hold, or an input that
    /// does not fit the stage.
    pub fn stage_forward(
        &self,
        batch: &TrainBatch,
        chunk: usize,
        input: Option<Vec<f32>>,
        loss_scale: f32,
    ) -> Result<StageForward> {
        let part = self.chunk_part(chunk)?;
        self.run_forward(batch, part, input, loss_scale)
    }

    /// [`GptModel::stage_forward`] of `part`.
    fn run_forward(
        &self,
        batch: &TrainBatch,
        part: crate::pipeline_stage::ChunkPart,
        input: Option<Vec<f32>>,
        loss_scale: f32,
    ) -> Result<StageForward> {
        batch.validate(self)?;
        self.local_config().validate_recompute()?;
        let mut ledger = memory::Ledger::default();
        let post_process = part.post_process;
        let mut acts = self.train_forward(batch, part, input, Some(loss_scale), &mut ledger)?;
        let loss = if post_process {
            let mut loss = self.loss_and_logit_grad(batch, &mut acts, loss_scale)?;
            loss.moe = acts.moe_losses;
            Some(loss)
        } else {
            None
        };
        Ok(StageForward { acts, ledger, loss })
    }

    /// The forward of the decoder layers `layers` of a model without interleaving (a whole
    /// model or a pipeline stage): the embedding first when `layers` starts at 0 on the
    /// first stage, the head and loss after when it ends at the last layer of the last stage.
    /// `layers` must be made of whole [`GptModel::layer_groups`]. Running the groups in turn,
    /// each from the previous one's output, then their backwards in reverse
    /// ([`GptModel::stage_backward_with`]) gives [`GptModel::stage_forward`]'s results bit
    /// for bit; between them the caller may change the parameters of layers not yet run
    /// (`overlap_param_gather`).
    ///
    /// # Errors
    /// As [`GptModel::stage_forward`], `layers` empty or outside the model, or a stage of
    /// several model chunks.
    pub fn part_forward(
        &self,
        batch: &TrainBatch,
        layers: std::ops::Range<usize>,
        input: Option<Vec<f32>>,
        loss_scale: f32,
    ) -> Result<StageForward> {
        let n = self.layers().len();
        if self.num_chunks() > 1 || layers.is_empty() || layers.end > n {
            return Err(ModelError::Input(format!(
                "part_forward of layers {layers:?}: needs a range inside the {n} layers of a \
                 model of one chunk"
            )));
        }
        let mut part = self.chunk_part(0)?;
        part.pre_process &= layers.start == 0;
        part.post_process &= layers.end == n;
        part.layers = layers;
        self.run_forward(batch, part, input, loss_scale)
    }

    /// Index range (order of [`GptModel::parameters`]) of the parameters that
    /// [`GptModel::part_forward`] of `layers` reads: the embedding with the first layers of
    /// the first stage, the layers' own, and the final norm and output layer with the last
    /// layers of the last stage (a tied output weight is the embedding, index 0).
    pub fn part_params(&self, layers: std::ops::Range<usize>) -> std::ops::Range<usize> {
        let total = self.layout().decls().len();
        let first = |i: usize| self.layers().get(i).map_or(total, |l| l.params.start);
        let start = if layers.start == 0 {
            0
        } else {
            first(layers.start)
        };
        let end = if layers.end == self.layers().len() {
            total
        } else {
            first(layers.end)
        };
        start..end
    }

    /// The backward of a [`StageForward`] (through the chunk it ran): accumulates into
    /// `grads` (order of [`GptModel::parameters`]) from `dout`, the gradient of the chunk's
    /// output (`None` on the last virtual stage, whose loss gradient is already in the
    /// forward's logits); returns the gradient of the chunk's input for the previous virtual
    /// stage (`None` on the first).
    ///
    /// # Errors
    /// Gradient slices or `dout` that do not fit, or a failed collective.
    pub fn stage_backward(
        &self,
        batch: &TrainBatch,
        forward: StageForward,
        grads: &mut [&mut [f32]],
        dout: Option<Vec<f32>>,
    ) -> Result<Option<Vec<f32>>> {
        let backward = self.stage_backward_with(batch, forward, grads, dout, &mut NoGradHook)?;
        Ok(backward.input_grad)
    }

    /// [`GptModel::stage_backward`], telling `ready` as parameter gradients become final;
    /// also returns the pass's activation peak.
    ///
    /// # Errors
    /// As [`GptModel::stage_backward`].
    pub fn stage_backward_with(
        &self,
        batch: &TrainBatch,
        forward: StageForward,
        grads: &mut [&mut [f32]],
        dout: Option<Vec<f32>>,
        ready: &mut (dyn GradReady + Send),
    ) -> Result<StageBackward> {
        self.check_grads(batch, grads)?;
        let StageForward {
            acts, mut ledger, ..
        } = forward;
        let input_grad = self.train_backward(batch, acts, grads, &mut ledger, ready, dout)?;
        Ok(StageBackward {
            input_grad,
            activation_peak_bytes: ledger.peak(),
        })
    }
}

/// What [`GptModel::stage_backward_with`] gives back.
pub struct StageBackward {
    /// The gradient of the chunk's input `[local rows, h]` for the previous virtual stage
    /// (`None` on the first).
    pub input_grad: Option<Vec<f32>>,
    /// The most activation bytes the pass (its forward and this backward) held at once, as
    /// the activation ledger counts them.
    pub activation_peak_bytes: u128,
}

/// One micro-batch's forward on a pipeline stage, kept for its backward
/// ([`GptModel::stage_forward`]).
pub struct StageForward {
    acts: forward::Activations,
    ledger: memory::Ledger,
    loss: Option<LossStats>,
}

impl StageForward {
    /// The loss (last stage only).
    pub fn loss(&self) -> Option<LossStats> {
        self.loss
    }

    /// The balancing losses of the MoE layers this stage ran (every stage; zero without
    /// MoE layers). The last stage's [`StageForward::loss`] carries its own too.
    pub fn moe_losses(&self) -> super::MoeLosses {
        self.acts.moe_losses
    }

    /// Activation bytes this forward holds for its backward (the activation ledger's).
    pub fn activation_bytes(&self) -> u128 {
        self.ledger.held()
    }

    /// The most activation bytes the forward held at once.
    pub fn activation_peak_bytes(&self) -> u128 {
        self.ledger.peak()
    }

    /// The stage's output `[local rows, h]` for the next stage (empty on the last stage, and
    /// after the first call).
    pub fn take_output(&mut self) -> Vec<f32> {
        std::mem::take(&mut self.acts.x_final).into_host()
    }
}
