//! Benchmark of an MoE layer's experts (forward + backward), the median of several runs:
//!
//! - `grouped`: [`experts_forward`] / [`experts_backward_into`], the experts' GEMMs run side
//!   by side (Megatron's `GroupedMLP`), the weight gradients accumulated into gradient
//!   buffers that live across steps, as in training;
//! - `sequential`: the same math with one expert after another, each GEMM using every thread
//!   (Megatron's `SequentialMLP`, the per-expert loop);
//! - `ep2`: two in-process expert-parallel ranks with the alltoall dispatcher
//!   ([`ep_experts_forward`] / [`ep_experts_backward_into`]), each with half the experts and
//!   half the tokens, and the time of the exchanges alone (four all-to-alls of the routed
//!   rows, as one forward and backward make).
//!
//! `cargo bench -p ferrotron-nn --bench moe_experts [-- T H F E K]` (defaults: 1024 tokens,
//! h 512, expert width 1024, 8 experts, top-2). Prints one JSON line.

use ferrotron_comm::{Collectives, Communicator, run_local};
use ferrotron_nn::moe::{
    ExpertWeights, RouterConfig, Routing, ScoreFunction, ep_experts_backward_into,
    ep_experts_forward, experts_backward_into, experts_forward,
};
use ferrotron_tensor::gemm::WeightRef;
use ferrotron_tensor::gemm::{Op, sgemm};
use ferrotron_tensor::ops::{swiglu_packed, swiglu_packed_backward};

mod common;
use common::{time, values};

