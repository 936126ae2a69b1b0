//! `ferrotron train`: config problems, `--print-config`, `--list-keys`, and a two-iteration
//! continue-pretraining run of SmolLM2-135M on a small generated corpus.
//!
//! The runs need `FERROTRON_SMOLLM2_GGUF` (like tests/smollm2.rs); without it those tests are
//! reported as ignored (`common::weights`).

use serde_json::Value;
use std::path::{Path, PathBuf};

mod common;
use common::weights::{self, GGUF, trials};
use common::{ferrotron, model_dir, text, train, train_losses};

fn main() {
    let plain = trials![config_problems_are_all_reported, print_config_and_list_keys];
    let smollm2 = trials![needs [GGUF]:
        two_iterations_on_smollm2,
        bf16_with_selective_recompute_tracks_f32,
        pretrain_from_scratch_loss_falls,
        dpo_with_lora_on_smollm2,
        reward_model_on_smollm2,
    ];
    weights::run(plain.into_iter().chain(smollm2));
}

/// An (empty) `.bin/.idx` pair: enough for config validation, which only checks existence.
fn fake_prefix(dir: &Path) -> PathBuf {
    let prefix = dir.join("fake_text_document");
    std::fs::write(prefix.with_extension("bin"), b"").unwrap();
    std::fs::write(prefix.with_extension("idx"), b"").unwrap();
    prefix
}

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
             seq_length = 32\n[data]\ndata_path = {:?}\nnum_workers = 2\n[training]\ntrain_iters = 2\n\
             [optimizer]\nlr = 1e-4\nlr_decay_style = \"WSD\"\n",
            prefix.to_str().unwrap()
        ),
    )
    .unwrap();
    let o = ferrotron(&["train", "--config", cfg.to_str().unwrap()]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("not supported yet: data.num_workers"), "{err}");
    assert!(
        err.contains("not supported yet: optimizer.lr_decay_style"),
        "{err}"
    );

    // Bad command line: exit 2.
    let o = ferrotron(&["train", "--no-such-flag"]);
    assert_eq!(o.status.code(), Some(2));
}

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

/// A small KJV-like corpus preprocessed with the SmolLM2 tokenizer; returns the data prefix.
fn corpus(dir: &Path, model: &Path) -> PathBuf {
    let corpus = dir.join("corpus.txt");
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
    let prefix = dir.join("kjv");
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
    let data_prefix = dir.join("kjv_text_document");
    assert!(data_prefix.with_extension("idx").exists());
    data_prefix
}

