//! `ferrotron train` checkpoints end to end on the tiny LLaMA fixture and a generated corpus:
//! a run stopped at `exit_interval` and resumed gives the same losses as an uninterrupted run,
//! and `kill -9` at random moments never leaves an unloadable latest checkpoint.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

mod common;
use common::{tiny_corpus as corpus, train_config};

fn config(dir: &Path, prefix: &Path, out: &str, iters: u64) -> PathBuf {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-llama");
    let cfg = dir.join(format!("{out}.toml"));
    std::fs::write(
        &cfg,
        format!(
            "[model]\nload = {:?}\nseq_length = 16\n\
             [data]\ndata_path = {:?}\nsplit = \"90,10,0\"\ndata_cache_path = {:?}\n\
             [training]\nmicro_batch_size = 2\nglobal_batch_size = 4\ntrain_iters = {iters}\n\
             log_interval = 1\neval_interval = 2\neval_iters = 1\n\
             [optimizer]\nlr = 3e-3\nmin_lr = 3e-4\nlr_warmup_iters = 1\nlr_decay_iters = {iters}\n\
             [checkpoint]\nsave = {:?}\nsave_interval = 1\n\
             [logging]\noutput_dir = {:?}\n",
            model.to_str().unwrap(),
            prefix.to_str().unwrap(),
            dir.join("cache").to_str().unwrap(),
            dir.join(format!("{out}-ckpt")).to_str().unwrap(),
            dir.join(out).to_str().unwrap(),
        ),
    )
    .unwrap();
    cfg
}
fn losses(dir: &Path, out: &str) -> Vec<(String, u64, f64)> {
    common::metrics_losses(&dir.join(out))
}

#[test]
fn exit_and_resume_matches_an_uninterrupted_run() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = corpus(tmp.path());
    let full = config(tmp.path(), &prefix, "full", 6);
    train_config(&full, &[]);
    let want = losses(tmp.path(), "full");
    assert_eq!(want.iter().filter(|l| l.0 == "train").count(), 6);
    assert_eq!(want.iter().filter(|l| l.0 == "valid").count(), 3);

    let split = config(tmp.path(), &prefix, "split", 6);
    train_config(&split, &["--set", "training.exit_interval=4"]);
    let ckpt = tmp.path().join("split-ckpt");
    let tracker = std::fs::read_to_string(ckpt.join("latest_checkpointed_iteration.txt")).unwrap();
    assert_eq!(tracker.trim(), "4");
    let load = format!("checkpoint.load={:?}", ckpt.to_str().unwrap());
    train_config(&split, &["--set", &load]);
    let got = losses(tmp.path(), "split");
    assert_eq!(got, want, "resumed run differs from the uninterrupted one");
}

#[test]
fn kill_9_never_breaks_the_latest_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = corpus(tmp.path());
    let cfg = config(tmp.path(), &prefix, "killed", 400);
    let ckpt = tmp.path().join("killed-ckpt");
    let load = format!("checkpoint.load={:?}", ckpt.to_str().unwrap());
    let mut last = 0u64;
    for (round, delay_ms) in [700u64, 230, 410, 90, 555].into_iter().enumerate() {
        let mut args = vec!["train", "--config", cfg.to_str().unwrap()];
        if round > 0 {
            args.extend(["--set", load.as_str()]);
        }
        let mut child = Command::new(env!("CARGO_BIN_EXE_ferrotron"))
            .args(&args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(delay_ms));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        // Every visible iter_* directory is complete, and the tracker names one of them.
        for e in std::fs::read_dir(&ckpt).into_iter().flatten() {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            if name.starts_with("iter_") {
                assert!(
                    ckpt.join(&name).join("metadata.json").is_file(),
                    "round {round}: {name} is incomplete"
                );
            }
        }
        if let Ok(t) = std::fs::read_to_string(ckpt.join("latest_checkpointed_iteration.txt")) {
            let it: u64 = t.trim().parse().unwrap();
            assert!(
                it >= last,
                "round {round}: tracker went back from {last} to {it}"
            );
            last = it;
        }
    }
    eprintln!("latest checkpoint after the kills: iteration {last}");
    assert!(last > 0, "no checkpoint was saved before the kills");
    // The latest checkpoint resumes: one more iteration from it.
    train_config(
        &cfg,
        &[
            "--set",
            &load,
            "--set",
            &format!("training.exit_interval={}", last + 1),
        ],
    );
    let t = std::fs::read_to_string(ckpt.join("latest_checkpointed_iteration.txt")).unwrap();
    assert_eq!(t.trim(), (last + 1).to_string());
}
