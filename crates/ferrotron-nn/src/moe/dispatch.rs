//! Expert parallelism with Megatron-Core's `alltoall` token dispatcher
//! (`moe/token_dispatcher.py`, `MoEAlltoAllTokenDispatcher`): the `E` experts split evenly over
//! the `ep` ranks of the expert-parallel group (rank `r` holds experts `r·L..(r+1)·L`,
//! `L = E / ep`, as Megatron places them), each rank routes its own tokens, sends every routed
//! row to the rank holding its expert (an all-to-all with per-rank sizes), runs its local
//! experts over the rows it received (sorted by local expert, Megatron's
//! `sort_chunks_by_idxs`), and sends the outputs back to be weighted and summed per token.
//! The backward mirrors it; expert weight gradients stay with their owner.

use ferrotron_comm::{Collectives, Communicator};

use super::experts::{Permutation, grouped_mlp_backward, grouped_mlp_forward};
use super::{ExpertWeights, Routing};
use crate::{NnError, Result};

/// What [`ep_experts_backward`] needs.
#[derive(Clone, Debug)]
pub struct EpActs {
    /// This rank's routed rows in global expert order.
    perm: Permutation,
    /// `[R, h]` this rank's rows' expert outputs (back from their owners), before weighting.
    out: Vec<f32>,
    /// The exchange: rows sent to / received from each rank, and the received rows' order.
    plan: Exchange,
    /// `[R_local, h]`, `[R_local, 2f]`, `[R_local, f]`: the local experts' inputs and
    /// activations over the received rows (local-expert order).
    xl: Vec<f32>,
    fc1: Vec<f32>,
    act: Vec<f32>,
}

impl EpActs {
    /// Bytes held: the permutation, the exchange plan and the `[R, ·]` activations.
    pub fn bytes(&self) -> u128 {
        let f32s = self.out.len() + self.xl.len() + self.fc1.len() + self.act.len();
        let p = &self.plan;
        let usizes = self.perm.slots.len()
            + self.perm.offsets.len()
            + p.send_rows.len()
            + p.recv_rows.len()
            + p.order.len()
            + p.offsets.len();
        (4 * f32s + std::mem::size_of::<usize>() * usizes) as u128
    }
}

/// The row counts of one dispatch and the local-expert order of the received rows.
#[derive(Clone, Debug)]
struct Exchange {
    /// Rows sent to each rank (`[ep]`).
    send_rows: Vec<usize>,
    /// Rows received from each rank (`[ep]`).
    recv_rows: Vec<usize>,
    /// `order[i]`: the received row (source-rank order) that is local-expert-order row `i`.
    order: Vec<usize>,
    /// `[L + 1]`: local expert `l`'s rows in local-expert order.
    offsets: Vec<usize>,
}

/// Gradients of [`ep_experts_backward`]: `dx [T, h]` and `dprobs [T, k]` of this rank's tokens,
/// `dfc1 [L, 2f, h]` and `dfc2 [L, h, f]` of its local experts (every rank's tokens' share).
#[derive(Clone, Debug)]
pub struct EpGrads {
    pub dx: Vec<f32>,
    pub dfc1: Vec<f32>,
    pub dfc2: Vec<f32>,
    pub dprobs: Vec<f32>,
}

fn comm_err(e: impl std::fmt::Display) -> NnError {
    NnError::Comm(format!("expert parallel: {e}"))
}

impl Exchange {
    /// Agrees with the group on who sends what: `counts[e]` of this rank's rows go to global
    /// expert `e`.
    fn plan(ep: &dyn Communicator, counts: &[usize]) -> Result<Exchange> {
        let n = ep.size();
        let local = counts.len() / n;
        let sends: Vec<f64> = counts.iter().map(|&c| c as f64).collect();
        let mut incoming = vec![0f64; counts.len()];
        ep.all_to_all(&sends, &mut incoming).map_err(comm_err)?;
        // incoming[s·L + l]: rows rank s sends for local expert l.
        let got: Vec<usize> = incoming.iter().map(|&c| c as usize).collect();
        let send_rows = counts.chunks(local).map(|c| c.iter().sum()).collect();
        let recv_rows: Vec<usize> = got.chunks(local).map(|c| c.iter().sum()).collect();
        let mut starts = vec![0usize; n];
        for s in 1..n {
            starts[s] = starts[s - 1] + recv_rows[s - 1];
        }
        let (mut order, mut offsets) = (Vec::new(), vec![0usize]);
        for l in 0..local {
            for s in 0..n {
                let before: usize = got[s * local..s * local + l].iter().sum();
                order.extend(starts[s] + before..starts[s] + before + got[s * local + l]);
            }
            offsets.push(order.len());
        }
        Ok(Exchange {
            send_rows,
            recv_rows,
            order,
            offsets,
        })
    }