/// Forward and backward of every expert, one after another (each GEMM multi-threaded),
/// accumulating the weight gradients into `dfc1`, `dfc2`.
fn sequential(
    x: &[f32],
    routing: &Routing,
    w: &ExpertWeights<'_>,
    dy: &[f32],
    (dfc1, dfc2): (&mut [f32], &mut [f32]),
) -> f32 {
    let (h, f, e) = (w.hidden, w.ffn, w.num_experts());
    let (WeightRef::F32(fc1_all), WeightRef::F32(fc2_all)) = (w.fc1, w.fc2) else {
        panic!("the per-expert loop runs on f32 weights");
    };
    let k = routing.topk();
    let mut y = vec![0f32; x.len()];
    let mut dx = vec![0f32; x.len()];
    for ex in 0..e {
        let slots: Vec<usize> = (0..routing.experts.len())
            .filter(|&s| routing.experts[s] as usize == ex)
            .collect();
        let m = slots.len();
        if m == 0 {
            continue;
        }
        let xe: Vec<f32> = slots
            .iter()
            .flat_map(|&s| x[s / k * h..][..h].iter().copied())
            .collect();
        let w1 = &fc1_all[ex * 2 * f * h..][..2 * f * h];
        let w2 = &fc2_all[ex * h * f..][..h * f];
        let mut fc1 = vec![0f32; m * 2 * f];
        sgemm(m, 2 * f, h, &xe, Op::N, w1, Op::T, &mut fc1, false);
        let mut act = vec![0f32; m * f];
        swiglu_packed(&fc1, &mut act, f);
        let mut out = vec![0f32; m * h];
        sgemm(m, h, f, &act, Op::N, w2, Op::T, &mut out, false);
        let mut dout = vec![0f32; m * h];
        for (i, &s) in slots.iter().enumerate() {
            let (t, p) = (s / k, routing.probs[s]);
            for c in 0..h {
                y[t * h + c] += p * out[i * h + c];
                dout[i * h + c] = p * dy[t * h + c];
            }
        }
        let mut dact = vec![0f32; m * f];
        sgemm(m, f, h, &dout, Op::N, w2, Op::N, &mut dact, false);
        let dw2 = &mut dfc2[ex * h * f..][..h * f];
        sgemm(h, f, m, &dout, Op::T, &act, Op::N, dw2, true);
        let mut dfc1_out = vec![0f32; m * 2 * f];
        swiglu_packed_backward(&fc1, &dact, &mut dfc1_out, f);
        let mut dxe = vec![0f32; m * h];
        sgemm(m, h, 2 * f, &dfc1_out, Op::N, w1, Op::N, &mut dxe, false);
        let dw1 = &mut dfc1[ex * 2 * f * h..][..2 * f * h];
        sgemm(2 * f, h, m, &dfc1_out, Op::T, &xe, Op::N, dw1, true);
        for (i, &s) in slots.iter().enumerate() {
            let t = s / k;
            for c in 0..h {
                dx[t * h + c] += dxe[i * h + c];
            }
        }
    }
    y[0] + dx[0] + dfc1[0] + dfc2[0]
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let arg = |i: usize, default: usize| args.get(i).copied().unwrap_or(default);
    let (t, h, f, e, k) = (
        arg(0, 1024),
        arg(1, 512),
        arg(2, 1024),
        arg(3, 8),
        arg(4, 2),
    );
    ferrotron_tensor::allocator::retain_freed_memory();
    let runs = 5;
    let router = RouterConfig {
        num_experts: e,
        topk: k,
        score_function: ScoreFunction::Softmax,
        pre_softmax: false,
        groups: None,
        scaling_factor: None,
    };
    let (x, dy) = (values(t * h, 1, 2.0), values(t * h, 2, 2.0));
    let routing = router.route(&values(t * e, 3, 4.0), None).unwrap();
    let (fc1, fc2) = (values(e * 2 * f * h, 4, 0.1), values(e * h * f, 5, 0.1));
    let w = ExpertWeights {
        fc1: WeightRef::F32(&fc1),
        fc2: WeightRef::F32(&fc2),
        hidden: h,
        ffn: f,
    };
    // Gradient buffers that live across steps, as a trainer's do.
    let (mut dfc1, mut dfc2) = (vec![0f32; fc1.len()], vec![0f32; fc2.len()]);
    let grouped = time(runs, || {
        let (y, acts) = experts_forward(&x, &routing, &w);
        let g = experts_backward_into(&routing, &w, &acts, &dy, (&mut dfc1, &mut dfc2));
        std::hint::black_box((y, g));
    });
    let seq = time(runs, || {
        std::hint::black_box(sequential(&x, &routing, &w, &dy, (&mut dfc1, &mut dfc2)));
    });
    // Two expert-parallel ranks, each with half the tokens and half the experts.
    let half = t / 2;
    let ep = run_local(2, |comm| {
        let r = comm.rank();
        let xr = &x[r * half * h..][..half * h];
        let dyr = &dy[r * half * h..][..half * h];
        let routing = router
            .route(&values(half * e, 10 + r as u64, 4.0), None)
            .unwrap();
        let local = e / 2;
        let w = ExpertWeights {
            fc1: WeightRef::F32(&fc1[r * local * 2 * f * h..][..local * 2 * f * h]),
            fc2: WeightRef::F32(&fc2[r * local * h * f..][..local * h * f]),
            hidden: h,
            ffn: f,
        };
        let (mut d1, mut d2) = (vec![0f32; w.fc1.len()], vec![0f32; w.fc2.len()]);
        let total = time(runs, || {
            let (y, acts) = ep_experts_forward(&comm, xr, &routing, e, &w).unwrap();
            let grads = (&mut d1[..], &mut d2[..]);
            let g = ep_experts_backward_into(&comm, &routing, &w, &acts, dyr, grads).unwrap();
            std::hint::black_box((y, g));
        });
        let rows = vec![0f32; half * k * h];
        let mut got = vec![0f32; half * k * h];
        let exchange = time(runs, || {
            for _ in 0..4 {
                comm.all_to_all(&rows, &mut got).unwrap();
            }
        });
        Ok::<_, String>((total, exchange))
    })
    .unwrap();
    let ep_total = ep.iter().map(|r| r.0).fold(0.0, f64::max);
    let ep_exchange = ep.iter().map(|r| r.1).fold(0.0, f64::max);
    // Forward 3 GEMMs of 2·(T·k)·h·f FLOPs, backward twice that.
    let flops = 3.0 * 3.0 * 2.0 * (t * k) as f64 * (h * f) as f64;
    println!(
        "{{\"tokens\": {t}, \"hidden\": {h}, \"ffn\": {f}, \"experts\": {e}, \"topk\": {k}, \
         \"threads\": {}, \"grouped_ms\": {grouped:.2}, \"sequential_ms\": {seq:.2}, \
         \"grouped_gflops\": {:.1}, \"sequential_over_grouped\": {:.2}, \
         \"ep2_ms\": {ep_total:.2}, \"ep2_exchange_ms\": {ep_exchange:.2}}}",
        rayon::current_num_threads(),
        flops / grouped / 1e6,
        seq / grouped
    );
}
