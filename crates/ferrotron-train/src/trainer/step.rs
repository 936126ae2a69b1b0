//! [`Trainer`]: the model, its flat parameter/gradient buffer, AdamW and the LR schedule,
//! with one optimizer step over a global batch ([`Trainer::train_step`], Megatron's
//! `train_step` with `--calculate-per-token-loss`; its parts are in `passes.rs`) and a
//! forward-only validation loss ([`Trainer::evaluate`], in `evaluate.rs`).

use super::data_parallel::DataParallel;
use super::param_gather::ParamGather;
use super::param_shards::ParamShards;
use super::sharding::fsdp_units;
use super::{Result, TrainError, TrainerOptions};
use ferrotron_data::MicroBatch;
use ferrotron_model::{GptModel, ParamTable};
use ferrotron_optim::{
    BufferConfig, Optimizer, OptimizerParamScheduler, OwnedRanges, ParamAndGradBuffer,
    ParamAndGradBufferBuilder, ParamFlags,
};
use ferrotron_tensor::DType;
use std::time::{Duration, Instant};

/// What one [`Trainer::train_step`] did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    /// The iteration just completed (1-based; counts skipped steps too, as Megatron).
    pub iteration: u64,
    /// Per-token mean loss over the global batch, `Σ mask·CE / Σ mask` in nats.
    pub loss: f64,
    /// Loss tokens of the global batch (`Σ mask` over labelled tokens).
    pub loss_tokens: f64,
    /// Global gradient L2 norm before clipping (`None` when the optimizer did not compute it).
    pub grad_norm: Option<f64>,
    /// Learning rate applied in this step.
    pub lr: f64,
    /// The optimizer skipped the update (inf/NaN gradients).
    pub skipped: bool,
    /// DPO's metrics summed over the global batch's pairs (`None` for language modeling).
    pub dpo: Option<ferrotron_model::DpoStats>,
    /// The MoE layers' balancing losses (`None` for a model without MoE layers).
    pub moe: Option<super::MoeMetrics>,
    /// Input tokens processed by all ranks (`global_batch_size · seq_length`).
    pub tokens: usize,
    /// The offloaded optimizer state (`None` without offloading).
    pub offload: Option<super::OffloadStats>,
    /// Wall time of the step (forward, backward, optimizer, weight copy).
    pub elapsed: Duration,
    /// Time the step waited for data-parallel communication: the gradient reduction (all
    /// of it without `overlap_grad_reduce`, only what was left after the backward with it)
    /// and the distributed optimizer's parameter all-gather (all of it without
    /// `overlap_param_gather`; with it, what the next step's first forward waited).
    pub comm_wait: Duration,
}

/// Single-rank trainer: owns the model, the f32 [`ParamAndGradBuffer`], the fp32 AdamW
/// [`Optimizer`] and the [`OptimizerParamScheduler`].
pub struct Trainer {
    pub(super) model: GptModel,
    pub(super) options: TrainerOptions,
    pub(super) buffer: ParamAndGradBuffer,
    pub(super) optimizer: Optimizer,
    pub(super) scheduler: OptimizerParamScheduler,
    pub(super) iteration: u64,
    pub(super) consumed_samples: u64,
    pub(super) consumed_valid_samples: u64,
    pub(super) save_plan: Option<super::SavePlan>,
    pub(super) dp: DataParallel,
    pub(super) pp: Option<super::PipelineParallel>,
    /// The last step's parameter all-gathers still in flight (`overlap_param_gather`).
    pub(super) param_gather: Option<ParamGather>,
    /// ZeRO-3's sharded parameter storage (`optim_grads_params`).
    pub(super) param_shards: Option<ParamShards>,
    /// DPO's frozen reference model ([`super::DpoReference::FrozenCopy`]).
    pub(super) dpo_reference: Option<GptModel>,
    /// The largest activation peak of any step so far (the offload auto policy's non-model
    /// memory).
    pub(super) non_model_peak: u64,
}

impl Trainer {
    /// A single-rank trainer: [`Trainer::new_data_parallel`] with a group of one.
    ///
    /// # Errors
    /// As [`Trainer::new_data_parallel`].
    pub fn new(model: GptModel, options: TrainerOptions) -> Result<Trainer> {
        Self::new_data_parallel(model, options, DataParallel::single())
    }

