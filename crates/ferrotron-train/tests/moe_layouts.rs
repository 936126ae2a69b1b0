//! The MoE families (Mixtral, Qwen2-MoE, OLMoE, DeepSeek-V2 and V2-Lite with multi-latent
//! attention, the committed tiny fixtures) train exactly
//! under the parallel layouts with their balancing losses on (Megatron's `aux_loss` at the
//! fixture's `router_aux_loss_coef` and a z-loss): tp 2 (the experts' widths split, Megatron's
//! expert tensor parallelism at `expert_tensor_parallel_size` = tp) with and without sequence
//! parallelism, pp 2, dp 2 with the distributed optimizer, tp 2 x pp 2 and pp 2 x dp 2, and
//! expert parallelism (the alltoall dispatcher; expert gradients reduced over the
//! expert-data-parallel ranks; the alltoall and the allgather dispatchers): ep 2, ep 4, ep 2
//! over dp 4 (with and without the distributed optimizer), ep 2 x pp 2 and ep 2 x tp 2 (at
//! expert tensor-parallel sizes 2 and 1, with and without sequence parallelism), and ep 2 with
//! overlapped gradient reduction and parameter gathers give
//! the single rank's per-iteration LM losses, load-balancing and z losses, and final
//! parameters (in-process ranks).

mod common;

use common::layouts::*;
use common::*;
use ferrotron_comm::run_local;
use ferrotron_model::{GptModel, LoadBalancing, TokenDispatcher, TrainBatch};
use ferrotron_train::trainer::{MoeMetrics, TrainError, Trainer};

/// The fixture with Megatron's balancing losses on.
fn moe_fixture(name: &str) -> GptModel {
    with_dispatcher(name, TokenDispatcher::AllToAll)
}

/// [`moe_fixture`] with `dispatcher` under expert parallelism.
fn with_dispatcher(name: &str, dispatcher: TokenDispatcher) -> GptModel {
    let mut model = fixture(name);
    model
        .update_moe(|m| {
            m.load_balancing_type = LoadBalancing::AuxLoss;
            m.z_loss_coeff = Some(1e-3);
            m.token_dispatcher = dispatcher;
        })
        .unwrap();
    model
}

/// A run's losses, final parameters and per-iteration MoE metrics.
fn train_moe(t: &mut Trainer) -> (Run, Vec<MoeMetrics>) {
    train_moe_on(t, rank_batches)
}

