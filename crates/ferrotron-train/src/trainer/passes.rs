//! The parts of one [`Trainer::train_step`]: the global batch and its loss-token count, the
//! forward and backward passes (micro-batch after micro-batch, or the pipeline schedule)
//! with the data-parallel gradient reduction, and the optimizer update with the parameter
//! all-gather (Megatron's `forward_backward_func`, `finalize_model_grads` and
//! `optimizer.step` inside `train_step`).

use super::activation_peak::ActivationPeak;
use super::grad_shards::GradShards;
use super::overlap::BucketOverlap;
use super::param_gather::ParamGather;
use super::step::with_params_in_buffer;
use super::{PipelineParallel, Result, TrainError, Trainer};
use ferrotron_data::MicroBatch;
use ferrotron_model::{
    DpoStats, GptModel, GradReady, LossStats, MoeLosses, NoGradHook, TrainBatch,
};
use ferrotron_nn::lora::mix;
use ferrotron_optim::{ParamAndGradBuffer, StepOutcome};
use std::time::{Duration, Instant};

/// What the forward and backward passes of a step did on this rank.
pub(super) struct Pass {
    /// `Σ mask·CE` of this rank's micro-batches (every pipeline stage reports the last
    /// stage's).
    pub loss_sum: f64,
    /// Input tokens of this rank's micro-batches.
    pub tokens: usize,
    /// Time waited for the data-parallel gradient reduction.
    pub comm_wait: Duration,
    /// Time waited for the last step's parameter all-gathers (`overlap_param_gather`).
    pub gather_wait: Duration,
    /// DPO's metrics summed over this rank's pairs.
    pub dpo: Option<DpoStats>,
    /// The MoE layers' balancing losses over this rank's micro-batches (and, in a
    /// pipeline, over its stages).
    pub moe: MoeLosses,
    /// The largest activation peak of this rank's passes (0 where not measured: pipeline
    /// stages).
    pub activation_peak: u128,
}

impl Trainer {
    /// This rank's `num_microbatches` loader micro-batches as the model's batches (with
    /// their DPO targets under DPO), and the loss units (tokens, or pairs) of the whole
    /// global batch (summed over the data-parallel ranks; collective).
    ///
    /// # Errors
    /// The wrong number of micro-batches, malformed ones, or a failed all-reduce.
    pub(super) fn global_batch(
        &mut self,
        micro_batches: &[MicroBatch],
    ) -> Result<(Vec<TrainBatch>, f64)> {
        let want = self.options.num_microbatches();
        if micro_batches.len() != want {
            return Err(TrainError::Config(format!(
                "{} micro-batches given, a global batch has {want}",
                micro_batches.len()
            )));
        }
        let mut batches = micro_batches
            .iter()
            .map(|mb| self.to_train_batch(mb))
            .collect::<Result<Vec<_>>>()?;
        self.attach_objective(&mut batches, micro_batches)?;
        if self
            .model
            .config()
            .lora
            .as_ref()
            .is_some_and(|l| l.dropout > 0.0)
        {
            // LoRA dropout masks keyed by the seed, the iteration and each row's sample: the
            // same for a sample whichever rank, micro-batch or row it lands in.
            let step = mix(self.options.seed ^ mix(self.iteration));
            for (batch, mb) in batches.iter_mut().zip(micro_batches) {
                let keys = mb.sample_indices.iter().map(|&i| mix(step ^ i as u64));
                batch.dropout_keys = Some(keys.collect());
            }
        }
        let mut total = [batches.iter().map(TrainBatch::loss_units).sum::<f64>()];
        self.dp.sum(&mut total)?;
        Ok((batches, total[0]))
    }

    /// The pipeline schedule over `batches` (after the last step's parameter all-gathers:
    /// the pipeline's forwards do not wait per layer; under ZeRO-3 a stage of one model
    /// chunk gathers its weights layer group by layer group around each pass, an
    /// interleaved stage whole for the schedule), the tied embedding's gradient over its
    /// two copies,
    /// then the data-parallel gradient reduction (ZeRO-2/3: each backward's, into the
    /// shards).
    pub(super) fn pipeline_pass(
        &mut self,
        pp: &PipelineParallel,
        batches: &[TrainBatch],
        total: f64,
        loss_scale: f32,
    ) -> Result<Pass> {
        // ZeRO-3 gathers a stage of one model chunk layer group by layer group; the others
        // whole, before the schedule.
        let per_group = self.param_shards.is_some() && self.model.num_chunks() == 1;
        let mut gather_wait = match per_group {
            true => Duration::ZERO,
            false => self.finish_param_gather()?,
        };
        let dp = self.dp.clone();
        let mut grad_shards = (dp.sharding_strategy().shards_grads())
            // Reduced at once: the schedule's backwards are not followed by a wait.
            .then(|| GradShards::new(&dp, &self.buffer, false));
        let mut no_hook = NoGradHook;
        let ready: &mut (dyn GradReady + Send) = match grad_shards.as_mut() {
            Some(shards) => shards,
            None => &mut no_hook,
        };
        let sums = self.run_pipeline(pp, batches, total, loss_scale, ready)?;
        gather_wait += sums.gather_wait;
        let tokens = batches.iter().map(|b| b.tokens.len()).sum();
        let wait = Instant::now();
        let comm_wait = match grad_shards {
            // The tied embedding's sum over its two stages commutes with the reduction.
            Some(shards) => {
                let waited = shards.finish(&mut self.buffer, batches.len())?;
                self.reduce_shared_embedding_grads(pp)?;
                waited
            }
            None => {
                self.reduce_shared_embedding_grads(pp)?;
                self.dp.reduce_grads(&mut self.buffer)?;
                wait.elapsed()
            }
        };
        Ok(Pass {
            loss_sum: sums.loss_sum,
            tokens,
            comm_wait,
            gather_wait,
            dpo: sums.dpo,
            moe: sums.moe,
            activation_peak: sums.activation_peak,
        })
    }

