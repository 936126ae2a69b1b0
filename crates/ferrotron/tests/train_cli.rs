//! `ferrotron train`: config problems, `--print-config`, `--list-keys`, and a two-iteration
//! continue-pretraining run of SmolLM2-135M on a small generated corpus.
//!
//! The run needs `FERROTRON_SMOLLM2_GGUF` (like tests/smollm2.rs); without it that test prints
//! a notice and passes vacuously.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Output;

mod common;
use common::{ferrotron, model_dir};

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// An (empty) `.bin/.idx` pair: enough for config validation, which only checks existence.
fn fake_prefix(dir: &Path) -> PathBuf {
    let prefix = dir.join("fake_text_document");
    std::fs::write(prefix.with_extension("bin"), b"").unwrap();
    std::fs::write(prefix.with_extension("idx"), b"").unwrap();
    prefix
}

#[test]
fn config_problems_are_all_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("run.toml");
    std::fs::write(
        &cfg,
        "[model]\nseq_length = 32\n[training]\nmicro_batch_size = 0\ntrain_iters = 2\n",
    )
    .unwrap();
    let o = ferrotron(&["train", "--config", cfg.to_str().unwrap()]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("optimizer.lr is required"), "{err}");
    assert!(
        err.contains("training.micro_batch_size must be positive"),
        "{err}"
    );
    assert!(err.contains("data.data_path is required"), "{err}");

    // A valid config with keys this build cannot honour: each is named.
    let prefix = fake_prefix(tmp.path());
    std::fs::write(
        &cfg,
        format!(
            "[model]\nnum_layers = 2\nhidden_size = 64\nnum_attention_heads = 4\nvocab_size = 128\n\
             seq_length = 32\n[data]\ndata_path = {:?}\n[training]\ntrain_iters = 2\n\
             [optimizer]\nlr = 1e-4\n[precision]\nbf16 = true\n",
            prefix.to_str().unwrap()
        ),
    )
    .unwrap();
    let o = ferrotron(&["train", "--config", cfg.to_str().unwrap()]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("not supported yet: model."), "{err}");
    assert!(err.contains("not supported yet: precision.bf16"), "{err}");

    // Bad command line: exit 2.
    let o = ferrotron(&["train", "--no-such-flag"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn print_config_and_list_keys() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = fake_prefix(tmp.path());
    let cfg = tmp.path().join("run.toml");
    std::fs::write(
        &cfg,
        format!(
            "[model]\nnum_layers = 2\nhidden_size = 64\nnum_attention_heads = 4\nvocab_size = 128\n\
             seq_length = 32\n[data]\ndata_path = {:?}\n[training]\ntrain_iters = 2\n\
             [optimizer]\nlr = 1e-4\n",
            prefix.to_str().unwrap()
        ),
    )
    .unwrap();
    let o = ferrotron(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--set",
        "training.train_iters=7",
        "--print-config",
    ]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(out.contains("[training]"), "{out}");
    assert!(out.contains("train_iters = 7"), "{out}");
    assert!(out.contains("ffn_hidden_size = 256"), "{out}");

    let o = ferrotron(&["train", "--list-keys"]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(out.contains("training.micro_batch_size = 1"), "{out}");
    assert!(out.contains("logging.output_dir"), "{out}");
}

#[test]
fn two_iterations_on_smollm2() {
    let Some(model) = model_dir() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let corpus = tmp.path().join("corpus.txt");
    let verses = [
        "In the beginning God created the heaven and the earth.",
        "And the earth was without form, and void; and darkness was upon the face of the deep.",
        "And God said, Let there be light: and there was light.",
        "And God saw the light, that it was good: and God divided the light from the darkness.",
    ];
    let lines: Vec<String> = (0..300)
        .map(|i| format!("{} {}", i, verses[i % verses.len()]))
        .collect();
    std::fs::write(&corpus, lines.join("\n")).unwrap();
    let prefix = tmp.path().join("kjv");
    let o = ferrotron(&[
        "preprocess-data",
        "--input",
        corpus.to_str().unwrap(),
        "--tokenizer",
        model.to_str().unwrap(),
        "--output-prefix",
        prefix.to_str().unwrap(),
        "--append-eod",
        "--workers",
        "2",
    ]);
    assert!(o.status.success(), "preprocess: {}", text(&o).1);
    let data_prefix = tmp.path().join("kjv_text_document");
    assert!(data_prefix.with_extension("idx").exists());

    let out_dir = tmp.path().join("out");
    let cfg = tmp.path().join("run.toml");
    std::fs::write(
        &cfg,
        format!(
            "[model]\nload = {:?}\nseq_length = 32\n\
             [data]\ndata_path = {:?}\nsplit = \"90,10,0\"\n\
             [training]\nmicro_batch_size = 1\nglobal_batch_size = 2\ntrain_iters = 2\n\
             eval_interval = 2\neval_iters = 1\nlog_interval = 1\n\
             [optimizer]\nlr = 1e-4\n\
             [logging]\noutput_dir = {:?}\ntensorboard = false\n",
            model.to_str().unwrap(),
            data_prefix.to_str().unwrap(),
            out_dir.to_str().unwrap()
        ),
    )
    .unwrap();
    let o = ferrotron(&["train", "--config", cfg.to_str().unwrap()]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "stdout:\n{out}\nstderr:\n{err}");
    let loss_lines = out.lines().filter(|l| l.contains("lm loss")).count();
    assert!(loss_lines >= 3, "2 train lines + 1 validation line:\n{out}");
    assert_eq!(
        out.lines()
            .filter(|l| l.contains("consumed samples") && l.contains("lm loss"))
            .count(),
        2,
        "{out}"
    );

    let metrics = std::fs::read_to_string(out_dir.join("metrics.jsonl")).unwrap();
    let records: Vec<Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let json = |r: &Value| r.to_string();
    let train = records
        .iter()
        .filter(|r| json(r).contains("consumed_samples"))
        .count();
    let valid = records.iter().filter(|r| json(r).contains("ppl")).count();
    assert_eq!(train, 2, "{metrics}");
    assert_eq!(valid, 1, "{metrics}");
    for r in &records {
        assert!(json(r).contains("lm_loss"), "{metrics}");
    }
    let resolved = std::fs::read_to_string(out_dir.join("run.toml")).unwrap();
    assert!(resolved.contains("global_batch_size = 2"), "{resolved}");
}
