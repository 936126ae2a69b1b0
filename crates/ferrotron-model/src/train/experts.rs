//! The routed experts of an MoE layer's training pass: every expert on this rank (the
//! grouped GEMM, [`ferrotron_nn::moe::experts_forward`]), or this rank's share of them over
//! the expert-parallel group with the alltoall or the allgather token dispatcher
//! ([`ferrotron_nn::moe::ep_experts_forward`], [`ferrotron_nn::moe::ag_experts_forward`]);
//! the backward of each beside it.

use std::ops::Range;

use super::forward::Pass;
use super::moe::moe_config;
use crate::TokenDispatcher;
use crate::module::{ExpertTensorParallel, MoeMlp};
use crate::{ModelError, Result};
use ferrotron_nn::moe::{
    AgActs, EpActs, ExpertActs, ExpertWeights, Routing, ag_experts_backward, ag_experts_forward,
    ep_experts_backward_into, ep_experts_forward, experts_backward_into, experts_forward,
};

/// What the experts' backward needs.
pub(super) enum ExpertRun {
    /// Every expert ran here.
    Local(ExpertActs),
    /// This rank's experts ran over the rows the group sent them (alltoall).
    Parallel(EpActs),
    /// This rank's experts ran over the group's gathered tokens (allgather).
    Gathered(AgActs),
}

impl ExpertRun {
    /// Bytes held.
    pub(super) fn bytes(&self) -> u128 {
        match self {
            ExpertRun::Local(a) => a.bytes(),
            ExpertRun::Parallel(a) => a.bytes(),
            ExpertRun::Gathered(a) => a.bytes(),
        }
    }
}

/// The held experts' weights as stored (f32, or bf16 under `precision.bf16`: the grouped
/// GEMM widens them a block of rows at a time).
fn expert_weights<'a>(pass: &Pass<'a>, m: &MoeMlp) -> ExpertWeights<'a> {
    ExpertWeights {
        fc1: pass.model.param(m.experts_fc1).weight_ref(),
        fc2: pass.model.param(m.experts_fc2).weight_ref(),
        hidden: pass.c.hidden_size,
        ffn: moe_config(pass).moe_ffn_hidden_size,
    }
}

fn nn_error(e: ferrotron_nn::NnError) -> ModelError {
    ModelError::Comm(format!("MoE token dispatch: {e}"))
}

/// This tensor-parallel rank's share of the `rows` routed rows when it holds its experts
/// whole (`expert_tensor_parallel_size` 1): block `r` of `t` (under sequence parallelism its
/// own rows); `None` when every rank runs every row through its slice of the experts.
///
/// # Errors
/// Rows that do not split evenly over the ranks.
fn row_share(pass: &Pass<'_>, rows: usize) -> Result<Option<Range<usize>>> {
    let Some(tp) = pass.tp.filter(|t| t.experts == ExpertTensorParallel::Whole) else {
        return Ok(None);
    };
    let (t, r) = (tp.group.size(), tp.group.rank());
    if !rows.is_multiple_of(t) {
        return Err(ModelError::Input(format!(
            "expert_tensor_parallel_size 1 shares the {rows} rows of a micro-batch over tensor_model_parallel_size {t} ranks: they must divide evenly"
        )));
    }
    let n = rows / t;
    Ok(Some(r * n..(r + 1) * n))
}

/// `y [T, h]`: the routed experts of `m` over this rank's tokens `x [T, h]` as `routing`
/// says (each row's output a partial sum over tensor-parallel ranks: every rank's slice of
/// the experts' width, or, with whole experts, the rank's share of the rows and zeros
/// elsewhere).
///
/// # Errors
/// A failed exchange of the expert-parallel group; rows that whole experts cannot share.
pub(super) fn routed_forward(
    pass: &Pass<'_>,
    m: &MoeMlp,
    x: &[f32],
    routing: &Routing,
) -> Result<(Vec<f32>, ExpertRun)> {
    let h = pass.c.hidden_size;
    let Some(share) = row_share(pass, x.len() / h)? else {
        return experts_forward_on(pass, m, x, routing);
    };
    if routing.pad_rows().is_some() {
        return Err(ModelError::Input(
            "not supported yet: moe_pad_expert_input_to_capacity with \
             expert_tensor_parallel_size 1 under tensor parallelism"
                .into(),
        ));
    }
    let rows = share.start * h..share.end * h;
    let (ys, run) = experts_forward_on(pass, m, &x[rows.clone()], &routing.rows(share))?;
    let mut y = vec![0f32; x.len()];
    y[rows].copy_from_slice(&ys);
    Ok((y, run))
}

