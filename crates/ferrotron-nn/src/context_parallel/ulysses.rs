//! `a2a` context parallelism (DeepSpeed-Ulysses; Megatron's `--cp-comm-type a2a`): an
//! all-to-all turns each rank's share of the sequence (all heads) into the whole sequence of
//! `1/C` of the heads, core attention runs there as on one rank (causal over the whole
//! sequence, no partial results), and a second all-to-all returns the output to the sequence
//! split. The backward does the same with the gradients. The log-sum-exp stays head-split
//! (`[S, b, a/C]`, as many values as the local `[S/C, b, a]`).

use super::{Blocks, comm_err};
use crate::attention::{AttentionDims, core_attention_backward, core_attention_forward_train};
use crate::{NnError, Result};
use ferrotron_comm::Collectives;

/// Heads per rank of `heads` heads.
fn heads_per_rank(io: &Blocks, heads: usize, what: &str) -> Result<usize> {
    let c = io.cp.size();
    if !heads.is_multiple_of(c) {
        return Err(NnError::BadInput {
            field: "parallel.cp_comm_type = \"a2a\"".into(),
            reason: format!(
                "{heads} {what} per tensor-parallel rank do not divide by context_parallel_size {c}"
            ),
        });
    }
    Ok(heads / c)
}

/// `x: [S/C, b, heads, d]` (this rank's tokens, all heads) to `[S, b, heads/C, d]` (the whole
/// sequence in position order, this rank's heads).
fn to_heads(io: &Blocks, x: &[f32], heads: usize, what: &str) -> Result<Vec<f32>> {
    let (c, b, d) = (io.cp.size(), io.dims.batch, io.dims.head_dim);
    let hc = heads_per_rank(io, heads, what)?;
    let tokens = io.dims.sq * b;
    let (row, part) = (hc * d, hc * d * tokens);
    let mut send = vec![0f32; c * part];
    for p in 0..c {
        for t in 0..tokens {
            let src = &x[(t * heads + p * hc) * d..][..row];
            send[p * part + t * row..][..row].copy_from_slice(src);
        }
    }
    let mut recv = vec![0f32; send.len()];
    io.cp
        .comm()
        .all_to_all(&send, &mut recv)
        .map_err(comm_err)?;
    // Rank p's part: its tokens [S/C, b, heads/C, d], placed by its runs.
    let mut full = vec![0f32; recv.len()];
    for p in 0..c {
        let src = &recv[p * part..][..part];
        for run in io.split.runs(p) {
            let rows = io.take(src, row, run, run.local_tokens());
            io.put(&mut full, row, run, run.positions(), &rows);
        }
    }
    Ok(full)
}

/// The inverse of [`to_heads`]: `y: [S, b, heads/C, d]` into `x: [S/C, b, heads, d]`.
fn to_sequence(io: &Blocks, y: &[f32], heads: usize, x: &mut [f32]) -> Result<()> {
    let (c, b, d) = (io.cp.size(), io.dims.batch, io.dims.head_dim);
    let hc = heads / c;
    let tokens = io.dims.sq * b;
    let (row, part) = (hc * d, hc * d * tokens);
    let mut send = vec![0f32; c * part];
    for p in 0..c {
        let dst = &mut send[p * part..][..part];
        for run in io.split.runs(p) {
            let rows = io.take(y, row, run, run.positions());
            io.put(dst, row, run, run.local_tokens(), &rows);
        }
    }
    let mut recv = vec![0f32; send.len()];
    io.cp
        .comm()
        .all_to_all(&send, &mut recv)
        .map_err(comm_err)?;
    for p in 0..c {
        for t in 0..tokens {
            let src = &recv[p * part + t * row..][..row];
            x[(t * heads + p * hc) * d..][..row].copy_from_slice(src);
        }
    }
    Ok(())
}

/// Dims of the whole sequence on this rank's heads.
fn whole_dims(io: &Blocks) -> AttentionDims {
    let c = io.cp.size();
    AttentionDims {
        sq: io.dims.sq * c,
        skv: io.dims.sq * c,
        heads: io.dims.heads / c,
        groups: io.dims.groups / c,
        ..io.dims
    }
}

/// The ALiBi slopes of this rank's heads.
fn mask_of_heads<'a>(io: &Blocks<'a>) -> crate::attention::AttentionMask<'a> {
    let hc = io.dims.heads / io.cp.size();
    let mut mask = io.mask;
    mask.alibi_slopes = mask.alibi_slopes.map(|s| &s[io.cp.rank() * hc..][..hc]);
    mask
}

pub(super) fn forward(
    io: &Blocks,
    [q, k, v]: [&[f32]; 3],
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    let (a, g) = (io.dims.heads, io.dims.groups);
    let qh = to_heads(io, q, a, "query heads")?;
    let kh = to_heads(io, k, g, "query groups")?;
    let vh = to_heads(io, v, g, "query groups")?;
    let mut oh = vec![0f32; qh.len()];
    let (dims, mask) = (whole_dims(io), mask_of_heads(io));
    core_attention_forward_train(&qh, &kh, &vh, &mut oh, lse, dims, mask, io.precision);
    to_sequence(io, &oh, a, out)
}

pub(super) fn backward(
    io: &Blocks,
    [q, k, v]: [&[f32]; 3],
    [out, dout, lse]: [&[f32]; 3],
    [dq, dk, dv]: [&mut [f32]; 3],
) -> Result<()> {
    let (a, g) = (io.dims.heads, io.dims.groups);
    let [qh, oh, doh] = [q, out, dout].map(|x| to_heads(io, x, a, "query heads"));
    let [kh, vh] = [k, v].map(|x| to_heads(io, x, g, "query groups"));
    let (qh, oh, doh, kh, vh) = (qh?, oh?, doh?, kh?, vh?);
    let (mut dqh, mut dkh, mut dvh) = (
        vec![0f32; qh.len()],
        vec![0f32; kh.len()],
        vec![0f32; vh.len()],
    );
    let (dims, mask) = (whole_dims(io), mask_of_heads(io));
    core_attention_backward(
        &qh,
        &kh,
        &vh,
        &oh,
        &doh,
        lse,
        &mut dqh,
        &mut dkh,
        &mut dvh,
        dims,
        mask,
        io.precision,
    );
    to_sequence(io, &dqh, a, dq)?;
    to_sequence(io, &dkh, g, dk)?;
    to_sequence(io, &dvh, g, dv)
}