    /// Registers `model.parameters()` in order in a flat buffer (norm weights and biases
    /// flagged: no weight decay) laid out for `dp`'s size, copies the model's weights into it
    /// (then rank 0's to every rank of `dp`) and builds the optimizer (sharded with the
    /// distributed optimizer) and the schedule from `options`. Collective over `dp`.
    ///
    /// The model's weights are in the dtype of `options.precision`, or in f32 under bf16 /
    /// fp16: the model then computes with their rounded copies and the fp32 master weights
    /// start from the f32 values themselves (from rounded copies, a run's first updates
    /// below half an ulp would all round back; see BENCHMARKS.md, bf16 loss curves).
    ///
    /// # Errors
    /// Invalid options ([`TrainerOptions::validate`]), `options.data_parallel_size` not the
    /// group's size, weights in neither the precision's dtype nor f32, or a
    /// buffer/optimizer/communication failure.
    pub fn new_data_parallel(
        model: GptModel,
        options: TrainerOptions,
        dp: DataParallel,
    ) -> Result<Trainer> {
        options.validate()?;
        let cp = model.context_parallel().map_or(1, |cp| cp.size());
        if options.data_parallel_size * cp != dp.size() {
            return Err(TrainError::Config(format!(
                "data_parallel_size is {} (x context_parallel_size {cp}), the data-parallel \
                 group has {} ranks",
                options.data_parallel_size,
                dp.size()
            )));
        }
        let dtype = options.precision.param_dtype();
        let stored = model.dtype();
        let global_aux = model.config().moe.as_ref().is_some_and(|m| {
            m.load_balancing_type == ferrotron_model::LoadBalancing::GlobalAuxLoss
        });
        let mut model = model;
        if global_aux && dp.size() > 1 {
            // A duplicate of the data-parallel group: the forward's all-reduces of the
            // global_aux_loss counts never meet the progress threads' collectives.
            let dup = dp
                .comm()
                .split(Some(0), dp.rank())
                .map_err(super::data_parallel::comm_err)?
                .ok_or_else(|| TrainError::Comm("duplicating the data-parallel group".into()))?;
            model.set_global_aux_group(dup);
        }
        let master_source = match (stored, dtype) {
            _ if stored == dtype => None,
            // f32 weights under bf16/f16: the model computes with their rounded copies and
            // the optimizer's masters start from the f32 values themselves (below).
            (DType::F32, DType::BF16 | DType::F16) => {
                let narrow = model.param_table().to_dtype(dtype);
                Some(std::mem::replace(model.param_table_mut(), narrow))
            }
            _ => {
                return Err(TrainError::Config(format!(
                    "precision {:?} needs {dtype} (or f32) model weights, the model stores \
                     {stored}",
                    options.precision
                )));
            }
        };
        let mut config = BufferConfig::new(dtype, dp.size());
        if let Some(size) = options.ddp_bucket_size {
            config.bucket_size = Some(size);
        }
        let mut builder = ParamAndGradBufferBuilder::new(config);
        // Tensor-parallel duplicates (replicated parameters on tp rank > 0) stay out of the
        // grad norm, as Megatron's `param_is_not_tensor_parallel_duplicate`.
        // So is the last pipeline stage's copy of a tied embedding (`param_is_not_shared`).
        // Under expert parallelism without the distributed optimizer each rank's non-expert
        // parameters are copies of the first expert-parallel rank's: only it counts them.
        let ep_rank = model.expert_parallel().map_or(0, |e| e.shard().rank);
        let skip_copies = dp.skips_expert_replicas(ep_rank);
        let sharding = dp.sharding_strategy();
        let units = sharding.shards_grads().then(|| fsdp_units(&model));
        for (i, p) in model.parameters().into_iter().enumerate() {
            let expert = model.is_expert_param(i);
            let flags = ParamFlags {
                is_norm_or_bias: p.is_norm_or_bias,
                is_embedding: p.is_embedding,
                exclude_from_grad_norm: model.is_model_parallel_replica(i)
                    || (skip_copies && !expert),
                frozen: p.frozen,
                expert_parallel: model.expert_parallel().is_some() && expert,
                fsdp_unit: units.as_ref().map_or(0, |u| u[i]),
                ..ParamFlags::default()
            };
            builder.register(&p.name, &p.shape, flags)?;
        }
        let mut buffer = builder.build()?;
        let dpo_reference = super::dpo::reference_copy(&model, options.dpo.as_ref())?;
        // The model's values move into the buffer's zeroed storage, laid out as the buffer
        // says; the model's table reads them there from now on (one copy of the weights).
        let offsets: Vec<usize> = buffer.params().iter().map(|p| p.offset).collect();
        let mut model = model;
        model
            .param_table_mut()
            .rehome(buffer.take_params()?, &offsets)?;
        let optimizer = with_params_in_buffer(&mut model, &mut buffer, |buffer| {
            dp.broadcast_params(buffer)?;
            let mut optimizer = new_optimizer(&options, buffer, &dp)?;
            if let Some(source) = &master_source {
                masters_from(source, buffer, &mut optimizer)?;
            }
            Ok(optimizer)
        })?;
        drop(master_source);
        let scheduler = OptimizerParamScheduler::new(options.scheduler_config())?;
        // ZeRO-3: from here on a rank holds its shards of the weights only.
        let param_shards = match sharding.shards_params() {
            true => {
                let mut shards = ParamShards::new(&model, &buffer, dp.rank(), dp.size());
                shards.release_all(&mut model)?;
                Some(shards)
            }
            false => None,
        };
        let trainer = Trainer {
            model,
            options,
            buffer,
            optimizer,
            scheduler,
            iteration: 0,
            consumed_samples: 0,
            consumed_valid_samples: 0,
            save_plan: None,
            dp,
            pp: None,
            param_gather: None,
            param_shards,
            dpo_reference,
            non_model_peak: 0,
        };
        Ok(trainer)
    }