    /// Sends `rows [Σ send_rows, h]` out and returns the received rows in local-expert order.
    fn dispatch(&self, ep: &dyn Communicator, rows: &[f32], h: usize) -> Result<Vec<f32>> {
        let mut got = vec![0f32; self.recv_rows.iter().sum::<usize>() * h];
        let (send, recv) = (scaled(&self.send_rows, h), scaled(&self.recv_rows, h));
        ep.all_to_all_v(rows, &send, &mut got, &recv)
            .map_err(comm_err)?;
        let mut sorted = vec![0f32; got.len()];
        for (dst, &src) in sorted.chunks_exact_mut(h).zip(&self.order) {
            dst.copy_from_slice(&got[src * h..][..h]);
        }
        Ok(sorted)
    }

    /// The inverse of [`Exchange::dispatch`]: local-expert-order rows back to their senders.
    fn combine(&self, ep: &dyn Communicator, sorted: &[f32], h: usize) -> Result<Vec<f32>> {
        let mut by_source = vec![0f32; sorted.len()];
        for (src, &dst) in sorted.chunks_exact(h).zip(&self.order) {
            by_source[dst * h..][..h].copy_from_slice(src);
        }
        let mut back = vec![0f32; self.send_rows.iter().sum::<usize>() * h];
        let (send, recv) = (scaled(&self.recv_rows, h), scaled(&self.send_rows, h));
        ep.all_to_all_v(&by_source, &send, &mut back, &recv)
            .map_err(comm_err)?;
        Ok(back)
    }
}

fn scaled(rows: &[usize], h: usize) -> Vec<usize> {
    rows.iter().map(|r| r * h).collect()
}

/// `y [T, h]` of this rank's tokens `x [T, h]` routed by `routing` (global expert ids of `E`
/// experts), its local experts' weights `w` (`L = E / ep` experts, this rank's), over the
/// expert-parallel group `ep`. Equals [`super::experts_forward`] with all `E` experts on one
/// rank.
///
/// # Errors
/// [`NnError::BadInput`] when `E` does not split evenly over the group; [`NnError::Comm`] when
/// an exchange fails (often: another rank failed first).
pub fn ep_experts_forward(
    ep: &dyn Communicator,
    x: &[f32],
    routing: &Routing,
    num_experts: usize,
    w: &ExpertWeights<'_>,
) -> Result<(Vec<f32>, EpActs)> {
    let (h, n) = (w.hidden, ep.size());
    if !num_experts.is_multiple_of(n) || w.num_experts() * n != num_experts {
        return Err(NnError::BadInput {
            field: "expert_model_parallel_size".into(),
            reason: format!(
                "{num_experts} experts do not split into {n} ranks of {} local experts",
                w.num_experts()
            ),
        });
    }
    let perm = Permutation::new(routing, num_experts);
    let xp = perm.permute(x, h);
    let counts: Vec<usize> = perm.offsets.windows(2).map(|o| o[1] - o[0]).collect();
    let plan = Exchange::plan(ep, &counts)?;
    let xl = plan.dispatch(ep, &xp, h)?;
    let (fc1, act, out_local) = grouped_mlp_forward(&xl, &plan.offsets, w);
    let out = plan.combine(ep, &out_local, h)?;
    let y = perm.unpermute(&out, &routing.probs, h);
    let acts = EpActs {
        perm,
        out,
        plan,
        xl,
        fc1,
        act,
    };
    Ok((y, acts))
}

/// The backward of [`ep_experts_forward`] for `dy [T, h]`.
///
/// # Errors
/// [`NnError::Comm`] when an exchange fails.
pub fn ep_experts_backward(
    ep: &dyn Communicator,
    routing: &Routing,
    w: &ExpertWeights<'_>,
    acts: &EpActs,
    dy: &[f32],
) -> Result<EpGrads> {
    let (mut dfc1, mut dfc2) = (vec![0f32; w.fc1.len()], vec![0f32; w.fc2.len()]);
    let (dx, dprobs) = ep_experts_backward_into(ep, routing, w, acts, dy, (&mut dfc1, &mut dfc2))?;
    Ok(EpGrads {
        dx,
        dfc1,
        dfc2,
        dprobs,
    })
}

/// [`ep_experts_backward`] **accumulating** the local experts' weight gradients into `dfc1`
/// and `dfc2`; returns `(dx [T, h], dprobs [T, k])`.
///
/// # Errors
/// [`NnError::Comm`] when an exchange fails.
pub fn ep_experts_backward_into(
    ep: &dyn Communicator,
    routing: &Routing,
    w: &ExpertWeights<'_>,
    acts: &EpActs,
    dy: &[f32],
    (dfc1, dfc2): (&mut [f32], &mut [f32]),
) -> Result<(Vec<f32>, Vec<f32>)> {
    let h = w.hidden;
    let (dout, dprobs) = acts
        .perm
        .unpermute_backward(&acts.out, &routing.probs, dy, h);
    let dl = acts.plan.dispatch(ep, &dout, h)?;
    let saved = (acts.xl.as_slice(), acts.fc1.as_slice(), acts.act.as_slice());
    let dxl = grouped_mlp_backward(saved, &acts.plan.offsets, w, &dl, (dfc1, dfc2));
    let dxp = acts.plan.combine(ep, &dxl, h)?;
    Ok((acts.perm.permute_backward(&dxp, h, dy.len()), dprobs))
}
