//! Every parallel layout is exact: dp 2 and dp 4, with and without the distributed
//! optimizer, tp 2 with and without sequence parallelism, and tp 2 x dp 2 (in-process ranks)
//! give the single-rank run's per-iteration losses and final parameters for the same global
//! batches; checkpoints saved under dp 2 + distributed optimizer or tp 2 x dp 2 resume on one
//! rank; a failing rank stops the job with its own error.

mod common;

use common::layouts::*;
use common::*;
use ferrotron_comm::run_local;
use ferrotron_train::trainer::{DataParallel, TrainError, Trainer, TrainerOptions};
use std::sync::Arc;

/// Runs `layout` on `world` in-process ranks over `full()` for `ITERS` steps and checks every
/// rank against `reference`.
fn assert_layout(
    label: &str,
    world: usize,
    layout: Layout,
    full: impl Fn() -> ferrotron_model::GptModel + Sync,
    reference: &Run,
) {
    let runs = run_local(world, |comm| {
        let mut t = layout.trainer(comm, ITERS, full())?;
        Ok::<_, TrainError>(train(&mut t, 0, ITERS))
    })
    .unwrap_or_else(|e| panic!("{label}: {e}"));
    for (r, run) in runs.iter().enumerate() {
        assert_same_run(&format!("{label} rank {r}"), run, reference);
    }
}

/// Pipeline parallelism (1F1B over 2 stages of the 2-layer fixtures), alone and with data
/// and tensor parallelism, untied and tied embeddings: the single rank's run.
#[test]
fn pipeline_layouts_match_one_rank() {
    for name in ["tiny-llama", "tiny-llama3"] {
        let mut one = Trainer::new(fixture(name), dp_options(1, ITERS)).unwrap();
        let reference = train(&mut one, 0, ITERS);
        for (tp, pp, dp, distributed) in [(1, 2, 1, false), (1, 2, 2, true), (2, 2, 1, false)] {
            let layout = Layout {
                tp,
                pp,
                distributed,
                ..Layout::default()
            };
            let label = format!("{name} tp{tp} pp{pp} dp{dp}");
            assert_layout(&label, tp * pp * dp, layout, || fixture(name), &reference);
        }
    }
}

/// A 4-layer model of `fixture`'s shape (random weights, large enough that every layer
/// changes the loss clearly, so running layers in the wrong order shows).
fn four_layers(fixture_name: &str) -> ferrotron_model::GptModel {
    let mut config = fixture(fixture_name).config().clone();
    config.num_layers = 4;
    let init = ferrotron_model::InitConfig {
        init_method_std: 0.2,
        ..Default::default()
    };
    ferrotron_model::GptModel::init_random(config, init).unwrap()
}

/// The interleaved 1F1B schedule (pp 2 with 2 model chunks per stage: rank 0 holds layers
/// 0 and 2, rank 1 layers 1 and 3), alone, with data parallelism and the distributed
/// optimizer, with tensor parallelism, and with full recompute, untied and tied
/// embeddings: the single rank's run; its checkpoint resumes on one rank and under pp 2.
#[test]
fn interleaved_pipeline_layouts_match_one_rank() {
    for name in ["tiny-llama", "tiny-llama3"] {
        let mut one = Trainer::new(four_layers(name), dp_options(1, ITERS)).unwrap();
        let reference = train(&mut one, 0, ITERS);
        for (tp, dp, distributed, recompute) in [
            (1, 1, false, false),
            (1, 2, true, false),
            (2, 1, false, false),
            (1, 1, false, true),
        ] {
            let layout = Layout {
                tp,
                pp: 2,
                vp: 2,
                distributed,
                ..Layout::default()
            };
            let label = format!("{name} tp{tp} pp2 vp2 dp{dp} recompute {recompute}");
            let model = || {
                let mut m = four_layers(name);
                if recompute {
                    m.set_recompute_granularity(Some(
                        ferrotron_model::RecomputeGranularity::Full {
                            method: ferrotron_model::RecomputeMethod::Uniform,
                            num_layers: 1,
                        },
                    ))
                    .unwrap();
                }
                m
            };
            assert_layout(&label, tp * 2 * dp, layout, model, &reference);
        }
        // A stage of two chunks (layers 0 and 2, or 1 and 3) writes its checkpoint boxes
        // under global names: it resumes on one rank and under plain pp 2.
        let dir = tempfile::tempdir().unwrap();
        let vp2 = Layout {
            pp: 2,
            vp: 2,
            ..Layout::default()
        };
        let ckpt = save_after_two(2, vp2, || four_layers(name), dir.path());
        let tail = tail_of(&reference);
        let one = Layout::default();
        assert_resumes(
            &format!("{name} pp2 vp2 -> 1 rank"),
            1,
            one,
            || four_layers(name),
            &ckpt,
            &tail,
        );
        let pp2 = Layout {
            pp: 2,
            ..Layout::default()
        };
        assert_resumes(
            &format!("{name} pp2 vp2 -> pp2"),
            2,
            pp2,
            || four_layers(name),
            &ckpt,
            &tail,
        );
    }
}

