//! Shared by the CLI integration tests: running the `ferrotron` binary, the SmolLM2 HF
//! directory converted from `FERROTRON_SMOLLM2_GGUF`, and the harness of the binaries with tests
//! on those weights (`weights`).

#![allow(dead_code)] // each test binary uses a different part

/// One file for every crate's tests on the real weights (kept in ferrotron-data, the lowest).
#[path = "../../../ferrotron-data/tests/common/weights.rs"]
pub mod weights;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// Runs the `ferrotron` binary built for these tests.
pub fn ferrotron(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .args(args)
        .output()
        .unwrap()
}

/// The SmolLM2 HF directory, converted from `FERROTRON_SMOLLM2_GGUF` with `ferrotron convert
/// gguf-to-hf` once per test binary into a fixed place under target/ (replaced with --force
/// each run). Panics (fails the test) when the variable is unset or names a missing file; the
/// tests that call it are declared with `trials![needs [GGUF]: ...]`, so they are ignored
/// instead when it is unset.
pub fn model_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let gguf = weights::path(weights::GGUF);
        // One directory per test binary: cargo may build them into the same target dir.
        let bin = std::env::current_exe().unwrap();
        let name = bin.file_stem().unwrap().to_string_lossy().into_owned();
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("smollm2-hf-{name}"));
        let o = ferrotron(&[
            "convert",
            "gguf-to-hf",
            "--input",
            gguf.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
            "--force",
        ]);
        assert!(
            o.status.success(),
            "convert failed: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        out
    })
}

/// Asserts two runs' `metrics.jsonl` losses ([`metrics_losses`]) are the same lines within
/// 1e-5 relative.
pub fn assert_same_losses(label: &str, got: &[(String, u64, f64)], want: &[(String, u64, f64)]) {
    assert_eq!(got.len(), want.len(), "{label}: {got:?} vs {want:?}");
    for (g, w) in got.iter().zip(want) {
        assert_eq!((&g.0, g.1), (&w.0, w.1), "{label}");
        let rel = (g.2 - w.2).abs() / w.2;
        assert!(rel <= 1e-5, "{label}: {g:?} vs {w:?} (rel {rel:.1e})");
    }
}

/// `(kind, iteration, lm_loss)` of every train/valid line of `out_dir/metrics.jsonl`.
pub fn metrics_losses(out_dir: &Path) -> Vec<(String, u64, f64)> {
    std::fs::read_to_string(out_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
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

/// The end-of-document id of [`tiny_corpus`].
pub const TINY_EOD: u32 = 2;

/// 300 documents of 20..60 pseudo-random tokens in 3..112 (the tiny-llama fixture's vocab),
/// each closed by [`TINY_EOD`], as a `.bin/.idx` pair; returns the prefix.
pub fn tiny_corpus(dir: &Path) -> PathBuf {
    use ferrotron_data::indexed::{IndexedDatasetBuilder, TokenDtype};
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
            .chain([TINY_EOD])
            .collect();
        b.add_item(&doc).unwrap();
        b.end_document();
    }
    b.finalize().unwrap();
    prefix
}

/// `(stdout, stderr)` of a finished command, lossily decoded.
pub fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Runs `ferrotron train` on `toml` (written as `dir/run.toml`); returns stdout after
/// asserting success.
pub fn train(dir: &Path, toml: &str) -> String {
    let cfg = dir.join("run.toml");
    std::fs::write(&cfg, toml).unwrap();
    let o = ferrotron(&["train", "--config", cfg.to_str().unwrap()]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "stdout:\n{out}\nstderr:\n{err}");
    out
}

/// `ferrotron train --config CFG EXTRA...`; returns stdout and stderr after asserting success.
pub fn train_config(cfg: &Path, extra: &[&str]) -> String {
    let mut args = vec!["train", "--config", cfg.to_str().unwrap()];
    args.extend_from_slice(extra);
    let o = ferrotron(&args);
    let (out, err) = text(&o);
    assert!(o.status.success(), "train {extra:?} failed: {err}");
    out + &err
}

/// The `lm loss` of every training log line of `out`.
pub fn train_losses(out: &str) -> Vec<f64> {
    out.lines()
        .filter(|l| l.contains("consumed samples"))
        .map(|l| {
            let rest = l.split("lm loss: ").nth(1).expect("an lm loss field");
            rest.split(' ').next().unwrap().parse().unwrap()
        })
        .collect()
}

/// `[timeout 120] mpirun --oversubscribe -np N ferrotron train --dist-backend mpi --config CFG
/// EXTRA...` (the timeout turns a hang into a failure).
#[cfg(feature = "mpi")]
pub fn mpirun_train(np: usize, cfg: &Path, extra: &[&str]) -> std::process::Output {
    std::process::Command::new("timeout")
        .args([
            "120",
            "mpirun",
            "--oversubscribe",
            "--allow-run-as-root",
            "-np",
        ])
        .arg(np.to_string())
        .arg(env!("CARGO_BIN_EXE_ferrotron"))
        .args(["train", "--dist-backend", "mpi", "--config"])
        .arg(cfg)
        .args(extra)
        .output()
        .expect("timeout and mpirun (openmpi-bin)")
}

/// The run `out` under `dir`: tiny-llama, 32-token rows, 6 iterations with validation every
/// 2, a checkpoint every 2.
pub fn tiny_llama_run(dir: &Path, prefix: &Path, out: &str, packed: bool) -> PathBuf {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-llama");
    let cfg = dir.join(format!("{out}.toml"));
    let data_flags = if packed {
        "reset_attention_mask = true\nreset_position_ids = true\neod_mask_loss = true\n"
    } else {
        ""
    };
    std::fs::write(
        &cfg,
        format!(
            "[model]\nload = {:?}\nseq_length = 32\n\
             [data]\ndata_path = {:?}\nsplit = \"90,10,0\"\ndata_cache_path = {:?}\n{data_flags}\
             [training]\nmicro_batch_size = 1\nglobal_batch_size = 4\ntrain_iters = 6\n\
             log_interval = 1\neval_interval = 2\neval_iters = 1\n\
             [optimizer]\nlr = 3e-3\nmin_lr = 3e-4\nlr_warmup_iters = 1\n\
             [parallel]\nddp_bucket_size = 2000\n\
             [checkpoint]\nsave = {:?}\nsave_interval = 2\n\
             [logging]\noutput_dir = {:?}\ntensorboard = false\n",
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