    /// The data-parallel group.
    pub fn data_parallel(&self) -> &DataParallel {
        &self.dp
    }

    /// This rank's place among the ranks that read different data: (data-parallel rank,
    /// data-parallel size). The gradient group ([`Trainer::data_parallel`]) also holds the
    /// context-parallel ranks, which read the same micro-batches and keep their share of
    /// the sequence; in Megatron's order (`tp-cp-dp-pp`) its rank is `cp + C·dp`.
    pub fn data_shard(&self) -> (usize, usize) {
        let c = self.context_parallel_size();
        (self.dp.rank() / c, self.dp.size() / c)
    }

    /// `context_parallel_size` of the model this trainer runs (1 without).
    pub fn context_parallel_size(&self) -> usize {
        self.model.context_parallel().map_or(1, |cp| cp.size())
    }

    /// Runs this trainer's model (a pipeline stage) as stage `pp.stage()` of a pipeline:
    /// every step runs the 1F1B schedule with the other stages (collective over `pp`).
    ///
    /// # Errors
    /// The model's stage does not match `pp` (first/last stage flags).
    pub fn set_pipeline(&mut self, pp: super::PipelineParallel) -> Result<()> {
        let (stage, stages) = (pp.stage(), pp.stages());
        if self.model.is_pre_process() != (stage == 0)
            || self.model.is_post_process() != (stage + 1 == stages)
        {
            return Err(TrainError::Config(format!(
                "pipeline stage {stage} of {stages} needs a model stage with pre_process = {} and \
                 post_process = {}",
                stage == 0,
                stage + 1 == stages
            )));
        }
        self.pp = Some(pp);
        Ok(())
    }

    /// Bytes of model state this rank holds, counted from the allocations: the parameter
    /// storage the model and the buffer share (2 bytes per element in bf16/fp16, 4 in fp32),
    /// the f32 gradient buffer (4) and the optimizer state (Adam moments and fp32 master
    /// weights: 12 per owned element with 16-bit params, 8 in fp32). Megatron's formula:
    /// `6 + 12/dp` bytes per parameter with bf16 params, fp32 grads and the distributed
    /// optimizer (`18` without it; `16` in fp32); buffer padding adds a little. ZeRO-2/3
    /// keep full-size buffers whose pages they release: what they hold is
    /// [`Trainer::resident_model_state_bytes`].
    pub fn model_state_bytes(&self) -> usize {
        self.model.param_table().storage_bytes()
            + std::mem::size_of_val(self.buffer.grads())
            + self.optimizer.adam().state_bytes()
    }

    /// Bytes of model state this rank holds in memory, measured: the resident pages of the
    /// parameter storage and of the gradient buffer
    /// ([`ferrotron_tensor::pages::resident_bytes`]) and the optimizer state. This is where
    /// ZeRO-2/3 differ from [`Trainer::model_state_bytes`]: their full-size gradient buffer
    /// and (ZeRO-3) parameter storage hold only this rank's shards between passes, so per
    /// parameter `2 + (4 + 12)/dp` (ZeRO-2) or `(2 + 4 + 12)/dp` (ZeRO-3) bytes with bf16
    /// weights, plus up to a page at each shard's ends.
    pub fn resident_model_state_bytes(&self) -> usize {
        self.model.param_table().resident_bytes()
            + ferrotron_tensor::pages::resident_bytes(self.buffer.grads())
            + self.optimizer.adam().state_bytes()
    }