#[test]
fn tensor_parallel_layouts_match_one_rank() {
    let reference = single_rank(ITERS);
    for (tp, dp, sp, distributed) in [
        (2, 1, false, false),
        (2, 1, true, false),
        (2, 2, false, false),
        (2, 2, true, true),
    ] {
        let layout = Layout {
            tp,
            sp,
            distributed,
            ..Layout::default()
        };
        let label = format!("tp{tp} dp{dp} sp={sp} distributed_optimizer={distributed}");
        assert_layout(&label, tp * dp, layout, tiny_model, &reference);
    }
}

/// A checkpoint saved by tp 2 x dp 2 (sequence parallel, distributed optimizer) resumes on
/// one rank as the uninterrupted single-rank run.
#[test]
fn tensor_parallel_checkpoint_resumes_on_one_rank() {
    let reference = single_rank(ITERS);
    let dir = tempfile::tempdir().unwrap();
    let layout = Layout {
        tp: 2,
        sp: true,
        distributed: true,
        ..Layout::default()
    };
    let ckpt = save_after_two(4, layout, tiny_model, dir.path());
    let one = Layout::default();
    assert_resumes(
        "tp2 x dp2 -> 1 rank",
        1,
        one,
        tiny_model,
        &ckpt,
        &tail_of(&reference),
    );
}

/// overlap_grad_reduce: buckets reduced on the progress thread during the last backward
/// (small buckets: several per step), with and without the distributed optimizer and under
/// tensor parallelism, give the same run.
#[test]
fn overlapped_grad_reduce_matches_one_rank() {
    let reference = single_rank(ITERS);
    for (tp, dp, distributed) in [(1, 2, false), (1, 2, true), (2, 2, false)] {
        let layout = Layout {
            tp,
            distributed,
            overlap: true,
            ..Layout::default()
        };
        let label = format!("overlap tp{tp} dp{dp} distributed_optimizer={distributed}");
        assert_layout(&label, tp * dp, layout, tiny_model, &reference);
    }
}

