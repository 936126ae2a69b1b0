//! Aux-loss-free load balancing (Megatron's `moe_router_enable_expert_bias`): the routers'
//! expert biases move by the update rate after every step, in f32 whatever the weights'
//! dtype; the layouts give the single rank's run, and checkpoints keep the biases exactly.

mod common;

use common::layouts::*;
use common::*;
use ferrotron_comm::run_local;
use ferrotron_model::{GptModel, LoadBalancing};
use ferrotron_tensor::DType;
use ferrotron_train::trainer::{MoeMetrics, TrainError, Trainer};

/// A run's losses, final parameters and per-iteration MoE metrics.
fn train_moe(t: &mut Trainer) -> (Run, Vec<MoeMetrics>) {
    train_moe_on(t, rank_batches)
}

/// Every MoE layer's bias moved, each element by a whole number of steps of the rate (to
/// 1e-4 of a step: an f32 sum of the rate; a bias rounded to bf16 is off by ~1e-3 of it per
/// 0.01), at most one step per iteration.
fn assert_biases_moved_by_the_rate(run: &Run) {
    let biases: Vec<_> = run
        .1
        .iter()
        .filter(|(n, _)| n.ends_with("router.expert_bias"))
        .collect();
    assert_eq!(biases.len(), 2, "one bias per MoE layer");
    for (name, b) in &biases {
        assert!(b.iter().any(|&v| v != 0.0), "{name}: {b:?}");
        for v in b.iter() {
            let steps = v / RATE;
            assert!(
                (steps - steps.round()).abs() < 1e-4 && steps.abs() <= ITERS as f32,
                "{name}: {b:?}"
            );
        }
    }
}

/// The expert bias's update rate in [`expert_bias_model`].
const RATE: f32 = 1e-2;

/// The tiny Mixtral's shape with sigmoid routing and an expert bias (aux-loss-free, Megatron's
/// `moe_router_enable_expert_bias`), random weights, the balancing losses on.
fn expert_bias_model() -> GptModel {
    expert_bias_model_in(DType::F32)
}

/// [`expert_bias_model`] with weights stored in `params_dtype` (the bias is f32 always).
fn expert_bias_model_in(params_dtype: DType) -> GptModel {
    let mut c = fixture("tiny-mixtral").config().clone();
    let moe = c.moe.as_mut().unwrap();
    moe.router.score_function = ferrotron_model::ScoreFunction::Sigmoid;
    moe.expert_bias_update_rate = Some(RATE);
    moe.load_balancing_type = LoadBalancing::AuxLoss;
    moe.z_loss_coeff = Some(1e-3);
    let init = ferrotron_model::InitConfig {
        init_method_std: 0.1,
        params_dtype,
        ..Default::default()
    };
    GptModel::init_random(c, init).unwrap()
}

/// Aux-loss-free routing: every MoE layer's bias moves each step by whole multiples of the
/// rate; dp 2 + ZeRO-1, ep 2, tp 2 + sp, pp 2 and tp 2 x ep 2 give the single rank's losses
/// and parameters, biases included (their counts summed over the data-parallel ranks); a
/// checkpoint saved under ep 2 resumes on one rank with its biases.
#[test]
fn expert_bias_moves_and_layouts_match_one_rank() {
    let mut one = Trainer::new(expert_bias_model(), dp_options(1, ITERS)).unwrap();
    let (reference, _) = train_moe(&mut one);
    assert_biases_moved_by_the_rate(&reference);
    // (tp, pp, dp, ep, sequence parallel, distributed optimizer)
    let layouts = [
        (1, 1, 2, 1, false, true),
        (1, 1, 2, 2, false, false),
        (2, 1, 1, 1, true, false),
        (1, 2, 1, 1, false, false),
        (2, 1, 2, 2, true, false),
    ];
    for (tp, pp, dp, ep, sp, distributed) in layouts {
        let layout = Layout {
            tp,
            pp,
            sp,
            distributed,
            ep,
            ..Layout::default()
        };
        let label = format!("expert bias tp{tp} pp{pp} dp{dp} ep{ep} sp={sp}");
        let runs = run_local(tp * pp * dp, |comm| {
            let mut t = layout.trainer(comm, ITERS, expert_bias_model())?;
            Ok::<_, TrainError>(train_moe(&mut t))
        })
        .unwrap_or_else(|e| panic!("{label}: {e}"));
        for (r, (run, _)) in runs.iter().enumerate() {
            assert_same_run(&format!("{label} rank {r}"), run, &reference);
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let ep2 = Layout {
        ep: 2,
        ..Layout::default()
    };
    let ckpt = save_after_two(2, ep2, expert_bias_model, dir.path());
    let tail = tail_of(&reference);
    assert_resumes(
        "expert bias ep2 -> 1",
        1,
        Layout::default(),
        expert_bias_model,
        &ckpt,
        &tail,
    );
}

/// bf16 weights with fp32 master weights: the biases stay f32 (Megatron's fp32 buffer) and
/// move by whole steps of the rate; a checkpoint saved under ep 2 resumes under ep 2 with
/// the same losses and parameters, biases included.
#[test]
fn expert_bias_stays_f32_under_bf16_training() {
    let model = || expert_bias_model_in(DType::BF16);
    let ep2 = Layout {
        ep: 2,
        bf16: true,
        ..Layout::default()
    };
    let runs = run_local(2, |comm| {
        let mut t = ep2.trainer(comm, ITERS, model())?;
        Ok::<_, TrainError>(train_moe(&mut t).0)
    })
    .unwrap();
    let reference = &runs[0];
    assert!(reference.0[ITERS - 1] < reference.0[0], "{:?}", reference.0);
    assert_biases_moved_by_the_rate(reference);
    let dir = tempfile::tempdir().unwrap();
    let ckpt = save_after_two(2, ep2, model, dir.path());
    assert_resumes(
        "bf16 expert bias ep2",
        2,
        ep2,
        model,
        &ckpt,
        &tail_of(reference),
    );
}
