//! `ferrotron train` with context parallelism end to end on the tiny LLaMA fixture and a
//! generated corpus (rows of 32 tokens crossing document ends): cp 2 in-process with each
//! exchange, cp 2 x dp 2 with the distributed optimizer (resumed on one rank), on plain and
//! packed rows (`reset_attention_mask` + `reset_position_ids`), and cp 4 / cp 2 x tp 2 as
//! `mpirun` processes give the single rank's training and validation losses; a sequence
//! that does not split into 2·cp chunks is named before training.

mod common;
#[cfg(feature = "mpi")]
use common::mpirun_train;
use common::{
    assert_same_losses, ferrotron, metrics_losses, text, tiny_corpus, tiny_llama_run as config,
    train_config,
};

#[test]
fn context_parallel_in_process_matches_one_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tiny_corpus(tmp.path());
    for packed in [false, true] {
        let tag = if packed { "packed" } else { "plain" };
        let single = format!("{tag}-single");
        train_config(&config(tmp.path(), &prefix, &single, packed), &[]);
        let want = metrics_losses(&tmp.path().join(&single));
        assert_eq!(
            want.iter().filter(|l| l.0 == "valid").count(),
            3,
            "{want:?}"
        );
        for comm_type in ["p2p", "all_gather", "a2a"] {
            let out = format!("{tag}-cp2-{comm_type}");
            let ty = format!("parallel.cp_comm_type={comm_type}");
            let sets = ["--set", "parallel.context_parallel_size=2", "--set", &ty];
            let log = train_config(&config(tmp.path(), &prefix, &out, packed), &sets);
            assert!(log.contains("running 2 ranks in this process"), "{log}");
            assert_same_losses(&out, &metrics_losses(&tmp.path().join(&out)), &want);
        }
        // ZeRO-1 over data x context, stopped at iteration 4 and resumed on one rank.
        let out = format!("{tag}-cp2-dp2");
        let cfg = config(tmp.path(), &prefix, &out, packed);
        let sets = [
            "--set",
            "parallel.context_parallel_size=2",
            "--set",
            "parallel.data_parallel_size=2",
            "--set",
            "parallel.use_distributed_optimizer=true",
        ];
        train_config(
            &cfg,
            &[&sets[..], &["--set", "training.exit_interval=4"]].concat(),
        );
        let ckpt = tmp.path().join(format!("{out}-ckpt"));
        let load = format!("checkpoint.load={:?}", ckpt.to_str().unwrap());
        train_config(&cfg, &["--set", &load]);
        assert_same_losses(&out, &metrics_losses(&tmp.path().join(&out)), &want);
    }
}

#[test]
fn a_sequence_that_does_not_split_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tiny_corpus(tmp.path());
    let cfg = config(tmp.path(), &prefix, "bad", false);
    let o = ferrotron(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--set",
        "parallel.context_parallel_size=3",
    ]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("model.seq_length (32) must divide by 2 x parallel.context_parallel_size = 6"),
        "{err}"
    );
}

/// `mpirun -np 4 ferrotron train --dist-backend mpi`: cp 4 (p2p) and cp 2 x tp 2 with
/// sequence parallelism (all_gather), packed rows: the single rank's losses.
#[cfg(feature = "mpi")]
#[test]
fn mpirun_context_parallel_matches_one_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tiny_corpus(tmp.path());
    train_config(&config(tmp.path(), &prefix, "single", true), &[]);
    let want = metrics_losses(&tmp.path().join("single"));
    let layouts: [(&str, &[&str]); 2] = [
        ("mpi-cp4", &["--set", "parallel.context_parallel_size=4"]),
        (
            "mpi-cp2tp2",
            &[
                "--set",
                "parallel.context_parallel_size=2",
                "--set",
                "parallel.tensor_model_parallel_size=2",
                "--set",
                "parallel.sequence_parallel=true",
                "--set",
                "parallel.cp_comm_type=all_gather",
            ],
        ),
    ];
    for (name, sets) in layouts {
        let cfg = config(tmp.path(), &prefix, name, true);
        let o = mpirun_train(4, &cfg, sets);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{name}: mpirun failed: {err}");
        assert_same_losses(name, &metrics_losses(&tmp.path().join(name)), &want);
    }
}