/// overlap_param_gather: the distributed optimizer's parameter all-gathers run on their own
/// progress thread and the next step's first forward waits per layer group (small buckets:
/// several per step), alone, with overlap_grad_reduce, under tensor parallelism, with
/// gradient accumulation over 1 or 2 micro-batches, and with full recompute (whose groups
/// the forward keeps whole): the same run as one rank.
#[test]
fn overlapped_param_gather_matches_one_rank() {
    let reference = single_rank(ITERS);
    for (tp, dp, grads, recompute) in [
        (1, 2, false, false),
        (1, 4, true, false),
        (2, 2, true, false),
        (1, 2, true, true),
    ] {
        let layout = Layout {
            tp,
            distributed: true,
            overlap: grads,
            overlap_params: true,
            ..Layout::default()
        };
        let label = format!("overlap_param_gather tp{tp} dp{dp} overlap_grad_reduce={grads}");
        let model = || {
            let mut m = tiny_model();
            if recompute {
                m.set_recompute_granularity(Some(ferrotron_model::RecomputeGranularity::Full {
                    method: ferrotron_model::RecomputeMethod::Uniform,
                    num_layers: 2,
                }))
                .unwrap();
            }
            m
        };
        assert_layout(&label, tp * dp, layout, model, &reference);
    }
    // the weights are stale until the gathers finish: readers refuse to run
    let runs = run_local(2, |comm| {
        let group = DataParallel::new(Arc::new(comm), true).with_overlap_param_gather()?;
        let mut t = Trainer::new_data_parallel(tiny_model(), dp_options(2, ITERS), group)?;
        let rank = t.data_parallel().rank();
        t.train_step(&rank_batches(0, rank, 2))?;
        let err = t
            .evaluate(&rank_batches(1, rank, 2))
            .unwrap_err()
            .to_string();
        t.finish_param_gather()?;
        t.evaluate(&rank_batches(1, rank, 2))?;
        Ok::<_, TrainError>(err)
    })
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        runs[0].contains("call finish_param_gather first"),
        "{}",
        runs[0]
    );
    let err = DataParallel::single()
        .with_overlap_param_gather()
        .unwrap_err();
    assert!(
        err.to_string().contains("needs use_distributed_optimizer"),
        "{err}"
    );
}

/// bf16 gradient reduction (`grad_reduce_in_fp32 = false`) rounds each rank's gradient to
/// bf16 once: the run tracks the f32 one closely, not bit for bit.
#[test]
fn bf16_grad_reduce_tracks_one_rank() {
    let reference = single_rank(ITERS);
    let runs = run_local(2, |comm| {
        let group = DataParallel::new(Arc::new(comm), true).with_bf16_grad_reduce();
        let mut t = Trainer::new_data_parallel(tiny_model(), dp_options(2, ITERS), group)?;
        Ok::<_, TrainError>(train(&mut t, 0, ITERS))
    })
    .unwrap_or_else(|e| panic!("{e}"));
    for (a, b) in runs[0].0.iter().zip(&reference.0) {
        let rel = (a - b).abs() / b;
        assert!(rel < 1e-2, "bf16 reduce loss {a} vs {b}");
    }
    assert_eq!(runs[0].1, runs[1].1, "replicas diverged");
}

#[test]
fn dp2_and_dp4_match_one_rank() {
    let reference = single_rank(ITERS);
    assert!(
        reference.0[ITERS - 1] < reference.0[0],
        "loss falls: {:?}",
        reference.0
    );
    for (dp, distributed) in [(2, false), (2, true), (4, false), (4, true)] {
        let runs = data_parallel(dp, distributed);
        for (r, run) in runs.iter().enumerate() {
            let label = format!("dp{dp} distributed_optimizer={distributed} rank {r}");
            assert_same_run(&label, run, &reference);
            // every replica holds bit-identical weights
            assert_eq!(run.1, runs[0].1, "{label}: replicas diverged");
        }
    }
}

/// A distributed-optimizer checkpoint (shards of two ranks) resumes on a single rank and
/// continues as the uninterrupted single-rank run.
#[test]
fn distributed_optimizer_checkpoint_resumes_on_one_rank() {
    let reference = single_rank(ITERS);
    let dir = tempfile::tempdir().unwrap();
    let layout = Layout {
        distributed: true,
        ..Layout::default()
    };
    let ckpt = save_after_two(2, layout, tiny_model, dir.path());
    assert_resumes(
        "resumed",
        1,
        Layout::default(),
        tiny_model,
        &ckpt,
        &tail_of(&reference),
    );
}

