//! `all_gather` context parallelism (TE's `AttnFuncWithCPAndKVAllGather`): every rank
//! all-gathers the whole sequence's keys and values, each of its query runs attends to the
//! keys of its document up to its own end in one call (no partial results to merge), and the
//! backward reduce-scatters the whole sequence's dK/dV back to the runs' owners.

use super::{Blocks, Run, comm_err};
use crate::Result;
use crate::attention::core_attention_forward_train;
use ferrotron_comm::{Collectives, ReduceOp};

/// The whole sequence's `[S, b, g, d]` keys and values, in position order, from every rank's
/// runs.
fn gather_kv(io: &Blocks, k: &[f32], v: &[f32]) -> Result<[Vec<f32>; 2]> {
    let (c, wk) = (io.cp.size(), io.width(io.dims.groups));
    let local = [k, v].concat();
    let mut all = vec![0f32; local.len() * c];
    io.cp
        .comm()
        .all_gather(&local, &mut all)
        .map_err(comm_err)?;
    // Rank p's part: [its k, its v].
    let mut full = [vec![0f32; c * k.len()], vec![0f32; c * k.len()]];
    for p in 0..c {
        let part = &all[p * local.len()..][..local.len()];
        for (which, dst) in full.iter_mut().enumerate() {
            let src = &part[which * k.len()..][..k.len()];
            for run in io.split.runs(p) {
                let rows = io.take(src, wk, run, run.local_tokens());
                io.put(dst, wk, run, run.positions(), &rows);
            }
        }
    }
    Ok(full)
}

/// The positions of the keys query run `run` sees: its document up to its own end.
fn key_positions(run: &Run) -> std::ops::Range<usize> {
    run.document..run.start + run.len
}

pub(super) fn forward(
    io: &Blocks,
    [q, k, v]: [&[f32]; 3],
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    let [kf, vf] = gather_kv(io, k, v)?;
    let (a, wq, wk) = (
        io.dims.heads,
        io.width(io.dims.heads),
        io.width(io.dims.groups),
    );
    for run in io.split.runs(io.cp.rank()) {
        let keys = key_positions(run);
        let qx = io.take(q, wq, run, run.local_tokens());
        let [kx, vx] = [&kf, &vf].map(|x| io.take(x, wk, run, keys.clone()));
        let (mut o, mut l) = (vec![0f32; qx.len()], vec![0f32; qx.len() / wq * a]);
        let dims = io.block_dims(run, keys.start, keys.len());
        core_attention_forward_train(
            &qx,
            &kx,
            &vx,
            &mut o,
            &mut l,
            dims,
            io.block_mask(),
            io.precision,
        );
        io.put(out, wq, run, run.local_tokens(), &o);
        io.put(lse, a, run, run.local_tokens(), &l);
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
    let (wq, wk) = (io.width(io.dims.heads), io.width(io.dims.groups));
    let (mut dkf, mut dvf) = (vec![0f32; kf.len()], vec![0f32; vf.len()]);
    for run in io.split.runs(io.cp.rank()) {
        let keys = key_positions(run);
        let kv = (keys.clone(), keys.start);
        let [bq, bk, bv] = io.block_backward([q, out, dout, lse], run, [&kf, &vf], kv);
        io.put(dq, wq, run, run.local_tokens(), &bq);
        io.put_add(&mut dkf, wk, run, keys.clone(), &bk);
        io.put_add(&mut dvf, wk, run, keys, &bv);
    }
    // Rank order for the reduce-scatter: rank p's [dk, dv] in its local layout.
    let part = 2 * k.len();
    let mut send = vec![0f32; c * part];
    for p in 0..c {
        for (which, full) in [&dkf, &dvf].into_iter().enumerate() {
            let dst = &mut send[p * part + which * k.len()..][..k.len()];
            for run in io.split.runs(p) {
                let rows = io.take(full, wk, run, run.positions());
                io.put(dst, wk, run, run.local_tokens(), &rows);
            }
        }
    }
    let mut mine = vec![0f32; part];
    io.cp
        .comm()
        .reduce_scatter(&send, &mut mine, ReduceOp::Sum)
        .map_err(comm_err)?;
    dk.copy_from_slice(&mine[..k.len()]);
    dv.copy_from_slice(&mine[k.len()..]);
    Ok(())
}
