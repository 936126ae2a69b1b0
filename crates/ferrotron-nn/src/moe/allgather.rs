//! Expert parallelism with Megatron-Core's `allgather` token dispatcher
//! (`moe/token_dispatcher.py`, `MoEAllGatherTokenDispatcher`): every rank of the
//! expert-parallel group all-gathers the group's tokens with their routing, runs its local
//! experts (`L = E / ep`, rank `r` holding `r·L ..`) over the gathered tokens routed to them,
//! weights and sums its experts' outputs per gathered token, and a reduce-scatter hands each
//! rank the sum over every rank's experts for its own tokens. Simpler than the alltoall
//! dispatcher (no exchange plan), at the cost of moving every token to every rank; every
//! rank must hold the same number of tokens.

use ferrotron_comm::{Collectives, Communicator, ReduceOp};

use super::experts::{Permutation, grouped_mlp_backward, grouped_mlp_forward};
use super::{ExpertWeights, Routing};
use crate::{NnError, Result};

/// What [`ag_experts_backward`] needs.
#[derive(Clone, Debug)]
pub struct AgActs {
    /// The local experts' rows among the gathered tokens' slots.
    perm: Permutation,
    /// `[ep·T·k]` the gathered routing weights.
    probs: Vec<f32>,
    /// `[R_local, h]`, `[R_local, 2f]`, `[R_local, f]`, `[R_local, h]`: the local experts'
    /// inputs, activations and outputs.
    xp: Vec<f32>,
    fc1: Vec<f32>,
    act: Vec<f32>,
    out: Vec<f32>,
}

impl AgActs {
    /// Bytes held.
    pub fn bytes(&self) -> u128 {
        let f32s = self.probs.len() + self.xp.len() + self.fc1.len() + self.act.len();
        let usizes = self.perm.slots.len() + self.perm.offsets.len();
        (4 * (f32s + self.out.len()) + std::mem::size_of::<usize>() * usizes) as u128
    }
}

fn comm_err(e: impl std::fmt::Display) -> NnError {
    NnError::Comm(format!("expert parallel: {e}"))
}

/// Every rank's `local` (equal lengths), concatenated in rank order.
fn gathered<T: ferrotron_comm::Element + Default>(
    ep: &dyn Communicator,
    local: &[T],
) -> Result<Vec<T>> {
    let mut all = vec![T::default(); local.len() * ep.size()];
    ep.all_gather(local, &mut all).map_err(comm_err)?;
    Ok(all)
}

/// This rank's part of the sum over the group of `all` (`ep` equal parts in rank order).
fn reduced(ep: &dyn Communicator, mut all: Vec<f32>) -> Result<Vec<f32>> {
    ep.reduce_scatter_in_place(&mut all, ReduceOp::Sum)
        .map_err(comm_err)?;
    let n = all.len() / ep.size();
    Ok(all[ep.rank() * n..][..n].to_vec())
}

/// `y [T, h]` of this rank's tokens `x [T, h]` routed by `routing` (global expert ids of `E`
/// experts) with its local experts' weights `w`, over the expert-parallel group `ep`. Equals
/// [`super::experts_forward`] with all `E` experts on one rank.
///
/// # Errors
/// [`NnError::BadInput`] when `E` does not split evenly over the group; [`NnError::Comm`]
/// when a collective fails (e.g. ranks with different token counts).
pub fn ag_experts_forward(
    ep: &dyn Communicator,
    x: &[f32],
    routing: &Routing,
    num_experts: usize,
    w: &ExpertWeights<'_>,
) -> Result<(Vec<f32>, AgActs)> {
    let (h, n) = (w.hidden, ep.size());
    let local = w.num_experts();
    if !num_experts.is_multiple_of(n) || local * n != num_experts {
        return Err(NnError::BadInput {
            field: "expert_model_parallel_size".into(),
            reason: format!("{num_experts} experts do not split into {n} ranks of {local}"),
        });
    }
    let x_all = gathered(ep, x)?;
    // Expert ids travel as f32 (exact below 2^24; the communicator has no u32).
    let ids: Vec<f32> = routing.experts.iter().map(|&e| e as f32).collect();
    let experts: Vec<u32> = gathered(ep, &ids)?.iter().map(|&e| e as u32).collect();
    let drops: Vec<u8> = routing.dropped.iter().map(|&d| u8::from(d)).collect();
    let dropped: Vec<bool> = gathered(ep, &drops)?.iter().map(|&d| d != 0).collect();
    let probs = gathered(ep, &routing.probs)?;
    let held = ep.rank() * local..(ep.rank() + 1) * local;
    let perm = Permutation::of_held(&experts, &dropped, routing.topk(), held);
    let xp = perm.permute(&x_all, h);
    let (fc1, act, out) = grouped_mlp_forward(&xp, &perm.offsets, w);
    let y = reduced(ep, perm.unpermute(&out, &probs, h))?;
    let acts = AgActs {
        perm,
        probs,
        xp,
        fc1,
        act,
        out,
    };
    Ok((y, acts))
}

/// The backward of [`ag_experts_forward`] for `dy [T, h]`: `(dx [T, h], dprobs [T·k])` of
/// this rank's tokens; the local experts' weight gradients are **accumulated** into `dfc1`
/// and `dfc2`.
///
/// # Errors
/// [`NnError::Comm`] when a collective fails.
pub fn ag_experts_backward(
    ep: &dyn Communicator,
    w: &ExpertWeights<'_>,
    acts: &AgActs,
    dy: &[f32],
    grads: (&mut [f32], &mut [f32]),
) -> Result<(Vec<f32>, Vec<f32>)> {
    let h = w.hidden;
    let dy_all = gathered(ep, dy)?;
    let perm = &acts.perm;
    let (dout, dprobs_all) = perm.unpermute_backward(&acts.out, &acts.probs, &dy_all, h);
    let saved = (acts.xp.as_slice(), acts.fc1.as_slice(), acts.act.as_slice());
    let dxp = grouped_mlp_backward(saved, &perm.offsets, w, &dout, grads);
    let dx_all = perm.permute_backward(&dxp, h, dy_all.len());
    Ok((reduced(ep, dx_all)?, reduced(ep, dprobs_all)?))
}
