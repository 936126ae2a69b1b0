//! The paired tensor-parallel communication ops (Megatron-Core `mappings.py`): each
//! forward beside its backward, the dual collective.
//!
//! | op | forward | backward |
//! |---|---|---|
//! | `copy_to_tensor_model_parallel_region` | identity | all-reduce |
//! | `reduce_from_tensor_model_parallel_region` | all-reduce | identity |
//! | `gather_from_sequence_parallel_region` | all-gather along `s` | reduce-scatter along `s` |
//! | `reduce_scatter_to_sequence_parallel_region` | reduce-scatter along `s` | all-gather along `s` |
//!
//! (The identities have no function.) Rows are `[s, b]`-ordered, so "along `s`" is along the
//! rows: rank `r`'s part is the `r`-th contiguous `1/t` of them.

use ferrotron_comm::{Collectives, ReduceOp};

use super::{TensorParallel, comm_err};
use crate::Result;

/// Backward of `copy_to_tensor_model_parallel_region` (the input of a column-parallel
/// linear): every rank's partial input gradient summed, in place.
///
/// # Errors
/// The all-reduce failed.
pub fn copy_to_tensor_model_parallel_region_backward(
    tp: &TensorParallel,
    dx: &mut [f32],
) -> Result<()> {
    all_reduce(tp, dx)
}

/// Forward of `reduce_from_tensor_model_parallel_region` (the output of a row-parallel
/// linear): the partial outputs summed, in place. Its backward is the identity.
///
/// # Errors
/// The all-reduce failed.
pub fn reduce_from_tensor_model_parallel_region(tp: &TensorParallel, y: &mut [f32]) -> Result<()> {
    all_reduce(tp, y)
}

fn all_reduce(tp: &TensorParallel, x: &mut [f32]) -> Result<()> {
    if tp.size() > 1 {
        tp.comm().all_reduce(x, ReduceOp::Sum).map_err(comm_err)?;
    }
    Ok(())
}

/// Forward of `gather_from_sequence_parallel_region`: the rank's rows `[rows/t, h]` → all
/// rows `[rows, h]`.
///
/// # Errors
/// The all-gather failed.
pub fn gather_from_sequence_parallel_region(
    tp: &TensorParallel,
    local: &[f32],
) -> Result<Vec<f32>> {
    let mut full = vec![0f32; local.len() * tp.size()];
    tp.comm().all_gather(local, &mut full).map_err(comm_err)?;
    Ok(full)
}

/// Backward of [`gather_from_sequence_parallel_region`]: the gradient of all rows (a
/// partial sum on each rank) reduce-scattered to the rank's rows.
///
/// # Errors
/// The reduce-scatter failed.
pub fn gather_from_sequence_parallel_region_backward(
    tp: &TensorParallel,
    dfull: Vec<f32>,
) -> Result<Vec<f32>> {
    reduce_scatter_rows(tp, dfull)
}

/// Forward of `reduce_scatter_to_sequence_parallel_region` (the output of a row-parallel
/// linear under sequence parallelism): partial outputs of all rows → the summed rank's rows.
///
/// # Errors
/// The reduce-scatter failed.
pub fn reduce_scatter_to_sequence_parallel_region(
    tp: &TensorParallel,
    full: Vec<f32>,
) -> Result<Vec<f32>> {
    reduce_scatter_rows(tp, full)
}

/// Backward of [`reduce_scatter_to_sequence_parallel_region`]: the rank's rows' gradient
/// all-gathered to all rows.
///
/// # Errors
/// The all-gather failed.
pub fn reduce_scatter_to_sequence_parallel_region_backward(
    tp: &TensorParallel,
    dlocal: &[f32],
) -> Result<Vec<f32>> {
    gather_from_sequence_parallel_region(tp, dlocal)
}

fn reduce_scatter_rows(tp: &TensorParallel, mut full: Vec<f32>) -> Result<Vec<f32>> {
    let (t, r) = (tp.size(), tp.rank());
    tp.comm()
        .reduce_scatter_in_place(&mut full, ReduceOp::Sum)
        .map_err(comm_err)?;
    let n = full.len() / t;
    Ok(full[r * n..(r + 1) * n].to_vec())
}