/// The routed experts over the tokens `x` (all of them here, or exchanged with the
/// expert-parallel group).
fn experts_forward_on(
    pass: &Pass<'_>,
    m: &MoeMlp,
    x: &[f32],
    routing: &Routing,
) -> Result<(Vec<f32>, ExpertRun)> {
    let w = expert_weights(pass, m);
    match &pass.model.ep {
        None => {
            let (y, acts) = experts_forward(x, routing, &w);
            Ok((y, ExpertRun::Local(acts)))
        }
        Some(ep) => {
            let moe = moe_config(pass);
            let e = moe.num_experts();
            match moe.token_dispatcher {
                TokenDispatcher::AllToAll => {
                    let (y, acts) =
                        ep_experts_forward(ep.comm(), x, routing, e, &w).map_err(nn_error)?;
                    Ok((y, ExpertRun::Parallel(acts)))
                }
                TokenDispatcher::AllGather => {
                    let (y, acts) =
                        ag_experts_forward(ep.comm(), x, routing, e, &w).map_err(nn_error)?;
                    Ok((y, ExpertRun::Gathered(acts)))
                }
            }
        }
    }
}

/// [`routed_forward`]'s backward for `dy [T, h]`: returns `(dx [T, h], dprobs [T, k])` of
/// this rank's tokens (partial sums over tensor-parallel ranks, as the output was) and
/// **accumulates** the held experts' weight gradients into `grads` (table order) in place.
///
/// # Errors
/// A failed exchange of the expert-parallel group.
pub(super) fn routed_backward(
    pass: &Pass<'_>,
    m: &MoeMlp,
    routing: &Routing,
    run: &ExpertRun,
    dy: &[f32],
    grads: &mut [&mut [f32]],
) -> Result<(Vec<f32>, Vec<f32>)> {
    let (h, k) = (pass.c.hidden_size, routing.topk());
    let Some(share) = row_share(pass, dy.len() / h)? else {
        return experts_backward_on(pass, m, routing, run, dy, grads);
    };
    let (rows, slots) = (
        share.start * h..share.end * h,
        share.start * k..share.end * k,
    );
    let mine = routing.rows(share);
    let (dxs, dps) = experts_backward_on(pass, m, &mine, run, &dy[rows.clone()], grads)?;
    let (mut dx, mut dprobs) = (vec![0f32; dy.len()], vec![0f32; routing.probs.len()]);
    dx[rows].copy_from_slice(&dxs);
    dprobs[slots].copy_from_slice(&dps);
    Ok((dx, dprobs))
}

/// [`experts_forward_on`]'s backward.
fn experts_backward_on(
    pass: &Pass<'_>,
    m: &MoeMlp,
    routing: &Routing,
    run: &ExpertRun,
    dy: &[f32],
    grads: &mut [&mut [f32]],
) -> Result<(Vec<f32>, Vec<f32>)> {
    let w = expert_weights(pass, m);
    // The gradient slices themselves (scratch for a frozen stack, never in training).
    let (i1, i2) = (m.experts_fc1.index(), m.experts_fc2.index());
    let (mut s1, mut s2) = (Vec::new(), Vec::new());
    let [g1, g2] = grads
        .get_disjoint_mut([i1, i2])
        .expect("two distinct parameters");
    let dfc1: &mut [f32] = if g1.is_empty() {
        s1.resize(w.fc1.len(), 0.0);
        &mut s1
    } else {
        g1
    };
    let dfc2: &mut [f32] = if g2.is_empty() {
        s2.resize(w.fc2.len(), 0.0);
        &mut s2
    } else {
        g2
    };
    match (run, &pass.model.ep) {
        (ExpertRun::Local(acts), None) => {
            Ok(experts_backward_into(routing, &w, acts, dy, (dfc1, dfc2)))
        }
        (ExpertRun::Parallel(acts), Some(ep)) => {
            ep_experts_backward_into(ep.comm(), routing, &w, acts, dy, (dfc1, dfc2))
                .map_err(nn_error)
        }
        (ExpertRun::Gathered(acts), Some(ep)) => {
            ag_experts_backward(ep.comm(), &w, acts, dy, (dfc1, dfc2)).map_err(nn_error)
        }
        _ => unreachable!("the backward runs on the model that ran the forward"),
    }
}
