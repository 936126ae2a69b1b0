//! `ferrotron train` checkpoints end to end on the tiny LLaMA fixture and a generated corpus:
//! a run stopped at `exit_interval` and resumed gives the same losses as an uninterrupted run,
//! and `kill -9` at random moments never leaves an unloadable latest checkpoint.

use ferrotron_data::indexed::{IndexedDatasetBuilder, TokenDtype};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

mod common;
use common::ferrotron;

const EOD: u32 = 2;

/// 300 documents of 20..60 pseudo-random tokens in 3..112, each closed by EOD.
fn corpus(dir: &Path) -> PathBuf {
    let prefix = dir.join("corpus_text_document");
    let mut b = IndexedDatasetBuilder::create(&prefix, TokenDtype::U16).unwrap();
    let mut x = 12345u64;
    for _ in 0..300 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let len = 20 + (x >> 33) as usize % 40;
        let doc: Vec<u32> = (0..len)
            .map(|i| 3 + ((x >> 20) as usize + i * (i + 7)) as u32 % 109)
            .chain([EOD])
            .collect();
        b.add_item(&doc).unwrap();
        b.end_document();
    }
    b.finalize().unwrap();
    prefix
}

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

/// `(kind, iteration, lm_loss)` of every train/valid line of `out/metrics.jsonl`.
fn losses(dir: &Path, out: &str) -> Vec<(String, u64, f64)> {
    std::fs::read_to_string(dir.join(out).join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["kind"] != "checkpoint")
        .map(|v| {
            (
                v["kind"].as_str().unwrap().to_string(),
                v["iteration"].as_u64().unwrap(),
                v["lm_loss"].as_f64().unwrap(),
            )
        })
        .collect()
}

fn train(cfg: &Path, extra: &[&str]) {
    let mut args = vec!["train", "--config", cfg.to_str().unwrap()];
    args.extend_from_slice(extra);
    let o = ferrotron(&args);
    assert!(
        o.status.success(),
        "train failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn exit_and_resume_matches_an_uninterrupted_run() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = corpus(tmp.path());
    let full = config(tmp.path(), &prefix, "full", 6);
    train(&full, &[]);
    let want = losses(tmp.path(), "full");
    assert_eq!(want.iter().filter(|l| l.0 == "train").count(), 6);
    assert_eq!(want.iter().filter(|l| l.0 == "valid").count(), 3);

    let split = config(tmp.path(), &prefix, "split", 6);
    train(&split, &["--set", "training.exit_interval=4"]);
    let ckpt = tmp.path().join("split-ckpt");
    let tracker = std::fs::read_to_string(ckpt.join("latest_checkpointed_iteration.txt")).unwrap();
    assert_eq!(tracker.trim(), "4");
    let load = format!("checkpoint.load={:?}", ckpt.to_str().unwrap());
    train(&split, &["--set", &load]);
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
    train(
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
