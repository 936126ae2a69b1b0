//! Expert parallelism (the `alltoall` and `allgather` dispatchers) against all experts on one
//! rank: at ep 2 and
//! ep 4 (in-process ranks, each with its own tokens and routing), every rank's output, input
//! and routing-weight gradients (also with tokens dropped over capacity, and padded to it)
//! equal the one-rank experts' on its tokens, and each rank's
//! expert weight gradients equal the one-rank gradients summed over every rank's tokens.

use ferrotron_comm::{Communicator, run_local};
use ferrotron_nn::moe::{
    DropPolicy, ExpertWeights, ag_experts_backward, ag_experts_forward, ep_experts_backward,
    ep_experts_forward, experts_backward, experts_forward,
};
use ferrotron_tensor::gemm::WeightRef;

mod common;
use common::{assert_close, mixtral_router, values};

const T: usize = 7;
const H: usize = 6;
const F: usize = 4;
const E: usize = 8;

#[test]
fn expert_parallel_equals_one_rank() {
    let cfg = mixtral_router(E);
    let (fc1, fc2) = (values(E * 2 * F * H, 1, 1.0), values(E * H * F, 2, 1.0));
    let full = ExpertWeights {
        fc1: WeightRef::F32(&fc1),
        fc2: WeightRef::F32(&fc2),
        hidden: H,
        ffn: F,
    };
    for (ep, capacity, pad) in [
        (2usize, None, false),
        (4, None, false),
        (2, Some(0.75f32), false),
        (2, Some(0.75), true),
    ] {
        let tokens = |r: usize| {
            (
                values(T * H, 10 + r as u64, 2.0),
                values(T * H, 20 + r as u64, 1.0),
            )
        };
        let route = |r: usize| {
            let mut routing = cfg.route(&values(T * E, 30 + r as u64, 4.0), None).unwrap();
            if let Some(c) = capacity {
                routing.drop_over_capacity(E, c, DropPolicy::Probs).unwrap();
                if pad {
                    routing.pad_to_capacity(E, c).unwrap();
                }
            }
            routing
        };
        // One rank, every expert: each rank's tokens on their own; weight gradients summed.
        let mut want_dfc1 = vec![0f32; fc1.len()];
        let mut want_dfc2 = vec![0f32; fc2.len()];
        let mut want = Vec::new();
        for r in 0..ep {
            let ((x, dy), routing) = (tokens(r), route(r));
            let (y, acts) = experts_forward(&x, &routing, &full);
            let g = experts_backward(&routing, &full, &acts, &dy);
            want_dfc1.iter_mut().zip(&g.dfc1).for_each(|(a, b)| *a += b);
            want_dfc2.iter_mut().zip(&g.dfc2).for_each(|(a, b)| *a += b);
            want.push((y, g.dx, g.dprobs));
        }
        let local = E / ep;
        // Padded to capacity (Megatron's static shapes): the alltoall dispatcher's.
        for allgather in [false, true].into_iter().filter(|&a| !(a && pad)) {
            let got = run_local(ep, |c| {
                let r = c.rank();
                let ((x, dy), routing) = (tokens(r), route(r));
                let w = ExpertWeights {
                    fc1: WeightRef::F32(&fc1[r * local * 2 * F * H..][..local * 2 * F * H]),
                    fc2: WeightRef::F32(&fc2[r * local * H * F..][..local * H * F]),
                    hidden: H,
                    ffn: F,
                };
                if allgather {
                    let (y, acts) = ag_experts_forward(&c, &x, &routing, E, &w)?;
                    let mut d1 = vec![0f32; w.fc1.len()];
                    let mut d2 = vec![0f32; w.fc2.len()];
                    let (dx, dprobs) = ag_experts_backward(&c, &w, &acts, &dy, (&mut d1, &mut d2))?;
                    return Ok::<_, ferrotron_nn::NnError>((y, dx, dprobs, d1, d2));
                }
                let (y, acts) = ep_experts_forward(&c, &x, &routing, E, &w)?;
                let g = ep_experts_backward(&c, &routing, &w, &acts, &dy)?;
                Ok((y, g.dx, g.dprobs, g.dfc1, g.dfc2))
            })
            .unwrap_or_else(|e| panic!("{e}"));
            let label = if allgather { "allgather" } else { "alltoall" };
            for (r, (y, dx, dprobs, dfc1, dfc2)) in got.into_iter().enumerate() {
                let (wy, wdx, wdp) = &want[r];
                let at = |what: &str| format!("{label} ep{ep} rank {r} {what}");
                assert_close(&at("y"), &y, wy);
                assert_close(&at("dx"), &dx, wdx);
                assert_close(&at("dprobs"), &dprobs, wdp);
                let n1 = local * 2 * F * H;
                assert_close(&at("dfc1"), &dfc1, &want_dfc1[r * n1..][..n1]);
                let n2 = local * H * F;
                assert_close(&at("dfc2"), &dfc2, &want_dfc2[r * n2..][..n2]);
            }
        }
    }
}
