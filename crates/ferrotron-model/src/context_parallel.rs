//! A model on a context-parallel rank (Megatron's `--context-parallel-size`): the model holds
//! its group ([`ContextParallel`]), its training passes run core attention over the group
//! (`ferrotron_nn::context_parallel`), and a micro-batch becomes the rank's share of the
//! sequence with [`TrainBatch::context_parallel_share`] (Megatron's
//! `get_batch_on_this_cp_rank`). Everything but core attention is per token and runs on the
//! share as it is; gradients are then summed over data × context parallelism by the trainer.

use crate::train::TrainBatch;
use crate::{GptModel, ModelError, Result};
use ferrotron_nn::attention::DocumentStarts;
use ferrotron_nn::context_parallel::SequenceSplit;
use ferrotron_nn::{ContextParallel, CpCommType};

impl GptModel {
    /// Runs this model's training passes over the context-parallel group `cp` (size > 1).
    ///
    /// # Errors
    /// [`ModelError::Input`] for `a2a` with local query heads or query groups that do not
    /// divide by the group size.
    pub fn set_context_parallel(&mut self, cp: ContextParallel) -> Result<()> {
        let c = &self.local;
        let size = cp.size();
        let mut problems = Vec::new();
        if cp.comm_type() == CpCommType::A2a {
            for (what, n) in [
                ("query heads", c.num_attention_heads),
                ("query groups", c.num_query_groups),
            ] {
                if !n.is_multiple_of(size) {
                    problems.push(format!(
                        "cp_comm_type \"a2a\": {n} {what} per tensor-parallel rank do not \
                         divide by context_parallel_size {size}"
                    ));
                }
            }
        }
        if !problems.is_empty() {
            return Err(ModelError::Input(problems.join("; ")));
        }
        self.cp = (size > 1).then_some(cp);
        Ok(())
    }

    /// The context-parallel group of a training pass, `None` without context parallelism.
    pub fn context_parallel(&self) -> Option<&ContextParallel> {
        self.cp.as_ref()
    }
}

impl TrainBatch {
    /// This context-parallel rank's share of the batch: tokens, labels, loss mask and
    /// position ids cut into `2·C` chunks along `s` — per document when the batch has
    /// document starts — the rank's two (`r` and `2C − 1 − r`) of each kept
    /// ([`ContextParallel::split`]); positions are always given (the global ones,
    /// `0..s` sliced when the batch had none), and the document starts stay the **whole**
    /// sequence's (`[s, b]`: attention masks compare global positions). The result's `seq`
    /// is `s / C`.
    ///
    /// DPO and reward batches keep their targets (the rows are the same; the model sums each
    /// row's log-probs over the group, or finds each row's reward token on the rank holding
    /// it).
    ///
    /// # Errors
    /// [`ModelError::Input`] when `s` does not split into `2·C` chunks or the document starts
    /// are malformed.
    pub fn context_parallel_share(&self, cp: &ContextParallel) -> Result<TrainBatch> {
        let (s, b) = (self.seq, self.micro_batch);
        let positions = match &self.position_ids {
            Some(p) => p.clone(),
            None => (0..s).flat_map(|t| std::iter::repeat_n(t, b)).collect(),
        };
        let input = |what: &str, err: ferrotron_nn::NnError| {
            ModelError::Input(format!("train batch: {what}: {err}"))
        };
        let documents = match &self.document_starts {
            Some(d) => Some(DocumentStarts::new(d, b).map_err(|e| input("document_starts", e))?),
            None => None,
        };
        let split = cp
            .split(s, b, documents)
            .map_err(|e| input("sequence", e))?;
        fn share<T: Copy>(split: &SequenceSplit, r: usize, what: &str, x: &[T]) -> Result<Vec<T>> {
            split
                .share(r, x, 1)
                .map_err(|e| ModelError::Input(format!("train batch: {what}: {e}")))
        }
        let r = cp.rank();
        Ok(TrainBatch {
            tokens: share(&split, r, "tokens", &self.tokens)?,
            labels: share(&split, r, "labels", &self.labels)?,
            loss_mask: match &self.loss_mask {
                Some(m) => Some(share(&split, r, "loss_mask", m)?),
                None => None,
            },
            position_ids: Some(share(&split, r, "position_ids", &positions)?),
            document_starts: self.document_starts.clone(),
            micro_batch: b,
            seq: s / cp.size(),
            objective: self.objective.clone(),
            dropout_keys: self.dropout_keys.clone(),
        })
    }
}
