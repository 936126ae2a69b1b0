//! The routed experts of an MoE layer's training pass: every expert on this rank (the
//! grouped GEMM, [`ferrotron_nn::moe::experts_forward`]), or this rank's share of them over
//! the expert-parallel group with the alltoall token dispatcher
//! ([`ferrotron_nn::moe::ep_experts_forward`]); the backward of each beside it.

use std::borrow::Cow;

use super::forward::Pass;
use crate::module::MoeMlp;
use crate::{ModelError, Result};
use ferrotron_nn::moe::{
    EpActs, ExpertActs, ExpertWeights, Routing, ep_experts_backward, ep_experts_forward,
    experts_backward, experts_forward,
};

/// What the experts' backward needs.
pub(super) enum ExpertRun {
    /// Every expert ran here.
    Local(ExpertActs),
    /// This rank's experts ran over the rows the group sent them.
    Parallel(EpActs),
}

impl ExpertRun {
    /// Bytes held.
    pub(super) fn bytes(&self) -> u128 {
        match self {
            ExpertRun::Local(a) => a.bytes(),
            ExpertRun::Parallel(a) => a.bytes(),
        }
    }
}

/// The routed experts' gradients: `dx [T, h]`, `dprobs [T, k]` of this rank's tokens, and
/// the held experts' `dfc1`, `dfc2` (the layouts of their parameters).
pub(super) struct ExpertGrads {
    pub dx: Vec<f32>,
    pub dprobs: Vec<f32>,
    pub dfc1: Vec<f32>,
    pub dfc2: Vec<f32>,
}

/// The held experts' weights widened to f32 (borrowed when stored in f32).
struct Weights<'a> {
    fc1: Cow<'a, [f32]>,
    fc2: Cow<'a, [f32]>,
}

impl<'a> Weights<'a> {
    fn of(pass: &Pass<'a>, m: &MoeMlp) -> Weights<'a> {
        Weights {
            fc1: pass.model.param(m.experts_fc1).to_f32(),
            fc2: pass.model.param(m.experts_fc2).to_f32(),
        }
    }

    fn view(&self, pass: &Pass<'_>) -> ExpertWeights<'_> {
        let moe = pass.c.moe.as_ref().expect("an MoE layer has an MoE config");
        ExpertWeights {
            fc1: &self.fc1,
            fc2: &self.fc2,
            hidden: pass.c.hidden_size,
            ffn: moe.moe_ffn_hidden_size,
        }
    }
}

fn nn_error(e: ferrotron_nn::NnError) -> ModelError {
    ModelError::Comm(format!("MoE token dispatch: {e}"))
}

/// `y [T, h]`: the routed experts of `m` over this rank's tokens `x [T, h]` as `routing`
/// says (each expert's output a partial sum over tensor-parallel ranks).
///
/// # Errors
/// A failed exchange of the expert-parallel group.
pub(super) fn routed_forward(
    pass: &Pass<'_>,
    m: &MoeMlp,
    x: &[f32],
    routing: &Routing,
) -> Result<(Vec<f32>, ExpertRun)> {
    let weights = Weights::of(pass, m);
    let w = weights.view(pass);
    match &pass.model.ep {
        None => {
            let (y, acts) = experts_forward(x, routing, &w);
            Ok((y, ExpertRun::Local(acts)))
        }
        Some(ep) => {
            let e = pass.c.moe.as_ref().map_or(0, |m| m.num_experts());
            let (y, acts) = ep_experts_forward(ep.comm(), x, routing, e, &w).map_err(nn_error)?;
            Ok((y, ExpertRun::Parallel(acts)))
        }
    }
}

/// [`routed_forward`]'s backward for `dy [T, h]`.
///
/// # Errors
/// A failed exchange of the expert-parallel group.
pub(super) fn routed_backward(
    pass: &Pass<'_>,
    m: &MoeMlp,
    routing: &Routing,
    run: &ExpertRun,
    dy: &[f32],
) -> Result<ExpertGrads> {
    let weights = Weights::of(pass, m);
    let w = weights.view(pass);
    Ok(match (run, &pass.model.ep) {
        (ExpertRun::Local(acts), None) => {
            let g = experts_backward(routing, &w, acts, dy);
            ExpertGrads {
                dx: g.dx,
                dprobs: g.dprobs,
                dfc1: g.dfc1,
                dfc2: g.dfc2,
            }
        }
        (ExpertRun::Parallel(acts), Some(ep)) => {
            let g = ep_experts_backward(ep.comm(), routing, &w, acts, dy).map_err(nn_error)?;
            ExpertGrads {
                dx: g.dx,
                dprobs: g.dprobs,
                dfc1: g.dfc1,
                dfc2: g.dfc2,
            }
        }
        _ => unreachable!("the backward runs on the model that ran the forward"),
    })
}
