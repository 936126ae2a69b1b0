//! `all_gather` context parallelism (TE's `AttnFuncWithCPAndKVAllGather`): every rank
//! all-gathers the whole sequence's keys and values, each of its query chunks attends to the
//! keys up to its own end in one call (no partial results to merge), and the backward
//! reduce-scatters the whole sequence's dK/dV back to the chunks' owners.

use super::{Blocks, add, chunk, chunks_of, comm_err};
use crate::Result;
use crate::attention::{AttentionDims, core_attention_backward, core_attention_forward_train};
use ferrotron_comm::{Collectives, ReduceOp};

/// The whole sequence's `[S, b, g, d]` keys and values, in position order, from every rank's
/// two chunks.
fn gather_kv(io: &Blocks, k: &[f32], v: &[f32]) -> Result<[Vec<f32>; 2]> {
    let c = io.cp.size();
    let kn = io.chunk_len(io.dims.groups);
    let local = [k, v].concat();
    let mut all = vec![0f32; local.len() * c];
    io.cp
        .comm()
        .all_gather(&local, &mut all)
        .map_err(comm_err)?;
    // Rank p's part: [k chunk p, k chunk 2C-1-p, v chunk p, v chunk 2C-1-p].
    let mut full = [vec![0f32; 2 * c * kn], vec![0f32; 2 * c * kn]];
    for p in 0..c {
        let part = &all[p * local.len()..][..local.len()];
        for (which, dst) in full.iter_mut().enumerate() {
            for (li, &chunk) in chunks_of(p, c).iter().enumerate() {
                let src = &part[(which * 2 + li) * kn..][..kn];
                dst[chunk * kn..][..kn].copy_from_slice(src);
            }
        }
    }
    Ok(full)
}

/// Dims of query chunk `qc` (global index) against the keys `0..(qc + 1)·n`.
fn prefix_dims(io: &Blocks, qc: usize) -> AttentionDims {
    AttentionDims {
        sq: io.n,
        skv: (qc + 1) * io.n,
        q_offset: qc * io.n,
        kv_offset: 0,
        ..io.dims
    }
}

pub(super) fn forward(
    io: &Blocks,
    [q, k, v]: [&[f32]; 3],
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    let [kf, vf] = gather_kv(io, k, v)?;
    let (qn, _, ln) = io.chunk_lens();
    for (qi, &qc) in io.cp.chunks().iter().enumerate() {
        let (o, l) = (&mut out[qi * qn..][..qn], &mut lse[qi * ln..][..ln]);
        let dims = prefix_dims(io, qc);
        let qs = &q[qi * qn..][..qn];
        core_attention_forward_train(qs, &kf, &vf, o, l, dims, io.mask, io.precision);
    }
    Ok(())
}

pub(super) fn backward(
    io: &Blocks,
    [q, k, v]: [&[f32]; 3],
    [out, dout, lse]: [&[f32]; 3],
    [dq, dk, dv]: [&mut [f32]; 3],
) -> Result<()> {
    let c = io.cp.size();
    let [kf, vf] = gather_kv(io, k, v)?;
    let (qn, kn, ln) = io.chunk_lens();
    let (mut dkf, mut dvf) = (vec![0f32; kf.len()], vec![0f32; vf.len()]);
    for (qi, &qc) in io.cp.chunks().iter().enumerate() {
        let dims = prefix_dims(io, qc);
        let prefix = (qc + 1) * kn;
        let (mut bk, mut bv) = (vec![0f32; prefix], vec![0f32; prefix]);
        core_attention_backward(
            chunk(q, qn, qi),
            &kf,
            &vf,
            chunk(out, qn, qi),
            chunk(dout, qn, qi),
            chunk(lse, ln, qi),
            &mut dq[qi * qn..][..qn],
            &mut bk,
            &mut bv,
            dims,
            io.mask,
            io.precision,
        );
        add(&mut dkf[..prefix], &bk);
        add(&mut dvf[..prefix], &bv);
    }
    // Rank order for the reduce-scatter: rank p's [dk chunks, dv chunks] in its local order.
    let part = 4 * kn;
    let mut send = vec![0f32; c * part];
    for p in 0..c {
        for (which, full) in [&dkf, &dvf].into_iter().enumerate() {
            for (li, &chunk) in chunks_of(p, c).iter().enumerate() {
                let dst = &mut send[p * part + (which * 2 + li) * kn..][..kn];
                dst.copy_from_slice(&full[chunk * kn..][..kn]);
            }
        }
    }
    let mut mine = vec![0f32; part];
    io.cp
        .comm()
        .reduce_scatter(&send, &mut mine, ReduceOp::Sum)
        .map_err(comm_err)?;
    dk.copy_from_slice(&mine[..2 * kn]);
    dv.copy_from_slice(&mine[2 * kn..]);
    Ok(())
}
