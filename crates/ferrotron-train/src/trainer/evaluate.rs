//! [`Trainer::evaluate`] (Megatron's `evaluate`: forward only, per-token mean loss over the
//! validation micro-batches of every data-parallel rank) and the loader micro-batch ->
//! model batch conversion that evaluation and [`Trainer::train_step`] share.

use super::{Result, TrainError, Trainer};
use ferrotron_data::MicroBatch;
use ferrotron_model::{KvCache, LogitsMode, TrainBatch};
use ferrotron_tensor::ops::cross_entropy_forward;

impl Trainer {
    /// Per-token mean validation loss (nats) over `batches` of every data-parallel rank
    /// (collective), forward only: the inference
    /// forward (logits `[s, b, v]`, no activations kept for a backward) and the cross
    /// entropy with the batch's loss mask. Rows whose position ids are not `0..s` or that
    /// pack several documents (reset per document) fall back to a forward + backward into scratch gradients, which costs
    /// about 3x the forward and a parameter-sized allocation. Returns 0 without loss tokens.
    ///
    /// # Errors
    /// Malformed batches or a model failure.
    pub fn evaluate(&mut self, batches: &[MicroBatch]) -> Result<f64> {
        Ok(self.evaluate_with_dpo(batches)?.0)
    }

    /// [`Trainer::evaluate`], and under DPO the mean DPO loss over the pairs with TRL's
    /// metrics summed over every rank's pairs (reference log-probs as in training).
    ///
    /// # Errors
    /// As [`Trainer::evaluate`].
    pub fn evaluate_with_dpo(
        &mut self,
        micro_batches: &[MicroBatch],
    ) -> Result<(f64, Option<ferrotron_model::DpoStats>)> {
        self.require_params_current("evaluate")?;
        let mut batches = micro_batches
            .iter()
            .map(|mb| self.to_train_batch(mb))
            .collect::<Result<Vec<_>>>()?;
        self.attach_objective(&mut batches, micro_batches)?;
        let count: f64 = batches.iter().map(TrainBatch::loss_units).sum();
        let mut sum = 0.0f64;
        let mut dpo: Option<ferrotron_model::DpoStats> = None;
        if let Some(pp) = &self.pp {
            let sums = self.evaluate_pipeline(pp, &batches)?;
            (sum, dpo) = (sums.loss_sum, sums.dpo);
        }
        for batch in batches.iter().filter(|_| self.pp.is_none()) {
            let plain = batch.position_ids.is_none() && batch.document_starts.is_none();
            let lm = batch.objective == ferrotron_model::Objective::LanguageModel;
            sum += if plain && lm && self.model.tensor_parallel().is_none() {
                self.forward_loss_sum(batch)?
            } else {
                let stats = self.model.forward_loss(batch)?;
                if let Some(d) = &stats.dpo {
                    dpo.get_or_insert_default().add(d);
                }
                stats.loss_sum
            };
        }
        let mut totals = [sum, count];
        self.dp.sum(&mut totals)?;
        let [sum, count] = totals;
        let dpo = self.sum_dpo_stats(dpo)?;
        Ok((if count > 0.0 { sum / count } else { 0.0 }, dpo))
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
    /// than one segment (packed SFT samples, Megatron's `reset_attention_mask`). On a
    /// context-parallel rank, its share of the sequence
    /// ([`TrainBatch::context_parallel_share`]).
    pub(super) fn to_train_batch(&self, mb: &MicroBatch) -> Result<TrainBatch> {
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
        match self.model.context_parallel() {
            Some(cp) => Ok(batch.context_parallel_share(cp)?),
            None => Ok(batch),
        }
    }
}
