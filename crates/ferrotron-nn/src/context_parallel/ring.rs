//! `p2p` context parallelism: ring attention (TE's `AttnFuncWithCPAndKVP2P`). At step
//! `i = 0..C` rank `r` holds the keys and values of rank `src = (r − i) mod C` and computes
//! the causal blocks between its query chunks and those key chunks (step 0: its own chunks,
//! causal; `src < r`: both query chunks against `src`'s first chunk; `src > r`: its second
//! query chunk against both), merging each block's partial output through its log-sum-exp.
//! The KV of the next step is sent before the block computes, so the transfer overlaps it.
//! The backward walks the same ring with the merged output and log-sum-exp; each rank adds
//! its blocks' dK/dV into an accumulator that travels with the KV it belongs to and ends at
//! its owner.

use super::{Blocks, add, chunk, chunks_of, comm_err, merge_partial};
use crate::Result;
use crate::attention::{core_attention_backward, core_attention_forward_train};
use ferrotron_comm::Collectives;

/// The (query chunk, key chunk) blocks of a step with the KV of rank `src`, as local chunk
/// indices (0 or 1) of the query rank and of `src`: the pairs a causal mask does not hide
/// entirely (key chunk not after the query chunk).
fn blocks(io: &Blocks, src: usize) -> Vec<(usize, usize)> {
    let (q, k) = (io.cp.chunks(), chunks_of(src, io.cp.size()));
    let mut pairs = Vec::with_capacity(4);
    for (qi, &qc) in q.iter().enumerate() {
        for (ki, &kc) in k.iter().enumerate() {
            if kc <= qc {
                pairs.push((qi, ki));
            }
        }
    }
    pairs
}

/// Ring forward: `out: [2n, b, a, d]`, `lse: [2n, b, a]`.
pub(super) fn forward(
    io: &Blocks,
    [q, k, v]: [&[f32]; 3],
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    let (r, c) = (io.cp.rank(), io.cp.size());
    let comm = io.cp.comm();
    let (qn, kn, ln) = io.chunk_lens();
    out.fill(0.0);
    lse.fill(f32::NEG_INFINITY);
    let mut kv = [k, v].concat();
    let (mut part_out, mut part_lse) = (vec![0f32; qn], vec![0f32; ln]);
    for i in 0..c {
        let src = (r + c - i) % c;
        if i + 1 < c {
            comm.send(&kv, (r + 1) % c).map_err(comm_err)?;
        }
        let (ks, vs) = kv.split_at(2 * kn);
        for (qi, ki) in blocks(io, src) {
            let dims = io.block_dims(io.cp.chunks()[qi], chunks_of(src, c)[ki]);
            let (qc, kc, vc) = (
                &q[qi * qn..][..qn],
                &ks[ki * kn..][..kn],
                &vs[ki * kn..][..kn],
            );
            core_attention_forward_train(
                qc,
                kc,
                vc,
                &mut part_out,
                &mut part_lse,
                dims,
                io.mask,
                io.precision,
            );
            let (o, l) = (&mut out[qi * qn..][..qn], &mut lse[qi * ln..][..ln]);
            merge_partial(o, l, &part_out, &part_lse);
        }
        if i + 1 < c {
            comm.recv(&mut kv, (r + c - 1) % c).map_err(comm_err)?;
        }
    }
    Ok(())
}

/// Ring backward: `dq: [2n, b, a, d]`, `dk, dv: [2n, b, g, d]` (overwritten).
pub(super) fn backward(
    io: &Blocks,
    [q, k, v]: [&[f32]; 3],
    [out, dout, lse]: [&[f32]; 3],
    [dq, dk, dv]: [&mut [f32]; 3],
) -> Result<()> {
    let (r, c) = (io.cp.rank(), io.cp.size());
    let comm = io.cp.comm();
    let (next, prev) = ((r + 1) % c, (r + c - 1) % c);
    let (qn, kn, ln) = io.chunk_lens();
    dq.fill(0.0);
    let mut kv = [k, v].concat();
    // dK then dV of the KV this rank holds, travelling with it.
    let mut dkv = vec![0f32; kv.len()];
    let (mut bq, mut bk, mut bv) = (vec![0f32; qn], vec![0f32; kn], vec![0f32; kn]);
    for i in 0..c {
        let src = (r + c - i) % c;
        if i + 1 < c {
            comm.send(&kv, next).map_err(comm_err)?;
        }
        let (ks, vs) = kv.split_at(2 * kn);
        for (qi, ki) in blocks(io, src) {
            let dims = io.block_dims(io.cp.chunks()[qi], chunks_of(src, c)[ki]);
            core_attention_backward(
                chunk(q, qn, qi),
                chunk(ks, kn, ki),
                chunk(vs, kn, ki),
                chunk(out, qn, qi),
                chunk(dout, qn, qi),
                chunk(lse, ln, qi),
                &mut bq,
                &mut bk,
                &mut bv,
                dims,
                io.mask,
                io.precision,
            );
            add(&mut dq[qi * qn..][..qn], &bq);
            add(&mut dkv[ki * kn..][..kn], &bk);
            add(&mut dkv[2 * kn + ki * kn..][..kn], &bv);
        }
        if i + 1 < c {
            comm.send(&dkv, next).map_err(comm_err)?;
            comm.recv(&mut kv, prev).map_err(comm_err)?;
            comm.recv(&mut dkv, prev).map_err(comm_err)?;
        }
    }
    // The accumulator now belongs to rank r + 1's KV; this rank's own comes from r − 1.
    if c > 1 {
        comm.send(&dkv, next).map_err(comm_err)?;
        comm.recv(&mut dkv, prev).map_err(comm_err)?;
    }
    dk.copy_from_slice(&dkv[..2 * kn]);
    dv.copy_from_slice(&dkv[2 * kn..]);
    Ok(())
}
