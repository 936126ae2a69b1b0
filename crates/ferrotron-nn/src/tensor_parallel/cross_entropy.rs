//! `vocab_parallel_cross_entropy` (Megatron-Core `tensor_parallel/cross_entropy.py`) fused
//! with its backward: the logits of each rank's vocabulary shard are never gathered; two
//! all-reduces over the tensor-parallel group (the row max, then the sum of exponentials and
//! the label's logit) give every rank the loss and its shard's gradient.

use ferrotron_comm::{Collectives, ReduceOp};
use ferrotron_tensor::ops::VocabShard;

use super::{TensorParallel, comm_err};
use crate::Result;

/// Turns the shard's `logits: [n, v_local]` into `∂/∂logits` of `Σₜ dloss[t]·lossₜ` and
/// writes `losses[t] = mₜ·CEₜ` (identical on every rank); see [`VocabShard`] for the
/// columns, padding and labels. Collective over `tp`.
///
/// # Errors
/// A label outside `0..v_global` (checked before any communication, identically on every
/// rank), or a failed all-reduce.
pub fn vocab_parallel_cross_entropy(
    tp: &TensorParallel,
    shard: &VocabShard<'_>,
    v_global: usize,
    logits: &mut [f32],
    dloss: &[f32],
    losses: &mut [f32],
) -> Result<()> {
    shard.check_labels(logits.len(), v_global)?;
    let n = shard.labels.len();
    let mut max = vec![0f32; n];
    shard.row_max(logits, &mut max);
    tp.comm()
        .all_reduce(&mut max, ReduceOp::Max)
        .map_err(comm_err)?;
    // sum_exp and target in one buffer: one all-reduce
    let mut sums = vec![0f32; 2 * n];
    let (sum_exp, target) = sums.split_at_mut(n);
    shard.sum_exp_and_target(logits, &max, sum_exp, target);
    tp.comm()
        .all_reduce(&mut sums, ReduceOp::Sum)
        .map_err(comm_err)?;
    let (sum_exp, target) = sums.split_at(n);
    shard.loss_and_grad_inplace(logits, [&max, sum_exp, target], dloss, losses);
    Ok(())
}