fn two_iterations_on_smollm2() {
    let model = model_dir();
    let tmp = tempfile::tempdir().unwrap();
    let data_prefix = corpus(tmp.path(), model);
    let out_dir = tmp.path().join("out");
    let export = tmp.path().join("exported");
    let out = train(
        tmp.path(),
        &format!(
            "[model]\nload = {:?}\nseq_length = 32\n\
             [data]\ndata_path = {:?}\nsplit = \"90,10,0\"\n\
             [training]\nmicro_batch_size = 1\nglobal_batch_size = 2\ntrain_iters = 2\n\
             eval_interval = 2\neval_iters = 1\nlog_interval = 1\n\
             [optimizer]\nlr = 1e-4\n\
             [checkpoint]\nexport_hf = {:?}\n\
             [logging]\noutput_dir = {:?}\ntensorboard = true\n",
            model.to_str().unwrap(),
            data_prefix.to_str().unwrap(),
            export.to_str().unwrap(),
            out_dir.to_str().unwrap()
        ),
    );
    let loss_lines = out.lines().filter(|l| l.contains("lm loss")).count();
    assert!(loss_lines >= 3, "2 train lines + 1 validation line:\n{out}");
    assert_eq!(train_losses(&out).len(), 2, "{out}");

    let metrics = std::fs::read_to_string(out_dir.join("metrics.jsonl")).unwrap();
    let records: Vec<Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let json = |r: &Value| r.to_string();
    let train_records = records
        .iter()
        .filter(|r| json(r).contains("consumed_samples"))
        .count();
    let valid = records.iter().filter(|r| json(r).contains("ppl")).count();
    assert_eq!(train_records, 2, "{metrics}");
    assert_eq!(valid, 1, "{metrics}");
    for r in &records {
        assert!(json(r).contains("lm_loss"), "{metrics}");
    }
    let resolved = std::fs::read_to_string(out_dir.join("run.toml")).unwrap();
    assert!(resolved.contains("global_batch_size = 2"), "{resolved}");

    // The loss curve and a TensorBoard event file.
    let png = std::fs::read(out_dir.join("loss.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    let events: Vec<_> = std::fs::read_dir(out_dir.join("tensorboard"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(
        events.len() == 1 && events[0].starts_with("events.out.tfevents."),
        "{events:?}"
    );

    // skip_train evaluates the exported (f32, exact) model on the same validation batch the
    // run evaluated at its end: the same loss.
    let run_valid = records
        .iter()
        .find(|r| json(r).contains("ppl"))
        .map(|r| r["lm_loss"].as_f64().unwrap())
        .unwrap();
    let eval_dir = tmp.path().join("eval");
    let out = train(
        tmp.path(),
        &format!(
            "[model]\nload = {:?}\nseq_length = 32\n\
             [data]\ndata_path = {:?}\nsplit = \"90,10,0\"\n\
             [training]\nmicro_batch_size = 1\nglobal_batch_size = 2\ntrain_iters = 2\n\
             eval_interval = 2\neval_iters = 1\nskip_train = true\n\
             [optimizer]\nlr = 1e-4\n\
             [logging]\noutput_dir = {:?}\ntensorboard = false\n",
            export.to_str().unwrap(),
            data_prefix.to_str().unwrap(),
            eval_dir.to_str().unwrap()
        ),
    );
    assert!(
        !out.contains("consumed samples"),
        "skip_train trained:\n{out}"
    );
    let line = std::fs::read_to_string(eval_dir.join("metrics.jsonl")).unwrap();
    let eval: Value = serde_json::from_str(line.trim()).unwrap();
    let loss = eval["lm_loss"].as_f64().unwrap();
    assert!(
        (loss - run_valid).abs() < 1e-5 * run_valid,
        "exported model {loss} vs run {run_valid}"
    );

    // The exported HF directory loads and scores text.
    assert!(export.join("config.json").is_file());
    assert!(export.join("tokenizer.json").is_file());
    let o = ferrotron(&[
        "score",
        "--model",
        export.to_str().unwrap(),
        "--text",
        "And God said, Let there be light: and there was light.",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "score: {err}");
    assert!(out.contains("loss"), "{out}");
}

fn bf16_with_selective_recompute_tracks_f32() {
    let model = model_dir();
    let tmp = tempfile::tempdir().unwrap();
    let data_prefix = corpus(tmp.path(), model);
    let run = |extra: &str, name: &str| {
        let out_dir = tmp.path().join(name);
        train(
            tmp.path(),
            &format!(
                "[model]\nload = {:?}\nseq_length = 32\n\
                 [data]\ndata_path = {:?}\nsplit = \"100,0,0\"\n\
                 [training]\nmicro_batch_size = 2\nglobal_batch_size = 2\ntrain_iters = 2\n\
                 log_interval = 1\neval_iters = 0\n{extra}\n\
                 [optimizer]\nlr = 1e-4\n\
                 [logging]\noutput_dir = {:?}\ntensorboard = false\n",
                model.to_str().unwrap(),
                data_prefix.to_str().unwrap(),
                out_dir.to_str().unwrap()
            ),
        )
    };
    let f32_losses = train_losses(&run("", "f32"));
    let bf16_out = run(
        "recompute_granularity = \"selective\"\n[precision]\nbf16 = true",
        "bf16",
    );
    let bf16_losses = train_losses(&bf16_out);
    assert_eq!(bf16_losses.len(), 2, "{bf16_out}");
    // Same first loss (weights differ only by bf16 rounding); then both fall. The second
    // losses differ by more: many of step 1's lr-1e-4 updates are below half a bf16 ulp of
    // the weight, so the bf16 model lags its f32 master weights (as in Megatron).
    let (a, b) = (&f32_losses, &bf16_losses);
    assert!((a[0] - b[0]).abs() < 0.01 * a[0], "f32 {a:?} vs bf16 {b:?}");
    assert!(b[1] < b[0] && a[1] < a[0], "f32 {a:?} vs bf16 {b:?}");
}

fn pretrain_from_scratch_loss_falls() {
    let model = model_dir();
    let tmp = tempfile::tempdir().unwrap();
    let data_prefix = corpus(tmp.path(), model);
    let out = train(
        tmp.path(),
        &format!(
            "[model]\nnum_layers = 2\nhidden_size = 64\nnum_attention_heads = 4\n\
             num_query_groups = 2\nvocab_size = 49152\nseq_length = 32\n\
             [data]\ndata_path = {:?}\nsplit = \"100,0,0\"\ntokenizer_model = {:?}\n\
             eod_mask_loss = true\n\
             [training]\nmicro_batch_size = 4\nglobal_batch_size = 4\ntrain_iters = 40\n\
             log_interval = 10\neval_iters = 0\n\
             [optimizer]\nlr = 3e-3\nlr_warmup_iters = 5\n\
             [logging]\noutput_dir = {:?}\ntensorboard = false\n",
            data_prefix.to_str().unwrap(),
            model.to_str().unwrap(),
            tmp.path().join("out").to_str().unwrap()
        ),
    );
    let losses = train_losses(&out);
    assert_eq!(losses.len(), 4, "{out}");
    // ln(49152) = 10.8 at init; the repeated verses are learned quickly.
    assert!(losses[0] > 9.0, "{losses:?}");
    assert!(losses[3] < losses[0] - 3.0, "{losses:?}");
}

/// DPO with LoRA from `run.toml` (issue 19) on a small preference file in both forms (chat
/// and plain text): the first step's loss is ln 2 (fresh adapters: policy = reference), the
/// log lines carry TRL's reward metrics, the adapters come out as a PEFT directory; a row
/// without `rejected` is an error naming its line.
fn dpo_with_lora_on_smollm2() {
    let model = model_dir();
    let tmp = tempfile::tempdir().unwrap();
    let (pairs, lines) = preference_pairs(tmp.path());
    let adapter = tmp.path().join("adapter");
    let toml = |data: &Path| {
        format!(
            "[model]\nload = {:?}\nseq_length = 64\n\
             [data]\ndata_path = {:?}\ndataset_type = \"dpo\"\nsplit = \"20,4,0\"\n\
             [training]\nmicro_batch_size = 2\nglobal_batch_size = 4\ntrain_iters = 2\n\
             log_interval = 1\neval_interval = 2\neval_iters = 1\n\
             [optimizer]\nlr = 5e-4\n\
             [lora]\nenabled = true\nrank = 8\nalpha = 16\n\
             [checkpoint]\nexport_peft = {:?}\n\
             [logging]\noutput_dir = {:?}\ntensorboard = false\n",
            model.to_str().unwrap(),
            data.to_str().unwrap(),
            adapter.to_str().unwrap(),
            tmp.path().join("out").to_str().unwrap()
        )
    };
    let out = train(tmp.path(), &toml(&pairs));
    let losses = train_losses(&out);
    assert_eq!(losses.len(), 2, "{out}");
    assert_eq!(losses[0], 6.931472e-1, "ln 2 at step 0: {out}");
    assert!(out.contains("rewards/accuracies:"), "{out}");
    assert!(
        out.contains("validation loss at iteration 2") && out.contains("rewards/margins"),
        "{out}"
    );
    assert!(adapter.join("adapter_model.safetensors").is_file());
    let broken = tmp.path().join("broken.jsonl");
    std::fs::write(
        &broken,
        format!("{}\n{{\"prompt\": \"x\", \"chosen\": \"y\"}}\n", lines[0]),
    )
    .unwrap();
    let cfg = tmp.path().join("broken.toml");
    std::fs::write(&cfg, toml(&broken)).unwrap();
    let o = ferrotron(&["train", "--config", cfg.to_str().unwrap()]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("broken.jsonl:2: missing field `rejected`"),
        "{err}"
    );
}

/// A small preference file in both forms (chat and plain text): 24 pairs. Returns its path
/// and its lines.
fn preference_pairs(dir: &Path) -> (PathBuf, Vec<String>) {
    let pairs = dir.join("pairs.jsonl");
    let mut lines = Vec::new();
    for i in 0..12 {
        lines.push(format!(
            "{{\"prompt\": [{{\"role\": \"user\", \"content\": \"What is {i} plus {i}?\"}}], \
             \"chosen\": \"{i} plus {i} is {}.\", \"rejected\": \"I like turtles.\"}}",
            2 * i
        ));
        // TRL's reward-model `margin` on these (DPO leaves it alone).
        lines.push(format!(
            "{{\"prompt\": \"Count to {i}:\", \"chosen\": \" {}\", \"rejected\": \" no\", \
             \"margin\": 0.5}}",
            (1..=i.max(1))
                .map(|k| k.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    std::fs::write(&pairs, lines.join("\n")).unwrap();
    (pairs, lines)
}

/// A reward model from `run.toml` (issue 19): SmolLM2 gets a score head, trains two steps on
/// the preference pairs (accuracy in the log lines), and exports as
/// `LlamaForSequenceClassification`, which loads back as a score-head model.
fn reward_model_on_smollm2() {
    let model = model_dir();
    let tmp = tempfile::tempdir().unwrap();
    let (pairs, _) = preference_pairs(tmp.path());
    let export = tmp.path().join("rm-hf");
    let out = train(
        tmp.path(),
        &format!(
            "[model]\nload = {:?}\nseq_length = 64\n\
             [data]\ndata_path = {:?}\ndataset_type = \"reward\"\nsplit = \"20,4,0\"\n\
             [training]\nmicro_batch_size = 2\nglobal_batch_size = 4\ntrain_iters = 2\n\
             log_interval = 1\neval_interval = 2\neval_iters = 1\n\
             [optimizer]\nlr = 1e-4\n\
             [reward]\ncenter_rewards_coefficient = 0.01\n\
             [checkpoint]\nexport_hf = {:?}\n\
             [logging]\noutput_dir = {:?}\ntensorboard = false\n",
            model.to_str().unwrap(),
            pairs.to_str().unwrap(),
            export.to_str().unwrap(),
            tmp.path().join("out").to_str().unwrap()
        ),
    );
    let losses = train_losses(&out);
    assert_eq!(losses.len(), 2, "{out}");
    assert!(
        losses.iter().all(|l| l.is_finite() && *l > 0.0),
        "{losses:?}"
    );
    assert!(out.contains("rewards/accuracies:"), "{out}");
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(export.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["architectures"][0], "LlamaForSequenceClassification");
    let (back, _) =
        ferrotron_model::families::load_hf_model(&export, ferrotron_tensor::DType::F32).unwrap();
    assert_eq!(
        back.config().output_head,
        ferrotron_model::OutputHead::Score
    );
}
