//! Optimizer offload in training: the state in chunks on disk trains bit-identically to the
//! state in RAM — a static fraction, everything offloaded under ZeRO-1 over dp 2 (every rank
//! against the one-rank run), and the auto policy, which offloads everything for its warmup
//! step, then keeps what its budget allows in RAM and moves chunks when the budget changes;
//! each step reports the chunks offloaded and the bytes moved.

mod common;

use common::layouts::*;
use common::*;
use ferrotron_comm::run_local;
use ferrotron_optim::offload::{OffloadConfig, OffloadPolicy};
use ferrotron_train::trainer::{DataParallel, OffloadStats, TrainError, Trainer};
use std::sync::Arc;

fn offload(policy: OffloadPolicy, dir: &std::path::Path) -> OffloadConfig {
    OffloadConfig {
        policy,
        path: Some(dir.to_path_buf()),
        // tiny-llama's ~110K parameters in chunks of at most 5000 elements per array.
        chunk_size: Some(5000),
    }
}

/// Per-iteration losses, the final parameters and every step's offload statistics;
/// `before(iteration, trainer)` runs before each step.
fn run(
    offload: OffloadConfig,
    mut before: impl FnMut(usize, &mut Trainer),
) -> (Run, Vec<Option<OffloadStats>>) {
    let mut opts = dp_options(1, ITERS);
    opts.offload = offload;
    let mut t = Trainer::new(tiny_model(), opts).unwrap();
    let mut losses = Vec::new();
    let mut stats = Vec::new();
    for it in 0..ITERS {
        before(it, &mut t);
        let s = t.train_step(&rank_batches(it, 0, 1)).unwrap();
        losses.push(s.loss);
        stats.push(s.offload);
    }
    ((losses, params(&t)), stats)
}

fn assert_identical(label: &str, got: &Run, want: &Run) {
    assert_eq!(got.0, want.0, "{label}: losses");
    assert!(got.1 == want.1, "{label}: parameters differ");
}

#[test]
fn static_offload_trains_bit_identically() {
    let dir = tempfile::tempdir().unwrap();
    let (want, none) = run(OffloadConfig::default(), |_, _| {});
    assert!(none.iter().all(Option::is_none));
    let (got, stats) = run(
        offload(OffloadPolicy::Static { fraction: 0.5 }, dir.path()),
        |_, _| {},
    );
    assert_identical("static 0.5", &got, &want);
    for s in stats {
        let s = s.unwrap();
        assert_eq!(s.slow_chunks, s.chunks.div_ceil(2));
        // Each offloaded chunk read and written once per step.
        assert_eq!(s.moved_bytes, 2 * s.offloaded_bytes);
    }
}

#[test]
fn the_auto_policy_moves_chunks_with_its_budget() {
    let dir = tempfile::tempdir().unwrap();
    let (want, _) = run(OffloadConfig::default(), |_, _| {});
    let auto = offload(
        OffloadPolicy::Auto {
            budget_bytes: 1 << 40,
        },
        dir.path(),
    );
    // A roomy budget, then one with no room for the optimizer state, then roomy again.
    let (got, stats) = run(auto, |it, t| {
        let budget = if it == 1 { 0 } else { 1 << 40 };
        t.set_offload_budget(budget).unwrap();
    });
    assert_identical("auto", &got, &want);
    let stats: Vec<OffloadStats> = stats.into_iter().map(Option::unwrap).collect();
    let n = stats[0].chunks;
    // Step 1 is the warmup (everything offloaded), then placed by the budget after it.
    let slow: Vec<usize> = stats.iter().map(|s| s.slow_chunks).collect();
    assert_eq!(slow, [0, n, 0, 0], "{stats:?}");
    assert!(
        stats[0].moved_bytes > 0 && stats[3].moved_bytes == 0,
        "{stats:?}"
    );
}

