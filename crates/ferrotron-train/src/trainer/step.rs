//! [`Trainer`]: the model, its flat parameter/gradient buffer, AdamW and the LR schedule,
//! with one optimizer step over a global batch ([`Trainer::train_step`], Megatron's
//! `train_step` with `--calculate-per-token-loss`) and a forward-only validation loss
//! ([`Trainer::evaluate`]).

use super::data_parallel::DataParallel;
use super::overlap::BucketOverlap;
use super::param_gather::ParamGather;
use super::{Result, TrainError, TrainerOptions};
use ferrotron_data::MicroBatch;
use ferrotron_model::{
    GptModel, GradReady, KvCache, LogitsMode, LossStats, NoGradHook, TrainBatch,
};
use ferrotron_optim::{
    BufferConfig, Optimizer, OptimizerParamScheduler, OwnedRanges, ParamAndGradBuffer,
    ParamAndGradBufferBuilder, ParamFlags, ParamId,
};
use ferrotron_tensor::DType;
use ferrotron_tensor::ops::cross_entropy_forward;
use std::borrow::Cow;
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
    /// Input tokens processed by all ranks (`global_batch_size · seq_length`).
    pub tokens: usize,
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
    /// # Errors
    /// Invalid options ([`TrainerOptions::validate`]), `options.data_parallel_size` not the
    /// group's size, or a buffer/optimizer/communication failure.
    pub fn new_data_parallel(
        model: GptModel,
        options: TrainerOptions,
        dp: DataParallel,
    ) -> Result<Trainer> {
        options.validate()?;
        if options.data_parallel_size != dp.size() {
            return Err(TrainError::Config(format!(
                "data_parallel_size is {}, the data-parallel group has {} ranks",
                options.data_parallel_size,
                dp.size()
            )));
        }
        let dtype = options.precision.param_dtype();
        let stored = model.dtype();
        if stored != dtype {
            return Err(TrainError::Config(format!(
                "precision {:?} needs {dtype} model weights, the model stores {stored}",
                options.precision
            )));
        }
        let mut config = BufferConfig::new(dtype, dp.size());
        if let Some(size) = options.ddp_bucket_size {
            config.bucket_size = Some(size);
        }
        let mut builder = ParamAndGradBufferBuilder::new(config);
        // Tensor-parallel duplicates (replicated parameters on tp rank > 0) stay out of the
        // grad norm, as Megatron's `param_is_not_tensor_parallel_duplicate`.
        // So is the last pipeline stage's copy of a tied embedding (`param_is_not_shared`).
        for (i, p) in model.parameters().into_iter().enumerate() {
            let flags = ParamFlags {
                is_norm_or_bias: p.is_norm_or_bias,
                is_embedding: p.is_embedding,
                exclude_from_grad_norm: model.is_param_replica(i),
                ..ParamFlags::default()
            };
            builder.register(&p.name, &p.shape, flags)?;
        }
        let mut buffer = builder.build()?;
        if dtype == DType::F32 {
            model.copy_parameters_to(&mut buffer.param_slices_mut::<f32>()?)?;
        } else {
            // Exact: the model's bf16/f16 weights widen to f32 and round back unchanged (one
            // parameter at a time, as in `sync_model_from_buffer`).
            for i in 0..buffer.params().len() {
                buffer.set_param_from_f32(ParamId(i), &model.parameter_f32(i)?)?;
            }
        }
        dp.broadcast_params(&mut buffer)?;
        let optimizer = new_optimizer(&options, &buffer, &dp)?;
        let scheduler = OptimizerParamScheduler::new(options.scheduler_config())?;
        let mut trainer = Trainer {
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
        };
        if trainer.dp.size() > 1 {
            trainer.sync_model_from_buffer()?;
        }
        Ok(trainer)
    }

    /// The data-parallel group.
    pub fn data_parallel(&self) -> &DataParallel {
        &self.dp
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

    /// Bytes of model state this rank holds: the parameter buffer (2 bytes per element in
    /// bf16/fp16, 4 in fp32), the f32 gradient buffer (4) and the optimizer state (Adam
    /// moments and fp32 master weights: 12 per owned element with 16-bit params, 8 in fp32).
    /// Megatron's formula: `6 + 12/dp` bytes per parameter with bf16 params, fp32 grads and
    /// the distributed optimizer (`18` without it); buffer padding adds a little.
    pub fn model_state_bytes(&self) -> usize {
        let numel = self.buffer.numel();
        numel * self.buffer.param_dtype().size_in_bytes()
            + 4 * numel
            + self.optimizer.adam().state_bytes()
    }

    /// The model with the weights of the last successful step.
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

    /// Parameter `i` (order of `model.parameters()`) as held by the optimizer buffer,
    /// widened to f32 (exact) when the buffer holds bf16/f16; a tensor-parallel shard's
    /// local part.
    pub fn param(&self, i: usize) -> Vec<f32> {
        self.buffer.param_to_f32(ParamId(i))
    }

    /// One optimizer step over a global batch: this rank's `num_microbatches` micro-batches
    /// of `micro_batch_size` rows each (`[b, s]` row-major as the loader yields them); the
    /// other data-parallel ranks hold the rest (see [`DataParallel`]).
    ///
    /// Zeroes the gradients, runs forward + backward per micro-batch accumulating into the
    /// buffer with `loss_scale = tokens_i / tokens_total` (loss tokens of the micro-batch
    /// over those of the global batch), so the accumulated gradient is that of the
    /// per-token mean over the global batch (Megatron's `--calculate-per-token-loss`; equal
    /// for any split into micro-batches). Then AdamW with the scheduled lr and weight decay;
    /// on success the updated weights go back into the model and the schedule advances one
    /// iteration. A global batch without loss tokens gives zero gradients and loss 0.
    ///
    /// # Errors
    /// Batches of the wrong count or shape, or a model/optimizer failure (then the model is
    /// unchanged, the gradients are not).
    pub fn train_step(&mut self, micro_batches: &[MicroBatch]) -> Result<StepStats> {
        let start = Instant::now();
        let want = self.options.num_microbatches();
        if micro_batches.len() != want {
            return Err(TrainError::Config(format!(
                "{} micro-batches given, a global batch has {want}",
                micro_batches.len()
            )));
        }
        let batches = micro_batches
            .iter()
            .map(|mb| self.to_train_batch(mb))
            .collect::<Result<Vec<_>>>()?;
        let mut total = [batches
            .iter()
            .map(TrainBatch::loss_token_count)
            .sum::<f64>()];
        self.dp.sum(&mut total)?;
        let total = total[0];
        // fp16: backpropagate the loss times the scaler's scale; the optimizer unscales.
        let loss_scale = self.optimizer.loss_scale();
        self.buffer.zero_grad();
        let (mut loss_sum, mut tokens) = (0.0, 0);
        let pipelined = self.pp.is_some();
        // The pipeline's forwards do not wait per layer: the last step's gathers first.
        let mut gather_wait = Duration::ZERO;
        if pipelined {
            gather_wait = self.finish_param_gather()?;
        }
        if let Some(pp) = self.pp.clone() {
            loss_sum = self.run_pipeline(&pp, &batches, total, loss_scale)?;
            tokens = batches.iter().map(|b| b.tokens.len()).sum();
            self.reduce_shared_embedding_grads(&pp)?;
        }
        // overlap_grad_reduce: the last micro-batch's backward starts each bucket's reduction.
        let distributed = self.dp.use_distributed_optimizer();
        let mut overlap = match self.pp {
            Some(_) => None,
            None => self
                .dp
                .overlap_comm()
                .map(|c| BucketOverlap::new(c, distributed, &self.buffer)),
        };
        let last = batches.len() - 1;
        // Without a pipeline: forward + backward of each micro-batch in turn.
        let micro_batches = batches.iter().enumerate().filter(|_| !pipelined);
        for (k, batch) in micro_batches {
            let scale = if total > 0.0 {
                (batch.loss_token_count() / total) as f32 * loss_scale
            } else {
                0.0
            };
            let mut no_hook = NoGradHook;
            let ready: &mut (dyn GradReady + Send) = match overlap.as_mut() {
                Some(hook) if k == last => hook,
                _ => &mut no_hook,
            };
            let stats = match self.param_gather.take() {
                Some(gather) => {
                    let (stats, waited) = gated_forward_backward(
                        &mut self.model,
                        &mut self.buffer,
                        gather,
                        batch,
                        scale,
                        ready,
                    )?;
                    gather_wait += waited;
                    stats
                }
                None => {
                    let mut grads = self.buffer.grad_slices_mut();
                    self.model
                        .forward_backward_with(batch, &mut grads, scale, ready)?
                }
            };
            loss_sum += stats.loss_sum;
            tokens += batch.tokens.len();
        }
        let comm_wait = match overlap {
            Some(hook) => hook.finish(&mut self.buffer)?,
            None => {
                let wait = Instant::now();
                self.dp.reduce_grads(&mut self.buffer)?;
                wait.elapsed()
            }
        };
        // Sequence-parallel norm gradients over tp (sums commute with the dp reduction).
        self.model
            .finalize_grads(&mut self.buffer.grad_slices_mut())?;
        let mut sums = [loss_sum, tokens as f64];
        self.dp.sum(&mut sums)?;
        let [loss_sum, tokens] = sums;
        let lr = self.scheduler.lr();
        let out = self.optimizer.step_with(
            &mut self.buffer,
            lr,
            self.scheduler.weight_decay(),
            &mut self.dp.stats_reduce(
                self.model.tensor_parallel().map(|t| &**t.group.comm()),
                self.pp.as_ref().map(|p| &**p.comm()),
            ),
        )?;
        if out.update_successful {
            match self.dp.param_gather_comm() {
                Some(comm) => self.param_gather = Some(ParamGather::launch(comm, &mut self.buffer)),
                None => {
                    let wait = Instant::now();
                    self.dp.gather_params(&mut self.buffer)?;
                    gather_wait += wait.elapsed();
                    self.sync_model_from_buffer()?;
                }
            }
            self.scheduler.step(1);
        }
        self.iteration += 1;
        self.consumed_samples += self.options.global_batch_size as u64;
        Ok(StepStats {
            iteration: self.iteration,
            loss: if total > 0.0 { loss_sum / total } else { 0.0 },
            loss_tokens: total,
            grad_norm: out.grad_norm,
            lr,
            skipped: !out.update_successful,
            tokens: tokens as usize,
            elapsed: start.elapsed(),
            comm_wait: comm_wait + gather_wait,
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
    /// # Errors
    /// A failed all-gather.
    pub fn finish_param_gather(&mut self) -> Result<Duration> {
        match self.param_gather.take() {
            Some(gather) => gather.finish(&mut self.buffer, &mut self.model),
            None => Ok(Duration::ZERO),
        }
    }

    /// Errors while parameter all-gathers are in flight (see
    /// [`Trainer::finish_param_gather`]).
    pub(super) fn require_params_current(&self, what: &str) -> Result<()> {
        if self.param_gather.is_some() {
            return Err(TrainError::Config(format!(
                "{what}: the last step's parameter all-gathers are still in flight \
                 (overlap_param_gather); call finish_param_gather first"
            )));
        }
        Ok(())
    }

    /// Copies the buffer's parameters into the model (after a step or a checkpoint load).
    pub(super) fn sync_model_from_buffer(&mut self) -> Result<()> {
        let all: Vec<usize> = (0..self.buffer.params().len()).collect();
        load_model_params(&mut self.model, &self.buffer, &all)
    }

    /// Per-token mean validation loss (nats) over `batches` of every data-parallel rank
    /// (collective), forward only: the inference
    /// forward (logits `[s, b, v]`, no activations kept for a backward) and the cross
    /// entropy with the batch's loss mask. Rows whose position ids are not `0..s` or that
    /// pack several documents (reset per document) fall back to a forward + backward into scratch gradients, which costs
    /// about 3x the forward and a parameter-sized allocation. Returns 0 without loss tokens.
    ///
    /// # Errors
    /// Malformed batches or a model failure.
    pub fn evaluate(&self, batches: &[MicroBatch]) -> Result<f64> {
        self.require_params_current("evaluate")?;
        let batches = batches
            .iter()
            .map(|mb| self.to_train_batch(mb))
            .collect::<Result<Vec<_>>>()?;
        let count: f64 = batches.iter().map(TrainBatch::loss_token_count).sum();
        let mut sum = 0.0f64;
        if let Some(pp) = &self.pp {
            sum = self.evaluate_pipeline(pp, &batches)?;
        }
        for batch in batches.iter().filter(|_| self.pp.is_none()) {
            let plain = batch.position_ids.is_none() && batch.document_starts.is_none();
            sum += if plain && self.model.tensor_parallel().is_none() {
                self.forward_loss_sum(batch)?
            } else {
                self.model.forward_loss(batch)?.loss_sum
            };
        }
        let mut totals = [sum, count];
        self.dp.sum(&mut totals)?;
        let [sum, count] = totals;
        Ok(if count > 0.0 { sum / count } else { 0.0 })
    }

    /// `Σ mask·CE` of `batch` (default positions) through the inference forward.
    fn forward_loss_sum(&self, batch: &TrainBatch) -> Result<f64> {
        let (b, s) = (batch.micro_batch, batch.seq);
        let mut cache = KvCache::new(self.model.config(), b, s)?;
        let logits = self
            .model
            .forward(&batch.tokens, &mut cache, LogitsMode::All)?;
        let mut losses = vec![0.0f32; b * s];
        let mut lse = vec![0.0f32; b * s];
        cross_entropy_forward(
            &logits,
            &batch.labels,
            batch.loss_mask.as_deref(),
            &mut losses,
            &mut lse,
            self.model.config().vocab_size,
        )
        .map_err(ferrotron_model::ModelError::from)?;
        Ok(losses.iter().map(|&l| l as f64).sum())
    }

    /// A loader micro-batch as the model's `[s, b]` [`TrainBatch`]; position ids are kept
    /// only when some row's are not `0..s`, document starts only when some row holds more
    /// than one segment (packed SFT samples, Megatron's `reset_attention_mask`).
    fn to_train_batch(&self, mb: &MicroBatch) -> Result<TrainBatch> {
        let (b, s) = (mb.micro_batch_size, mb.seq_length);
        if b != self.options.micro_batch_size {
            return Err(TrainError::Config(format!(
                "micro-batch of {b} rows, micro_batch_size is {}",
                self.options.micro_batch_size
            )));
        }
        let n = b * s;
        let lens = [
            mb.tokens.len(),
            mb.labels.len(),
            mb.loss_mask.len(),
            mb.position_ids.len(),
        ];
        if n == 0 || lens.iter().any(|&l| l != n) {
            return Err(TrainError::Config(format!(
                "micro-batch fields {lens:?} are not b·s = {b}·{s} long"
            )));
        }
        let labels: Vec<i64> = mb.labels.iter().map(|&y| y as i64).collect();
        let mut batch =
            TrainBatch::from_batch_major(&mb.tokens, &labels, Some(&mb.loss_mask), b, s);
        let default_positions = mb
            .position_ids
            .chunks(s.max(1))
            .all(|row| row.iter().enumerate().all(|(t, &p)| p as usize == t));
        if !default_positions {
            let seq_major = (0..s)
                .flat_map(|t| (0..b).map(move |j| mb.position_ids[j * s + t] as usize))
                .collect();
            batch.position_ids = Some(seq_major);
        }
        if mb.segment_ids.len() == n {
            batch.set_segments(&mb.segment_ids);
        }
        Ok(batch)
    }
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
    let owned = OwnedRanges::distributed_shard(buffer, dp.rank(), dp.size())?;
    Ok(Optimizer::new_sharded(
        config,
        buffer,
        owned.ranges().to_vec(),
    )?)
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
    for layers in model.layer_groups() {
        gather.install_through(model.part_params(layers.clone()).end, buffer, model)?;
        let mut state = model.part_forward(batch, layers, x.take(), scale)?;
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
        dout = model.stage_backward_with(batch, state, &mut grads, dout, ready)?;
    }
    let loss = loss.ok_or_else(|| {
        TrainError::Config("overlap_param_gather: the model computed no loss".into())
    })?;
    Ok((loss, waited))
}

/// Writes the buffer's parameters `ids` into the model: borrowed when the buffer is f32,
/// widened one parameter at a time otherwise (a widened copy of the whole model would be a 4
/// bytes/parameter spike on top of the training state).
pub(super) fn load_model_params(
    model: &mut GptModel,
    buffer: &ParamAndGradBuffer,
    ids: &[usize],
) -> Result<()> {
    model.load_parameters_with(ids, |i| match buffer.param::<f32>(ParamId(i)) {
        Ok(values) => Cow::Borrowed(values),
        // a bf16/f16 buffer
        Err(_) => Cow::Owned(buffer.param_to_f32(ParamId(i))),
    })?;
    Ok(())
}
