//! `VocabParallelEmbedding` (Megatron-Core `tensor_parallel/layers.py`): rank `r` holds rows
//! `vocab_start .. vocab_start + v_local` of the `[v, h]` table; a token outside them looks
//! up zeros, and the tensor-parallel all-reduce (or reduce-scatter with sequence
//! parallelism) that follows assembles every token's row.

use ferrotron_tensor::gemm::WeightRef;
use ferrotron_tensor::ops::{embedding_backward, embedding_lookup};

use crate::Result;

/// `out[n, h]`: row `id − vocab_start` of the shard `table: [v_local, h]` for ids in the
/// shard, zeros otherwise (sum over ranks with `reduce_from_tensor_model_parallel_region`).
///
/// # Errors
/// Never for ids outside the shard (they are other ranks' rows); a table of the wrong size.
pub fn vocab_parallel_embedding_forward(
    table: WeightRef<'_>,
    h: usize,
    vocab_start: usize,
    v_local: usize,
    ids: &[u32],
    out: &mut [f32],
) -> Result<()> {
    let (local, inside) = local_ids(ids, vocab_start, v_local);
    embedding_lookup(table, h, &local, out)?;
    for (row, &keep) in out.chunks_exact_mut(h).zip(&inside) {
        if !keep {
            row.fill(0.0);
        }
    }
    Ok(())
}

/// Backward: **accumulates** `dy` rows of the shard's tokens into `dtable: [v_local, h]`
/// (other tokens' rows belong to other ranks).
pub fn vocab_parallel_embedding_backward(
    ids: &[u32],
    dy: &[f32],
    dtable: &mut [f32],
    h: usize,
    vocab_start: usize,
) {
    let v_local = dtable.len() / h;
    let (local, inside) = local_ids(ids, vocab_start, v_local);
    let mut masked = dy.to_vec();
    for (row, &keep) in masked.chunks_exact_mut(h).zip(&inside) {
        if !keep {
            row.fill(0.0);
        }
    }
    embedding_backward(&local, &masked, dtable, h);
}

/// Shard-local ids (0 for tokens outside the shard) and which tokens are inside.
fn local_ids(ids: &[u32], vocab_start: usize, v_local: usize) -> (Vec<u32>, Vec<bool>) {
    ids.iter()
        .map(|&id| match (id as usize).checked_sub(vocab_start) {
            Some(j) if j < v_local => (j as u32, true),
            _ => (0, false),
        })
        .unzip()
}