fn moe_layouts_match_one_rank(name: &str, pipeline: bool) {
    let experts = moe_fixture(name)
        .config()
        .moe
        .as_ref()
        .unwrap()
        .num_experts();
    let mut one = Trainer::new(moe_fixture(name), dp_options(1, ITERS)).unwrap();
    let (reference, moe) = train_moe(&mut one);
    assert!(
        reference.0[ITERS - 1] < reference.0[0],
        "{name}: the loss falls: {:?}",
        reference.0
    );
    for m in &moe {
        let lb = m.load_balancing_loss.unwrap();
        // About 1 for an even load, at most E/k... for a collapsed router.
        assert!((0.5..4.0).contains(&lb), "{name}: load_balancing_loss {lb}");
        assert!(m.z_loss.unwrap() > 0.0);
    }
    // (tp, pp, dp, ep, sequence parallel, distributed optimizer, dispatcher, etp 1)
    let (a2a, ag) = (TokenDispatcher::AllToAll, TokenDispatcher::AllGather);
    let mut layouts = vec![
        (1, 1, 2, 1, false, true, a2a, false),
        (2, 1, 1, 1, false, false, a2a, false),
        (2, 1, 1, 1, true, false, a2a, false),
        (1, 1, 2, 2, false, false, a2a, false),
        (1, 1, 2, 2, false, true, a2a, false),
        (1, 1, 4, 2, false, false, a2a, false),
        (1, 1, 4, 2, false, true, a2a, false),
        (2, 1, 2, 2, true, false, a2a, false),
        (1, 1, 2, 2, false, false, ag, false),
        (1, 1, 4, 2, false, true, ag, false),
        (2, 1, 2, 2, true, false, ag, false),
        // expert_tensor_parallel_size 1: whole experts, each tp rank its share of the rows.
        (2, 1, 1, 1, false, false, a2a, true),
        (2, 1, 1, 1, true, false, a2a, true),
        (2, 1, 2, 2, true, false, a2a, true),
        (2, 1, 2, 2, false, true, a2a, true),
        (2, 1, 2, 2, true, false, ag, true),
    ];
    if experts.is_multiple_of(4) {
        layouts.push((1, 1, 4, 4, false, false, a2a, false));
    }
    if pipeline {
        layouts.extend([
            (1, 2, 1, 1, false, false, a2a, false),
            (1, 2, 2, 1, false, true, a2a, false),
            (2, 2, 1, 1, true, false, a2a, false),
            (1, 2, 2, 2, false, false, a2a, false),
            (2, 2, 1, 1, true, false, a2a, true),
        ]);
    }
    // Overlapped gradient reduction and parameter gathers, the expert buckets on the
    // expert-data-parallel group's own threads: (tp, dp, ep, distributed).
    let overlapped = [(1, 2, 2, false), (1, 4, 2, true), (2, 4, 2, true)];
    let overlapped = overlapped.map(|(tp, dp, ep, d)| (tp, 1, dp, ep, tp > 1, d, a2a, false, true));
    let layouts = layouts
        .into_iter()
        .map(|(tp, pp, dp, ep, sp, d, x, w)| (tp, pp, dp, ep, sp, d, x, w, false))
        .chain(overlapped);
    for (tp, pp, dp, ep, sp, distributed, dispatcher, whole_experts, overlap) in layouts {
        let layout = Layout {
            tp,
            pp,
            sp,
            distributed,
            ep,
            whole_experts,
            overlap,
            overlap_params: overlap && distributed,
            ..Layout::default()
        };
        let etp = if whole_experts { 1 } else { tp };
        let label = format!(
            "{name} tp{tp} pp{pp} dp{dp} ep{ep} etp{etp} sp={sp} distributed={distributed} \
             {dispatcher:?} overlap={overlap}"
        );
        let runs = run_local(tp * pp * dp, |comm| {
            let mut t = layout.trainer(comm, ITERS, with_dispatcher(name, dispatcher))?;
            assert_expert_widths(t.model(), tp, etp, ep);
            Ok::<_, TrainError>(train_moe(&mut t))
        })
        .unwrap_or_else(|e| panic!("{label}: {e}"));
        for (r, (run, got)) in runs.iter().enumerate() {
            assert_same_run(&format!("{label} rank {r}"), run, &reference);
            for (it, (a, b)) in got.iter().zip(&moe).enumerate() {
                let (a_lb, b_lb) = (
                    a.load_balancing_loss.unwrap(),
                    b.load_balancing_loss.unwrap(),
                );
                assert_close(&format!("{label} rank {r} it {it} lb"), a_lb, b_lb, 1e-6);
                let (a_z, b_z) = (a.z_loss.unwrap(), b.z_loss.unwrap());
                assert_close(&format!("{label} rank {r} it {it} z"), a_z, b_z, 1e-6);
            }
        }
    }
}

/// Every expert stack of `shard` holds `E/ep` experts of width `f/etp` (`f` the full width).
fn assert_expert_widths(shard: &GptModel, tp: usize, etp: usize, ep: usize) {
    let moe = shard.config().moe.as_ref().unwrap();
    let (e, f, h) = (
        moe.num_experts(),
        moe.moe_ffn_hidden_size,
        shard.config().hidden_size,
    );
    for (i, d) in shard.layout().decls().iter().enumerate() {
        if !shard.is_expert_param(i) {
            continue;
        }
        let want = if d.name.contains("linear_fc1") {
            [e / ep * 2 * f / etp, h]
        } else {
            [e / ep * h, f / etp]
        };
        let local = shard.param_table().view(i);
        assert_eq!(local.shape(), want, "{} at tp{tp} etp{etp} ep{ep}", d.name);
    }
}

