//! Context parallelism is exact against one rank (f32, 1e-5 on every iteration's loss and
//! every final parameter): cp 2 with each exchange (`p2p` ring, `all_gather`, `a2a`),
//! cp 2 x tp 2 with sequence parallelism, cp 2 x pp 2, cp 2 x dp 2 with the distributed
//! optimizer, cp 4, and cp 2 under selective and full recompute — on causal rows and on
//! packed documents (per-document masks, positions reset per document, loss-masked tokens
//! unevenly spread over the ranks); a checkpoint saved under cp 2 x dp 2 resumes on one rank
//! and one saved on one rank resumes under cp 2 x tp 2.

mod common;

use common::layouts::*;
use common::*;
use ferrotron_comm::run_local;
use ferrotron_data::MicroBatch;
use ferrotron_model::{GptModel, RecomputeGranularity, RecomputeMethod};
use ferrotron_nn::CpCommType;
use ferrotron_train::trainer::{TrainError, Trainer};

type Batches = fn(usize, usize, usize) -> Vec<MicroBatch>;

/// The one-rank run of `model()` over `batches`.
fn one_rank(model: &dyn Fn() -> GptModel, batches: Batches) -> Run {
    let mut t = Trainer::new(model(), dp_options(1, ITERS)).unwrap();
    train_on(&mut t, 0, ITERS, batches)
}

/// Runs `layout` on `world` in-process ranks and checks every rank against `reference`.
fn assert_layout(
    label: &str,
    world: usize,
    layout: Layout,
    (model, batches): (&(dyn Fn() -> GptModel + Sync), Batches),
    reference: &Run,
) {
    let runs = run_local(world, |comm| {
        let mut t = layout.trainer(comm, ITERS, model())?;
        Ok::<_, TrainError>(train_on(&mut t, 0, ITERS, batches))
    })
    .unwrap_or_else(|e| panic!("{label}: {e}"));
    for (r, run) in runs.iter().enumerate() {
        assert_same_run(&format!("{label} rank {r}"), run, reference);
    }
}

fn cp(cp: usize, comm_type: CpCommType) -> Layout {
    Layout {
        cp,
        cp_comm_type: comm_type,
        ..Layout::default()
    }
}

const TYPES: [CpCommType; 3] = [CpCommType::P2p, CpCommType::AllGather, CpCommType::A2a];

#[test]
fn cp2_matches_one_rank_with_every_exchange() {
    for (kind, batches) in [
        ("causal", rank_batches as Batches),
        ("packed", packed_batches),
    ] {
        let reference = one_rank(&tiny_model, batches);
        for t in TYPES {
            let label = format!("{kind} cp2 {}", t.name());
            assert_layout(&label, 2, cp(2, t), (&tiny_model, batches), &reference);
        }
    }
}

#[test]
fn cp_with_tensor_pipeline_and_data_parallelism_matches_one_rank() {
    for (kind, batches) in [
        ("causal", rank_batches as Batches),
        ("packed", packed_batches),
    ] {
        let reference = one_rank(&tiny_model, batches);
        let layouts = [
            (
                "cp2 tp2 sp",
                Layout {
                    tp: 2,
                    sp: true,
                    ..cp(2, CpCommType::P2p)
                },
            ),
            (
                "cp2 pp2",
                Layout {
                    pp: 2,
                    ..cp(2, CpCommType::AllGather)
                },
            ),
            (
                "cp2 dp2 distributed",
                Layout {
                    distributed: true,
                    ..cp(2, CpCommType::P2p)
                },
            ),
            ("cp4", cp(4, CpCommType::P2p)),
        ];
        for (name, layout) in layouts {
            let label = format!("{kind} {name}");
            assert_layout(&label, 4, layout, (&tiny_model, batches), &reference);
        }
    }
}

#[test]
fn cp_under_recompute_matches_one_rank() {
    let granularities = [
        RecomputeGranularity::Selective,
        RecomputeGranularity::Full {
            method: RecomputeMethod::Uniform,
            num_layers: 1,
        },
    ];
    for granularity in granularities {
        let model = move || {
            let mut m = tiny_model();
            m.set_recompute_granularity(Some(granularity)).unwrap();
            m
        };
        let reference = one_rank(&model, packed_batches);
        let label = format!("cp2 {granularity:?}");
        let layout = cp(2, CpCommType::P2p);
        assert_layout(&label, 2, layout, (&model, packed_batches), &reference);
    }
}

#[test]
fn checkpoints_move_between_cp_and_one_rank() {
    let reference = one_rank(&tiny_model, rank_batches);
    let tail = tail_of(&reference);
    let dir = tempfile::tempdir().unwrap();
    let under_cp = Layout {
        distributed: true,
        ..cp(2, CpCommType::P2p)
    };
    let ckpt = save_after_two(4, under_cp, tiny_model, &dir.path().join("cp"));
    assert_resumes(
        "cp2 dp2 -> one rank",
        1,
        Layout::default(),
        tiny_model,
        &ckpt,
        &tail,
    );
    let ckpt = save_after_two(1, Layout::default(), tiny_model, &dir.path().join("one"));
    let tp_cp = Layout {
        tp: 2,
        ..cp(2, CpCommType::AllGather)
    };
    assert_resumes("one rank -> cp2 tp2", 4, tp_cp, tiny_model, &ckpt, &tail);
}

#[test]
fn a2a_needs_heads_that_divide_by_cp() {
    // tiny-llama: 4 heads, 2 query groups; tp 2 leaves one group per rank.
    let err = run_local(4, |comm| {
        let layout = Layout {
            tp: 2,
            ..cp(2, CpCommType::A2a)
        };
        layout.trainer(comm, ITERS, tiny_model()).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("context_parallel_size") && err.contains("1 query groups"),
        "{err}"
    );
}