/// Under pipeline parallelism the auto policy keeps room for each stage's own activation
/// peak, with the micro-batches its 1F1B schedule keeps in flight: measured on every stage,
/// the first stage's (two micro-batches in flight) above what it holds for one; the chunks
/// follow the budget and training matches one rank.
#[test]
fn the_auto_policy_measures_each_pipeline_stage() {
    let dir = tempfile::tempdir().unwrap();
    let mut one = Trainer::new(tiny_model(), dp_options(1, ITERS)).unwrap();
    let reference = train(&mut one, 0, ITERS);
    let auto = offload(
        OffloadPolicy::Auto {
            budget_bytes: 1 << 40,
        },
        dir.path(),
    );
    let layout = Layout {
        pp: 2,
        ..Layout::default()
    };
    let runs = run_local(2, |comm| {
        let edit = |o: &mut ferrotron_train::trainer::TrainerOptions| o.offload = auto.clone();
        let mut t = layout.trainer_with(comm, ITERS, tiny_model(), edit)?;
        let (mut losses, mut slow, mut peaks) = (Vec::new(), Vec::new(), Vec::new());
        for it in 0..ITERS {
            t.set_offload_budget(if it == 1 { 0 } else { 1 << 40 })?;
            let stats = t.train_step(&rank_batches(it, 0, 1))?;
            losses.push(stats.loss);
            slow.push(stats.offload.expect("offloading").slow_chunks);
            peaks.push(t.activation_peak_bytes());
        }
        Ok::<_, TrainError>(((losses, params(&t)), slow, peaks))
    })
    .unwrap_or_else(|e| panic!("{e}"));
    for (stage, (run, slow, peaks)) in runs.iter().enumerate() {
        assert_same_run(&format!("pp2 auto stage {stage}"), run, &reference);
        assert_eq!(slow[1..], [slow[1], 0, 0], "stage {stage}: {slow:?}");
        assert!(slow[1] > 0, "stage {stage}: {slow:?}");
        assert!(peaks.iter().all(|&p| p > 0 && p == peaks[0]), "{peaks:?}");
    }
    // One micro-batch per step: nothing else in flight.
    let single = run_local(2, |comm| {
        let edit = |o: &mut ferrotron_train::trainer::TrainerOptions| {
            o.offload = auto.clone();
            o.global_batch_size = MBS;
        };
        let mut t = layout.trainer_with(comm, ITERS, tiny_model(), edit)?;
        t.train_step(&rank_batches(0, 0, 1)[..1])?;
        Ok::<_, TrainError>(t.activation_peak_bytes())
    })
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        runs[0].2[0] > single[0],
        "{} vs {}",
        runs[0].2[0],
        single[0]
    );
}

#[test]
fn zero1_over_dp2_offloads_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let mut one = Trainer::new(tiny_model(), dp_options(1, ITERS)).unwrap();
    let reference = train(&mut one, 0, ITERS);
    let runs = run_local(2, |comm| {
        let dp = DataParallel::new(Arc::new(comm), true);
        let mut opts = dp_options(2, ITERS);
        opts.offload = offload(OffloadPolicy::Static { fraction: 1.0 }, dir.path());
        let mut t = Trainer::new_data_parallel(tiny_model(), opts, dp)?;
        Ok::<_, TrainError>(train(&mut t, 0, ITERS))
    })
    .unwrap_or_else(|e| panic!("{e}"));
    for (r, run) in runs.iter().enumerate() {
        assert_same_run(&format!("dp2 zero1 offloaded rank {r}"), run, &reference);
    }
}

/// A checkpoint of an offloaded optimizer (written and read one state array at a time)
/// resumes exactly in RAM, and one saved in RAM resumes offloaded.
#[test]
fn checkpoints_move_between_offloaded_and_in_ram_state() {
    let dir = tempfile::tempdir().unwrap();
    let (reference, _) = run(OffloadConfig::default(), |_, _| {});
    let tail = tail_of(&reference);
    let offloaded = offload(OffloadPolicy::Static { fraction: 1.0 }, dir.path());
    for (label, save_with, load_with) in [
        (
            "offloaded -> RAM",
            offloaded.clone(),
            OffloadConfig::default(),
        ),
        (
            "RAM -> offloaded",
            OffloadConfig::default(),
            offloaded.clone(),
        ),
    ] {
        let ckpt = dir.path().join(label.replace(' ', "_"));
        let mut opts = dp_options(1, ITERS);
        opts.offload = save_with;
        let mut t = Trainer::new(tiny_model(), opts.clone()).unwrap();
        train(&mut t, 0, 2);
        t.save_checkpoint(&ckpt, 0, serde_json::Value::Null)
            .unwrap();
        opts.offload = load_with;
        let mut t = Trainer::new(tiny_model(), opts).unwrap();
        let iter_dir = ferrotron_checkpoint::dist::iteration_dir(&ckpt, 2);
        t.load_checkpoint(&iter_dir, ferrotron_train::trainer::LoadMode::Resume)
            .unwrap();
        assert_same_run(label, &train(&mut t, 2, 2), &tail);
    }
}