/// A checkpoint saved under ep 2 (over dp 2), ep 2 over dp 4 with the distributed
/// optimizer, or tp 2 x ep 2 with whole experts resumes on one rank and under other
/// expert-parallel layouts, continuing the uninterrupted single-rank run.
#[test]
fn expert_parallel_checkpoints_resume_under_other_layouts() {
    let name = "tiny-mixtral";
    let mut one = Trainer::new(moe_fixture(name), dp_options(1, ITERS)).unwrap();
    let (reference, _) = train_moe(&mut one);
    let tail = tail_of(&reference);
    let dir = tempfile::tempdir().unwrap();
    let ep2 = Layout {
        ep: 2,
        ..Layout::default()
    };
    let ckpt = save_after_two(2, ep2, || moe_fixture(name), dir.path());
    assert_resumes(
        "ep2 -> 1 rank",
        1,
        Layout::default(),
        || moe_fixture(name),
        &ckpt,
        &tail,
    );
    let ep2_pp2 = Layout {
        ep: 2,
        pp: 2,
        ..Layout::default()
    };
    assert_resumes(
        "ep2 -> ep2 x pp2",
        4,
        ep2_pp2,
        || moe_fixture(name),
        &ckpt,
        &tail,
    );
    // ep 2 over dp 4 with the distributed optimizer: every rank writes its optimizer shard.
    let ep2_zero1 = Layout {
        ep: 2,
        distributed: true,
        ..Layout::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let ckpt = save_after_two(4, ep2_zero1, || moe_fixture(name), dir.path());
    let one = Layout::default();
    assert_resumes(
        "ep2 dp4 zero1 -> 1",
        1,
        one,
        || moe_fixture(name),
        &ckpt,
        &tail,
    );
    assert_resumes(
        "ep2 dp4 zero1 -> ep2 dp2",
        2,
        ep2,
        || moe_fixture(name),
        &ckpt,
        &tail,
    );
    // Whole experts (expert_tensor_parallel_size 1) under tp 2 x ep 2 with the distributed
    // optimizer, resumed with split experts (etp 2) and on one rank.
    let whole = Layout {
        tp: 2,
        ep: 2,
        sp: true,
        distributed: true,
        whole_experts: true,
        ..Layout::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let ckpt = save_after_two(4, whole, || moe_fixture(name), dir.path());
    let split = Layout {
        whole_experts: false,
        ..whole
    };
    assert_resumes(
        "tp2 ep2 etp1 -> etp2",
        4,
        split,
        || moe_fixture(name),
        &ckpt,
        &tail,
    );
    assert_resumes(
        "tp2 ep2 etp1 -> 1",
        1,
        Layout::default(),
        || moe_fixture(name),
        &ckpt,
        &tail,
    );
}

#[test]
fn mixtral() {
    moe_layouts_match_one_rank("tiny-mixtral", true);
}

#[test]
fn qwen2_moe_dense_layer_and_shared_expert() {
    // 3 layers: no even pipeline split.
    moe_layouts_match_one_rank("tiny-qwen2-moe", false);
}

#[test]
fn olmoe() {
    moe_layouts_match_one_rank("tiny-olmoe", true);
}

/// Multi-latent attention under tensor parallelism (up projections split by heads, the
/// replicated down projections' and latent norms' partial gradients summed), with and
/// without sequence parallelism, beside max-grouped, scaled routing and shared experts.
#[test]
fn deepseek_v2_multi_latent_attention() {
    moe_layouts_match_one_rank("tiny-deepseek-v2", false);
}

/// V2-Lite: queries projected directly, greedy routing; pipeline layouts too.
#[test]
fn deepseek_v2_lite() {
    moe_layouts_match_one_rank("tiny-deepseek-v2-lite", true);
}

/// bf16 weights with fp32 master weights: the Mixtral fixture's losses track the f32 run's
/// (the experts compute in f32 on the bf16 weights) and fall.
#[test]
fn bf16_training_tracks_f32() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-mixtral");
    let (mut bf16_model, _) =
        ferrotron_model::families::load_hf_model(&dir, ferrotron_tensor::DType::BF16).unwrap();
    bf16_model
        .update_moe(|m| m.load_balancing_type = LoadBalancing::AuxLoss)
        .unwrap();
    let mut options = dp_options(1, ITERS);
    options.precision = ferrotron_optim::Precision::Bf16;
    let mut bf16 = Trainer::new(bf16_model, options).unwrap();
    let (bf16_run, bf16_moe) = train_moe(&mut bf16);
    let mut f32_model = fixture("tiny-mixtral");
    f32_model
        .update_moe(|m| m.load_balancing_type = LoadBalancing::AuxLoss)
        .unwrap();
    let mut f32_trainer = Trainer::new(f32_model, dp_options(1, ITERS)).unwrap();
    let (f32_run, _) = train_moe(&mut f32_trainer);
    for (it, (b, f)) in bf16_run.0.iter().zip(&f32_run.0).enumerate() {
        assert!(
            (b - f).abs() < 2e-2 * f,
            "iteration {it}: bf16 {b} vs f32 {f}"
        );
    }
    assert!(bf16_run.0[ITERS - 1] < bf16_run.0[0], "{:?}", bf16_run.0);
    assert!(bf16_moe.iter().all(|m| m.load_balancing_loss.is_some()));
}

/// The tiny Mixtral with balancing loss `lb` at `coeff` and no z-loss.
fn with_balancing(lb: LoadBalancing, coeff: f32) -> GptModel {
    let mut model = fixture("tiny-mixtral");
    model
        .update_moe(|m| {
            m.load_balancing_type = lb;
            m.aux_loss_coeff = coeff;
            m.z_loss_coeff = None;
        })
        .unwrap();
    model
}

/// One rank training `model` on each whole global batch as one micro-batch.
fn whole_batches(model: GptModel) -> Run {
    let mut t = Trainer::new(model, options(GBS, GBS, ITERS as u64)).unwrap();
    let losses = (0..ITERS)
        .map(|it| {
            let batch = micro_batches(it * GBS, GBS, GBS);
            t.train_step(&batch).unwrap().loss
        })
        .collect();
    (losses, params(&t))
}

/// `global_aux_loss` balances the global batch: with the whole batch in one micro-batch on
/// one rank its training run is `aux_loss`'s; over 4 data-parallel ranks (a quarter of the
/// batch each, each gradient at loss scale 1/4 as the trainer's per-token scale gives them)
/// the counts are summed over the ranks and the token total is the global batch's, so the
/// ranks' gradients sum to the whole batch's `aux_loss` gradients at `coeff / 4` — and not
/// to the ranks' own `aux_loss`'s.
#[test]
fn global_aux_loss_balances_the_global_batch() {
    let coeff = 0.5;
    let aux = whole_batches(with_balancing(LoadBalancing::AuxLoss, coeff));
    let global = whole_batches(with_balancing(LoadBalancing::GlobalAuxLoss, coeff));
    assert_same_run(
        "global_aux_loss = aux_loss on one micro-batch",
        &global,
        &aux,
    );

    let (b, s) = (8, 16);
    let tokens: Vec<u32> = (0..b * s).map(|i| ((i * 37 + 11) % 100) as u32).collect();
    let labels: Vec<i64> = tokens
        .iter()
        .map(|&t| (i64::from(t) * 7 + 3) % 100)
        .collect();
    let grads = |model: &GptModel, rows: std::ops::Range<usize>, scale: f32| {
        let n = rows.len() / s;
        let batch = TrainBatch::from_batch_major(&tokens[rows.clone()], &labels[rows], None, n, s);
        let mut g = model.zero_grads();
        let mut views: Vec<&mut [f32]> = g.iter_mut().map(|x| x.as_mut_slice()).collect();
        model.forward_backward(&batch, &mut views, scale).unwrap();
        g
    };
    let whole = grads(
        &with_balancing(LoadBalancing::AuxLoss, coeff / 4.0),
        0..b * s,
        1.0,
    );
    let ranks = |lb| {
        let parts = run_local(4, |comm| {
            let rows = comm.world_rank() * 2 * s..(comm.world_rank() + 1) * 2 * s;
            let mut model = with_balancing(lb, coeff);
            model.set_global_aux_group(std::sync::Arc::new(comm));
            Ok::<_, TrainError>(grads(&model, rows, 0.25))
        })
        .unwrap();
        (0..whole.len())
            .map(|i| {
                (0..whole[i].len())
                    .map(|j| parts.iter().map(|p| p[i][j]).sum::<f32>())
                    .collect::<Vec<f32>>()
            })
            .collect::<Vec<_>>()
    };
    let max_rel = |got: &[Vec<f32>]| {
        got.iter()
            .zip(&whole)
            .map(|(g, w)| {
                let scale = w.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12);
                g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale
            })
            .fold(0f32, f32::max)
    };
    let global = max_rel(&ranks(LoadBalancing::GlobalAuxLoss));
    assert!(
        global < 1e-5,
        "global_aux_loss over dp 4: max rel diff {global}"
    );
    let local = max_rel(&ranks(LoadBalancing::AuxLoss));
    assert!(
        local > 1e-3,
        "the ranks' own aux_loss is another gradient: {local}"
    );
}