#[test]
fn a_rank_with_bad_batches_stops_the_job_with_its_error() {
    let err = run_local(2, |comm| {
        let group = DataParallel::new(Arc::new(comm), false);
        let mut t = Trainer::new_data_parallel(tiny_model(), dp_options(2, ITERS), group)?;
        let rank = t.data_parallel().rank();
        // rank 1 hands over a micro-batch too few; rank 0 waits in the token all-reduce
        let mut batches = rank_batches(0, rank, 2);
        if rank == 1 {
            batches.pop();
        }
        t.train_step(&batches).map(|_| ())
    })
    .unwrap_err();
    assert_eq!(err.rank, 1);
    assert!(err.to_string().contains("a global batch has 2"), "{err}");
}

#[test]
fn data_parallel_size_must_match_the_group() {
    let err = run_local(2, |comm| {
        Trainer::new_data_parallel(
            tiny_model(),
            dp_options(1, ITERS),
            DataParallel::new(Arc::new(comm), false),
        )
        .map(|_| ())
    })
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("data_parallel_size is 1 (x context_parallel_size 1), the data-parallel group has 2 ranks"),
        "{err}"
    );
}

/// Model-state memory per rank follows Megatron's formula: `6 + 12/dp` bytes per parameter
/// (bf16 params, fp32 grads, fp32 master + Adam moments sharded by the distributed
/// optimizer), 18 without sharding.
#[test]
fn model_state_memory_follows_megatrons_formula() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-llama");
    let bf16_model = || {
        ferrotron_model::families::load_hf_model(&dir, ferrotron_tensor::DType::BF16)
            .unwrap()
            .0
    };
    let options = |dp| TrainerOptions {
        precision: ferrotron_optim::Precision::Bf16,
        ..dp_options(dp, ITERS)
    };
    let per_element = |t: &Trainer, numel: usize| t.model_state_bytes() as f64 / numel as f64;
    let one = Trainer::new(bf16_model(), options(1)).unwrap();
    let numel = one
        .model()
        .parameters()
        .iter()
        .map(|p| p.numel())
        .sum::<usize>();
    let padded = one.model_state_bytes() / 18;
    assert_eq!(one.model_state_bytes(), 18 * padded);
    assert!(
        padded >= numel && padded < numel + numel / 10,
        "padding {padded} vs {numel}"
    );
    for dp in [2, 4] {
        let bytes = run_local(dp, |comm| {
            let group = DataParallel::new(Arc::new(comm), true);
            let t = Trainer::new_data_parallel(bf16_model(), options(dp), group)?;
            Ok::<_, TrainError>((t.model_state_bytes(), per_element(&t, padded)))
        })
        .unwrap_or_else(|e| panic!("{e}"));
        for (b, per) in bytes {
            let want = 6.0 + 12.0 / dp as f64;
            // buckets are padded to lcm(dp, 128) elements, so a shard can be a little more
            assert!(
                (per - want).abs() < 0.05,
                "dp {dp}: {per} bytes/param, want {want} ({b} bytes)"
            );
        }
    }
}

/// A checkpoint saved by tp 2 x pp 2 (each rank writing its own boxes, the tied embedding
/// stored once) resumes on one rank and under pp 2 again as the uninterrupted run.
#[test]
fn pipeline_checkpoint_resumes_under_any_layout() {
    for name in ["tiny-llama", "tiny-llama3"] {
        let mut one = Trainer::new(fixture(name), dp_options(1, ITERS)).unwrap();
        let tail = tail_of(&train(&mut one, 0, ITERS));
        let dir = tempfile::tempdir().unwrap();
        let tp2_pp2 = Layout {
            tp: 2,
            pp: 2,
            ..Layout::default()
        };
        let ckpt = save_after_two(4, tp2_pp2, || fixture(name), dir.path());
        let label = format!("{name} tp2 x pp2 -> 1 rank");
        assert_resumes(&label, 1, Layout::default(), || fixture(name), &ckpt, &tail);
        let pp2 = Layout {
            pp: 2,
            ..Layout::default()
        };
        let label = format!("{name} tp2 x pp2 -> pp2");
        assert_resumes(&label, 2, pp2, || fixture(name), &ckpt, &tail);
    }
}
