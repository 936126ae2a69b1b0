//! `p2p` context parallelism: ring attention (TE's `AttnFuncWithCPAndKVP2P`). At step
//! `i = 0..C` rank `r` holds the keys and values of rank `src = (r − i) mod C` and computes
//! the blocks between its query runs and `src`'s key runs that a causal mask does not hide:
//! a key run of the query run's document (the same rows) that does not start after it — with
//! the chunk split, step 0 its own chunks (causal), `src < r` both query chunks against
//! `src`'s first chunk, `src > r` its second query chunk against both. Each block's partial
//! output is merged through its log-sum-exp. The KV of the next step is sent before the blocks
//! compute, so the transfer overlaps them. The backward walks the same ring with the merged
//! output and log-sum-exp; each rank adds its blocks' dK/dV into an accumulator that travels
//! with the KV it belongs to and ends at its owner.

use super::{Blocks, Run, comm_err, merge_partial};
use crate::Result;
use crate::attention::core_attention_forward_train;
use ferrotron_comm::Collectives;

/// The (query run, key run) blocks of a step with the KV of rank `src`: indices into this
/// rank's runs and `src`'s.
fn blocks(io: &Blocks, src: usize) -> Vec<(usize, usize)> {
    let (mine, theirs) = (io.split.runs(io.cp.rank()), io.split.runs(src));
    let mut pairs = Vec::new();
    for (qi, q) in mine.iter().enumerate() {
        for (ki, k) in theirs.iter().enumerate() {
            if k.rows == q.rows && k.document == q.document && k.start <= q.start {
                pairs.push((qi, ki));
            }
        }
    }
    pairs
}

/// Ring forward: `out: [S/C, b, a, d]`, `lse: [S/C, b, a]`.
pub(super) fn forward(
    io: &Blocks,
    [q, k, v]: [&[f32]; 3],
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    let (r, c) = (io.cp.rank(), io.cp.size());
    let comm = io.cp.comm();
    let (a, wq, wk) = (
        io.dims.heads,
        io.width(io.dims.heads),
        io.width(io.dims.groups),
    );
    let mine = io.split.runs(r);
    // Each query run's merged output `[len, rows, a, d]` and log-sum-exp `[len, rows, a]`.
    let mut acc: Vec<(Vec<f32>, Vec<f32>)> = mine
        .iter()
        .map(|run| {
            let rows = run.len * run.rows.len();
            (vec![0f32; rows * wq], vec![f32::NEG_INFINITY; rows * a])
        })
        .collect();
    let mut kv = [k, v].concat();
    for i in 0..c {
        let src = (r + c - i) % c;
        if i + 1 < c {
            comm.send(&kv, (r + 1) % c).map_err(comm_err)?;
        }
        let (ks, vs) = kv.split_at(k.len());
        for (qi, ki) in blocks(io, src) {
            let (qr, kr) = (&mine[qi], &io.split.runs(src)[ki]);
            let qx = io.take(q, wq, qr, qr.local_tokens());
            let [kx, vx] = [ks, vs].map(|x| io.take(x, wk, kr, kr.local_tokens()));
            let (o, l) = &mut acc[qi];
            let (mut part_out, mut part_lse) = (vec![0f32; o.len()], vec![0f32; l.len()]);
            let dims = io.block_dims(qr, kr.start, kr.len);
            core_attention_forward_train(
                &qx,
                &kx,
                &vx,
                &mut part_out,
                &mut part_lse,
                dims,
                io.block_mask(),
                io.precision,
            );
            merge_partial(o, l, &part_out, &part_lse);
        }
        if i + 1 < c {
            comm.recv(&mut kv, (r + c - 1) % c).map_err(comm_err)?;
        }
    }
    for (run, (o, l)) in mine.iter().zip(&acc) {
        io.put(out, wq, run, run.local_tokens(), o);
        io.put(lse, a, run, run.local_tokens(), l);
    }
    Ok(())
}

/// Ring backward: `dq: [S/C, b, a, d]`, `dk, dv: [S/C, b, g, d]` (overwritten).
pub(super) fn backward(
    io: &Blocks,
    [q, k, v]: [&[f32]; 3],
    [out, dout, lse]: [&[f32]; 3],
    [dq, dk, dv]: [&mut [f32]; 3],
) -> Result<()> {
    let (r, c) = (io.cp.rank(), io.cp.size());
    let comm = io.cp.comm();
    let (next, prev) = ((r + 1) % c, (r + c - 1) % c);
    let mine = io.split.runs(r);
    dq.fill(0.0);
    let mut kv = [k, v].concat();
    // dK then dV of the KV this rank holds, travelling with it.
    let mut dkv = vec![0f32; kv.len()];
    for i in 0..c {
        let src = (r + c - i) % c;
        if i + 1 < c {
            comm.send(&kv, next).map_err(comm_err)?;
        }
        let (ks, vs) = kv.split_at(k.len());
        for (qi, ki) in blocks(io, src) {
            let (qr, kr) = (&mine[qi], &io.split.runs(src)[ki]);
            block_backward(io, [q, out, dout, lse], [ks, vs], qr, kr, dq, &mut dkv);
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
    dk.copy_from_slice(&dkv[..k.len()]);
    dv.copy_from_slice(&dkv[k.len()..]);
    Ok(())
}

/// One block's backward: query run `qr` of this rank against key run `kr` of the KV `ks, vs`
/// held now; dQ added into `dq`, dK/dV into the travelling accumulator `dkv` (dK then dV).
fn block_backward(
    io: &Blocks,
    qio: [&[f32]; 4],
    [ks, vs]: [&[f32]; 2],
    qr: &Run,
    kr: &Run,
    dq: &mut [f32],
    dkv: &mut [f32],
) {
    let (wq, wk) = (io.width(io.dims.heads), io.width(io.dims.groups));
    let [bq, bk, bv] = io.block_backward(qio, qr, [ks, vs], (kr.local_tokens(), kr.start));
    io.put_add(dq, wq, qr, qr.local_tokens(), &bq);
    let (dk, dv) = dkv.split_at_mut(ks.len());
    io.put_add(dk, wk, kr, kr.local_tokens(), &bk);
    io.put_add(dv, wk, kr, kr.local_tokens(), &bv);
}