    /// Forward and backward of each micro-batch in turn, accumulating into the buffer with
    /// `loss_scale · tokens_i / total` (see [`Trainer::train_step`]), then the data-parallel
    /// gradient reduction; with `overlap_grad_reduce` the last micro-batch's backward starts
    /// each bucket's reduction as its gradients become final. Under ZeRO-2/3 every
    /// micro-batch's backward reduce-scatters its buckets into this rank's shards
    /// ([`GradShards`]), and under ZeRO-3 each layer group's parameters are gathered around
    /// its passes ([`super::param_shards::ParamShards::forward_backward`]).
    pub(super) fn local_pass(
        &mut self,
        batches: &[TrainBatch],
        total: f64,
        loss_scale: f32,
    ) -> Result<Pass> {
        let distributed = self.dp.use_distributed_optimizer();
        let dp = self.dp.clone();
        let mut grad_shards = dp
            .sharding_strategy()
            .shards_grads()
            .then(|| GradShards::new(&dp, &self.buffer, true));
        let mut overlap = dp
            .overlap_comms()
            .filter(|_| grad_shards.is_none())
            .map(|c| BucketOverlap::new(c, distributed, &self.buffer));
        let gather_comm = dp.unit_gather_comm();
        let last = batches.len() - 1;
        let (mut loss_sum, mut tokens, mut gather_wait) = (0.0, 0, Duration::ZERO);
        let mut dpo: Option<DpoStats> = None;
        let mut moe = MoeLosses::default();
        let mut activation_peak = 0;
        for (k, batch) in batches.iter().enumerate() {
            let scale = if total > 0.0 {
                (batch.loss_units() / total) as f32 * loss_scale
            } else {
                0.0
            };
            let mut no_hook = NoGradHook;
            let ready: &mut (dyn GradReady + Send) = match (grad_shards.as_mut(), overlap.as_mut())
            {
                (Some(shards), _) => shards,
                (None, Some(hook)) if k == last => hook,
                _ => &mut no_hook,
            };
            let (stats, waited) =
                self.micro_batch_pass(gather_comm.as_deref(), batch, scale, ready)?;
            if let Some(shards) = grad_shards.as_mut() {
                shards.end_micro_batch()?;
            }
            gather_wait += waited;
            activation_peak = activation_peak.max(stats.activation_peak_bytes);
            loss_sum += stats.loss_sum;
            moe.add(&stats.moe);
            if let Some(d) = &stats.dpo {
                dpo.get_or_insert_default().add(d);
            }
            tokens += batch.tokens.len();
        }
        let comm_wait = match (grad_shards, overlap) {
            (Some(shards), _) => shards.finish(&mut self.buffer, batches.len())?,
            (None, Some(hook)) => hook.finish(&mut self.buffer)?,
            (None, None) => {
                let wait = Instant::now();
                self.dp.reduce_grads(&mut self.buffer)?;
                wait.elapsed()
            }
        };
        Ok(Pass {
            loss_sum,
            tokens,
            comm_wait,
            gather_wait,
            dpo,
            moe,
            activation_peak,
        })
    }

