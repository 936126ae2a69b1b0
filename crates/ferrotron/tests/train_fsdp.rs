//! `ferrotron train` with ZeRO-2/3 (`parallel.data_parallel_sharding_strategy`) end to end
//! on the tiny LLaMA fixture and a generated corpus: dp 2 in-process with `optim_grads` and
//! `optim_grads_params` (the latter stopped at iteration 4 and resumed), and ZeRO-3 over
//! dp 2 x tp 2 as `mpirun` processes, give the single rank's training and validation
//! losses; an unknown strategy is named before training.

mod common;
#[cfg(feature = "mpi")]
use common::mpirun_train;
use common::{
    assert_same_losses, ferrotron, metrics_losses, text, tiny_corpus, tiny_llama_run, train_config,
};

#[test]
fn zero2_and_zero3_in_process_match_one_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tiny_corpus(tmp.path());
    train_config(&tiny_llama_run(tmp.path(), &prefix, "single", false), &[]);
    let want = metrics_losses(&tmp.path().join("single"));
    for strategy in ["optim_grads", "optim_grads_params"] {
        let cfg = tiny_llama_run(tmp.path(), &prefix, strategy, false);
        let set = format!("parallel.data_parallel_sharding_strategy={strategy}");
        let sets = ["--set", "parallel.data_parallel_size=2", "--set", &set];
        let log = train_config(
            &cfg,
            &[&sets[..], &["--set", "training.exit_interval=4"]].concat(),
        );
        assert!(log.contains("running 2 ranks in this process"), "{log}");
        let ckpt = tmp.path().join(format!("{strategy}-ckpt"));
        let load = format!("checkpoint.load={:?}", ckpt.to_str().unwrap());
        train_config(&cfg, &[&sets[..], &["--set", &load]].concat());
        let got = metrics_losses(&tmp.path().join(strategy));
        assert_same_losses(strategy, &got, &want);
    }
}

#[test]
fn an_unknown_strategy_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tiny_corpus(tmp.path());
    let cfg = tiny_llama_run(tmp.path(), &prefix, "bad", false);
    let o = ferrotron(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--set",
        "parallel.data_parallel_sharding_strategy=zero3",
    ]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("parallel.data_parallel_sharding_strategy: `zero3` is not one of"),
        "{err}"
    );
}

/// `mpirun -np 4 ferrotron train --dist-backend mpi`: ZeRO-3 over dp 2 x tp 2 with sequence
/// parallelism gives the single rank's losses.
#[cfg(feature = "mpi")]
#[test]
fn mpirun_zero3_matches_one_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tiny_corpus(tmp.path());
    train_config(&tiny_llama_run(tmp.path(), &prefix, "single", false), &[]);
    let want = metrics_losses(&tmp.path().join("single"));
    let cfg = tiny_llama_run(tmp.path(), &prefix, "mpi-zero3", false);
    let sets = [
        "--set",
        "parallel.data_parallel_sharding_strategy=optim_grads_params",
        "--set",
        "parallel.tensor_model_parallel_size=2",
        "--set",
        "parallel.sequence_parallel=true",
    ];
    let o = mpirun_train(4, &cfg, &sets);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "mpirun failed: {err}");
    let got = metrics_losses(&tmp.path().join("mpi-zero3"));
    assert_same_losses("mpi zero3", &got, &want);
}
