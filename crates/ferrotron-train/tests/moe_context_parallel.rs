//! MoE layers under context parallelism are exact against one rank (f32, 1e-5 on every
//! iteration's LM loss and every final parameter; the logged load-balancing and z losses to
//! 1e-6), on causal rows and on packed documents (split per document): the balancing losses
//! take the expert counts and token totals of the whole sequence (summed over the
//! context-parallel group, Megatron's TP x CP sums) and each rank's part of them over its own
//! rows. Mixtral with `aux_loss` and a z-loss at cp 2 (each exchange), cp 2 x ep 2 (the
//! experts folded over the context-parallel ranks), cp 2 x tp 2 with sequence parallelism and
//! cp 2 x dp 2 x ep 2 with the distributed optimizer; Qwen2-MoE (shared expert) with
//! `seq_aux_loss`; DeepSeek-V2-Lite (multi-latent attention) with `global_aux_loss`; and
//! aux-loss-free routing, whose expert biases move on the counts of every rank's tokens.

mod common;

use common::layouts::*;
use common::*;
use ferrotron_comm::run_local;
use ferrotron_data::MicroBatch;
use ferrotron_model::{GptModel, LoadBalancing};
use ferrotron_nn::CpCommType;
use ferrotron_train::trainer::{TrainError, Trainer};

type Batches = fn(usize, usize, usize) -> Vec<MicroBatch>;

/// The fixture `name` with load balancing `lb` (coefficient 1e-2) and a z-loss.
fn with_losses(name: &str, lb: LoadBalancing) -> GptModel {
    let mut model = fixture(name);
    model
        .update_moe(|m| {
            m.load_balancing_type = lb;
            m.aux_loss_coeff = 1e-2;
            m.z_loss_coeff = Some(1e-3);
        })
        .unwrap();
    model
}

/// The tiny Mixtral with sigmoid routing and an expert bias (aux-loss-free, rate 1e-2).
fn expert_bias_mixtral() -> GptModel {
    let mut c = fixture("tiny-mixtral").config().clone();
    let moe = c.moe.as_mut().unwrap();
    moe.router.score_function = ferrotron_model::ScoreFunction::Sigmoid;
    moe.expert_bias_update_rate = Some(1e-2);
    moe.load_balancing_type = LoadBalancing::AuxLoss;
    let init = ferrotron_model::InitConfig {
        init_method_std: 0.1,
        ..Default::default()
    };
    GptModel::init_random(c, init).unwrap()
}

fn cp2(comm_type: CpCommType) -> Layout {
    Layout {
        cp: 2,
        cp_comm_type: comm_type,
        ..Layout::default()
    }
}

/// Every layout of `layouts` (name, world size, layout) on `model()` (fixture `fixture`'s
/// shape) gives the one-rank run, MoE losses included, on causal and packed rows; key biases
/// are not compared ([`without_key_bias`]: their true gradient is 0).
fn assert_layouts(
    (name, fixture): (&str, &str),
    model: &(dyn Fn() -> GptModel + Sync),
    layouts: &[(&str, usize, Layout)],
) {
    for (kind, batches) in [
        ("causal", rank_batches as Batches),
        ("packed", packed_batches),
    ] {
        let mut one = Trainer::new(model(), dp_options(1, ITERS)).unwrap();
        let (reference, moe) = train_moe_on(&mut one, batches);
        let reference = without_key_bias(&reference, fixture);
        for &(layout_name, world, layout) in layouts {
            let label = format!("{name} {kind} {layout_name}");
            let runs = run_local(world, |comm| {
                let mut t = layout.trainer(comm, ITERS, model())?;
                Ok::<_, TrainError>(train_moe_on(&mut t, batches))
            })
            .unwrap_or_else(|e| panic!("{label}: {e}"));
            for (r, (run, got)) in runs.iter().enumerate() {
                let run = without_key_bias(run, fixture);
                assert_same_run(&format!("{label} rank {r}"), &run, &reference);
                for (it, (a, b)) in got.iter().zip(&moe).enumerate() {
                    let at = |what: &str| format!("{label} rank {r} it {it} {what}");
                    if let (Some(a), Some(b)) = (a.load_balancing_loss, b.load_balancing_loss) {
                        assert_close(&at("lb"), a, b, 1e-6);
                    }
                    if let (Some(a), Some(b)) = (a.z_loss, b.z_loss) {
                        assert_close(&at("z"), a, b, 1e-6);
                    }
                }
            }
        }
    }
}

#[test]
fn mixtral_aux_loss_under_cp_matches_one_rank() {
    let model = || with_losses("tiny-mixtral", LoadBalancing::AuxLoss);
    assert_layouts(
        ("mixtral", "tiny-mixtral"),
        &model,
        &[
            ("cp2 p2p", 2, cp2(CpCommType::P2p)),
            ("cp2 all_gather", 2, cp2(CpCommType::AllGather)),
            (
                "cp2 ep2",
                2,
                Layout {
                    ep: 2,
                    ..cp2(CpCommType::P2p)
                },
            ),
            (
                "cp2 tp2 sp",
                4,
                Layout {
                    tp: 2,
                    sp: true,
                    ..cp2(CpCommType::P2p)
                },
            ),
            (
                "cp2 dp2 ep2 distributed",
                4,
                Layout {
                    ep: 2,
                    distributed: true,
                    ..cp2(CpCommType::AllGather)
                },
            ),
        ],
    );
}

#[test]
fn other_balancing_losses_under_cp_match_one_rank() {
    let qwen = || with_losses("tiny-qwen2-moe", LoadBalancing::SeqAuxLoss);
    let ep2 = Layout {
        ep: 2,
        ..cp2(CpCommType::P2p)
    };
    assert_layouts(
        ("qwen2-moe seq_aux_loss", "tiny-qwen2-moe"),
        &qwen,
        &[("cp2 ep2", 2, ep2)],
    );
    // global_aux_loss is exact against one rank without data parallelism only: its counts
    // run over each rank's micro-batches (Megatron's `ga_steps`), which data parallelism
    // regroups.
    let name = "tiny-deepseek-v2-lite";
    let cp2 = cp2(CpCommType::P2p);
    let global = || with_losses(name, LoadBalancing::GlobalAuxLoss);
    let label = ("deepseek-v2-lite global_aux_loss", name);
    assert_layouts(label, &global, &[("cp2", 2, cp2)]);
    let seq = || with_losses(name, LoadBalancing::SeqAuxLoss);
    let label = ("deepseek-v2-lite seq_aux_loss", name);
    assert_layouts(label, &seq, &[("cp2 dp2", 4, cp2)]);
    assert_layouts(
        ("expert bias", "tiny-mixtral"),
        &expert_bias_mixtral,
        &[("cp2 ep2", 2, ep2)],
    );
}