    /// AdamW at `lr` with the scheduled weight decay over the reduced gradients (grad-norm
    /// and overflow statistics reduced over the tensor, pipeline and data-parallel ranks),
    /// after moving the MoE layers' expert biases (aux-loss-free routing),
    /// in place in the parameter storage the model reads. On success, with the distributed
    /// optimizer, the other ranks' updated shards are all-gathered now or, with
    /// `overlap_param_gather`, launched to arrive during the next forward; the schedule
    /// advances one iteration. Returns the outcome and the time waited for the gather.
    pub(super) fn update(&mut self, lr: f64) -> Result<(StepOutcome, Duration)> {
        // The step's global_aux_loss counts are done with; the expert biases move on the
        // step's routed-token counts summed over the data-parallel ranks (Megatron's
        // `_update_router_expert_bias`, every step).
        self.model.reset_global_aux();
        let dp = &self.dp;
        self.model.update_expert_bias(|counts| {
            dp.sum(counts)
                .map_err(|e| ferrotron_model::ModelError::Comm(e.to_string()))
        })?;
        let tp = self.model.tensor_parallel().map(|t| t.group.comm().clone());
        let (optimizer, dp, pp) = (&mut self.optimizer, &self.dp, &self.pp);
        let weight_decay = self.scheduler.weight_decay();
        let (out, gather, gather_wait) =
            with_params_in_buffer(&mut self.model, &mut self.buffer, |buffer| {
                let mut reduce = dp.stats_reduce(tp.as_deref(), pp.as_ref().map(|p| &**p.comm()));
                let out = optimizer.step_with(buffer, lr, weight_decay, &mut reduce)?;
                let (mut gather, mut waited) = (None, Duration::ZERO);
                // ZeRO-3 gathers the updated weights unit by unit in the next pass.
                if out.update_successful && !dp.sharding_strategy().shards_params() {
                    match dp.param_gather_comms() {
                        Some(comm) => gather = Some(ParamGather::launch(comm, buffer)),
                        None => {
                            let start = Instant::now();
                            dp.gather_params(buffer)?;
                            waited = start.elapsed();
                        }
                    }
                }
                Ok((out, gather, waited))
            })?;
        if out.update_successful {
            self.param_gather = gather;
            self.scheduler.step(1);
            // The other ranks' parts of the weights are stale now.
            if let Some(shards) = self.param_shards.as_mut() {
                shards.release_all(&mut self.model)?;
            }
        }
        Ok((out, gather_wait))
    }
}

impl Trainer {
    /// One micro-batch's forward and backward into the buffer's gradients: under ZeRO-3
    /// layer group by layer group with their parameters gathered around each (on `gather`,
    /// the progress thread; none on one rank), else [`micro_batch_pass`]. Returns the loss
    /// and the time spent waiting for parameters.
    fn micro_batch_pass(
        &mut self,
        gather: Option<&ferrotron_comm::AsyncComm>,
        batch: &TrainBatch,
        scale: f32,
        ready: &mut (dyn GradReady + Send),
    ) -> Result<(LossStats, Duration)> {
        let (model, buffer) = (&mut self.model, &mut self.buffer);
        match self.param_shards.as_mut() {
            Some(shards) => shards.forward_backward(gather, model, buffer, batch, scale, ready),
            None => micro_batch_pass(model, buffer, self.param_gather.take(), batch, scale, ready),
        }
    }
}

/// One micro-batch's forward and backward into the buffer's gradients: gated on the last
/// step's parameter all-gathers when they are still in flight ([`gated_forward_backward`]),
/// plain otherwise. Returns the loss and the time spent waiting for parameters.
fn micro_batch_pass(
    model: &mut GptModel,
    buffer: &mut ParamAndGradBuffer,
    gather: Option<ParamGather>,
    batch: &TrainBatch,
    scale: f32,
    ready: &mut (dyn GradReady + Send),
) -> Result<(LossStats, Duration)> {
    match gather {
        Some(gather) => gated_forward_backward(model, buffer, gather, batch, scale, ready),
        None => {
            let mut grads = buffer.grad_slices_mut();
            let stats = model.forward_backward_with(batch, &mut grads, scale, ready)?;
            Ok((stats, Duration::ZERO))
        }
    }
}

/// The first micro-batch's forward and backward under `overlap_param_gather`: the forward
/// runs one layer group at a time ([`GptModel::layer_groups`]), each after the parameters
/// it reads have arrived; the backward then walks the groups in reverse. Same values as
/// [`GptModel::forward_backward_with`]. Returns the loss and the time spent waiting.
fn gated_forward_backward(
    model: &mut GptModel,
    buffer: &mut ParamAndGradBuffer,
    mut gather: ParamGather,
    batch: &TrainBatch,
    scale: f32,
    ready: &mut (dyn GradReady + Send),
) -> Result<(LossStats, Duration)> {
    let mut states = Vec::new();
    let (mut x, mut loss) = (None, None);
    let mut moe = MoeLosses::default();
    let mut peak = ActivationPeak::default();
    for layers in model.layer_groups() {
        gather.install_through(model.part_params(layers.clone()).end, buffer, model)?;
        let mut state = model.part_forward(batch, layers, x.take(), scale)?;
        peak.forward(&state);
        moe.add(&state.moe_losses());
        match state.loss() {
            Some(l) => loss = Some(l),
            None => x = Some(state.take_output()),
        }
        states.push(state);
    }
    let waited = gather.finish(buffer, model)?;
    let mut grads = buffer.grad_slices_mut();
    let mut dout = None;
    for state in states.into_iter().rev() {
        dout = peak.backward(model, batch, state, (&mut grads, dout), ready)?;
    }
    let mut loss: LossStats = loss.ok_or_else(|| {
        TrainError::Config("overlap_param_gather: the model computed no loss".into())
    })?;
    // Every group's MoE layers, not only the last group's; the peak over every group.
    loss.moe = moe;
    loss.activation_peak_bytes = peak.peak();
    Ok((loss, waited))
}