    /// The model with the weights of the last successful step (with `overlap_param_gather`
    /// or ZeRO-3, after [`Trainer::finish_param_gather`]; before it, outside this rank's
    /// shard, the previous weights or zeros).
    pub fn model(&self) -> &GptModel {
        &self.model
    }

    /// Gives the trained model back.
    pub fn into_model(self) -> GptModel {
        self.model
    }

    /// The options the trainer was built with.
    pub fn options(&self) -> &TrainerOptions {
        &self.options
    }

    /// Iterations completed.
    pub fn iteration(&self) -> u64 {
        self.iteration
    }

    /// Samples consumed (`iteration · global_batch_size`).
    pub fn consumed_samples(&self) -> u64 {
        self.consumed_samples
    }

    /// The learning rate of the next step.
    pub fn lr(&self) -> f64 {
        self.scheduler.lr()
    }

    /// Steps the optimizer skipped so far.
    pub fn skipped_iterations(&self) -> u64 {
        self.optimizer.skipped_iterations()
    }

    /// Parameter `i` (order of `model.parameters()`) widened to f32 (exact) when the
    /// parameters are bf16/f16; a tensor-parallel shard's local part. Current after
    /// [`Trainer::finish_param_gather`] (see [`Trainer::model`]).
    ///
    /// # Panics
    /// `i` beyond the parameters.
    pub fn param(&self, i: usize) -> Vec<f32> {
        self.model.param_table().f32_values(i).into_owned()
    }

    /// One optimizer step over a global batch: this rank's `num_microbatches` micro-batches
    /// of `micro_batch_size` rows each (`[b, s]` row-major as the loader yields them); the
    /// other data-parallel ranks hold the rest (see [`DataParallel`]).
    ///
    /// Zeroes the gradients, runs forward + backward per micro-batch accumulating into the
    /// buffer with `loss_scale = tokens_i / tokens_total` (loss tokens of the micro-batch
    /// over those of the global batch), so the accumulated gradient is that of the
    /// per-token mean over the global batch (Megatron's `--calculate-per-token-loss`; equal
    /// for any split into micro-batches). Under DPO the units are pairs, each micro-batch's
    /// reference log-probs computed first. Then AdamW with the scheduled lr and weight decay;
    /// on success the updated weights go back into the model and the schedule advances one
    /// iteration. A global batch without loss tokens gives zero gradients and loss 0.
    ///
    /// # Errors
    /// Batches of the wrong count or shape, or a model/optimizer failure (then the model is
    /// unchanged, the gradients are not).
    pub fn train_step(&mut self, micro_batches: &[MicroBatch]) -> Result<StepStats> {
        let start = Instant::now();
        let (batches, total) = self.global_batch(micro_batches)?;
        // fp16: backpropagate the loss times the scaler's scale; the optimizer unscales.
        let loss_scale = self.optimizer.loss_scale();
        if self.dp.sharding_strategy().shards_grads() {
            // ZeRO-2/3: zeroed without making the pages resident.
            ferrotron_tensor::pages::release(self.buffer.grads_mut());
        } else {
            self.buffer.zero_grad();
        }
        let pass = match self.pp.clone() {
            Some(pp) => self.pipeline_pass(&pp, &batches, total, loss_scale)?,
            None => self.local_pass(&batches, total, loss_scale)?,
        };
        // Sequence-parallel norm gradients over tp (sums commute with the dp reduction).
        self.model
            .finalize_grads(&mut self.buffer.grad_slices_mut())?;
        let mut sums = [pass.loss_sum, pass.tokens as f64];
        self.dp.sum(&mut sums)?;
        let dpo = self.sum_dpo_stats(pass.dpo)?;
        let moe = self.moe_metrics(pass.moe)?;
        let [loss_sum, tokens] = sums;
        let lr = self.scheduler.lr();
        let (out, gather_wait) = self.update(lr)?;
        let offload = self.after_step_offload(pass.activation_peak)?;
        self.iteration += 1;
        self.consumed_samples += self.options.global_batch_size as u64;
        Ok(StepStats {
            iteration: self.iteration,
            loss: if total > 0.0 { loss_sum / total } else { 0.0 },
            loss_tokens: total,
            grad_norm: out.grad_norm,
            lr,
            skipped: !out.update_successful,
            dpo,
            moe,
            tokens: tokens as usize,
            offload,
            elapsed: start.elapsed(),
            comm_wait: pass.comm_wait + pass.gather_wait + gather_wait,
        })
    }

    /// With `overlap_param_gather`: waits for the last step's parameter all-gathers and
    /// writes them into the buffer and the model (the next step's forward does this itself,
    /// layer by layer). Until then [`Trainer::model`] and [`Trainer::param`] hold the
    /// previous weights outside this rank's shard; [`Trainer::train`] calls this before it
    /// validates, saves or returns, and [`Trainer::evaluate`], the checkpoint writers and
    /// [`Trainer::gather_model_parameters`] refuse to run without it. Collective over the
    /// data-parallel group. Returns the time spent waiting.
    ///
    /// Under ZeRO-3 (`optim_grads_params`) it gathers every bucket of the sharded weights
    /// (the model whole until the next training pass releases them unit by unit); until
    /// then the model holds zeros outside this rank's shard.
    ///
    /// # Errors
    /// A failed all-gather.
    pub fn finish_param_gather(&mut self) -> Result<Duration> {
        if let Some(shards) = self.param_shards.as_mut()
            && !shards.is_whole()
        {
            let thread = self.dp.unit_gather_comm();
            let comm = self.dp.comm().clone();
            return shards.gather_all(thread.as_deref(), &*comm, &mut self.model);
        }
        match self.param_gather.take() {
            Some(gather) => gather.finish(&mut self.buffer, &mut self.model),
            None => Ok(Duration::ZERO),
        }
    }

    /// Errors while parameter all-gathers are in flight (see
    /// [`Trainer::finish_param_gather`]).
    pub(super) fn require_params_current(&self, what: &str) -> Result<()> {
        if self.param_shards.as_ref().is_some_and(|s| !s.is_whole()) {
            return Err(TrainError::Config(format!(
                "{what}: the parameters are sharded (data_parallel_sharding_strategy = \
                 optim_grads_params); call finish_param_gather first"
            )));
        }
        if self.param_gather.is_some() {
            return Err(TrainError::Config(format!(
                "{what}: the last step's parameter all-gathers are still in flight \
                 (overlap_param_gather); call finish_param_gather first"
            )));
        }
        Ok(())
    }
}

/// Starts the master weights from `source`, the f32 table the bf16/f16 params were rounded
/// from (same parameter order as `buffer`), in one pass over the owned ranges; padding and
/// frozen parameters keep what the buffer holds.
fn masters_from(
    source: &ParamTable,
    buffer: &ParamAndGradBuffer,
    optimizer: &mut Optimizer,
) -> Result<()> {
    let params = buffer.params();
    optimizer.set_master_weights(|range, out| {
        buffer.param_storage().copy_to_f32(range.clone(), out);
        for (i, p) in params.iter().enumerate() {
            let r = p.range();
            let (lo, hi) = (r.start.max(range.start), r.end.min(range.end));
            if lo < hi && !source.is_frozen(i) {
                out[lo - range.start..hi - range.start]
                    .copy_from_slice(&source.f32_values(i)[lo - r.start..hi - r.start]);
            }
        }
    })?;
    Ok(())
}

/// AdamW over the whole buffer, or over this rank's shards with the distributed optimizer.
pub(super) fn new_optimizer(
    options: &TrainerOptions,
    buffer: &ParamAndGradBuffer,
    dp: &DataParallel,
) -> Result<Optimizer> {
    let config = options.optimizer_config();
    if !dp.use_distributed_optimizer() {
        return Ok(Optimizer::new(config, buffer)?);
    }
    let owned = OwnedRanges::distributed_shard_by(buffer, |b| {
        let group = dp.bucket_group(b);
        (group.rank(), group.size())
    })?;
    Ok(Optimizer::new_sharded(
        config,
        buffer,
        owned.ranges().to_vec(),
    )?)
}

/// Runs `f` with the parameter storage in `buffer`: the optimizer step, the data-parallel
/// broadcast and gathers, checkpoint import. The model's table and the buffer share one
/// storage in the buffer's layout ([`ferrotron_model::ParamTable::rehome`]); it lives in the
/// model between these calls, where forward and backward read it, and moves (never a copy)
/// into the buffer for `f` — Megatron's module parameters being views of `param_data`. It
/// goes back to the model whether `f` succeeds or fails.
///
/// # Errors
/// What `f` returns; or the storage is already in the buffer (a nested call).
pub(super) fn with_params_in_buffer<R>(
    model: &mut GptModel,
    buffer: &mut ParamAndGradBuffer,
    f: impl FnOnce(&mut ParamAndGradBuffer) -> Result<R>,
) -> Result<R> {
    let table = model.param_table_mut();
    buffer.put_params(table.take_storage()?)?;
    let out = f(buffer);
    table.restore_storage(buffer.take_params()?)?;
    out
}
