use super::*;
use std::path::PathBuf;

mod moe;
mod requirements;

/// A temp dir with `corpus_a.{bin,idx}`, `corpus_b.{bin,idx}` and a `tokenizer.json`.
fn data_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), b"{}").unwrap();
    for name in ["corpus_a", "corpus_b"] {
        for ext in ["bin", "idx"] {
            std::fs::write(dir.path().join(format!("{name}.{ext}")), b"x").unwrap();
        }
    }
    dir
}

fn minimal(dir: &Path) -> String {
    format!(
        r#"
[model]
num_layers = 4
hidden_size = 256
num_attention_heads = 4
vocab_size = 1000
seq_length = 128

[data]
data_path = "{}"

[training]
train_iters = 100

[optimizer]
lr = 3e-4
"#,
        dir.join("corpus_a").display()
    )
}

fn full(dir: &Path) -> String {
    let a = dir.join("corpus_a").display().to_string();
    let b = dir.join("corpus_b").display().to_string();
    format!(
        r#"
[model]
num_layers = 4
hidden_size = 256
ffn_hidden_size = 704
num_attention_heads = 8
num_query_groups = 2
kv_channels = 32
vocab_size = 49152
seq_length = 512
max_position_embeddings = 2048
rotary_base = 100000.0
norm_epsilon = 1e-5
untie_embeddings_and_output_weights = true

[data]
data_path = [0.3, "{a}", 0.7, "{b}"]
split = "98,2,0"
dataset_type = "gpt"
eod_mask_loss = true
reset_position_ids = true
reset_attention_mask = true
seed = 7
data_cache_path = "{cache}"
tokenizer_model = "{tok}"
num_workers = 1
prefetch = 4

[training]
micro_batch_size = 2
global_batch_size = 8
train_tokens = 1000000
eval_interval = 50
eval_iters = 10
log_interval = 5
seed = 42
recompute_granularity = "full"
recompute_method = "block"
recompute_num_layers = 2
calculate_per_token_loss = true

[optimizer]
lr = 1e-3
min_lr = 1e-5
lr_decay_style = "cosine"
lr_warmup_samples = 80
weight_decay = 0.1
adam_beta1 = 0.9
adam_beta2 = 0.95
adam_eps = 1e-8
clip_grad = 1.0

[precision]
bf16 = true

[checkpoint]
save = "{save}"
save_interval = 100
keep_last = 3

[logging]
output_dir = "{out}"
tensorboard = false
"#,
        cache = dir.join("cache").display(),
        tok = dir.join("tokenizer.json").display(),
        save = dir.join("ckpt").display(),
        out = dir.join("out").display(),
    )
}

fn problems(text: &str, overrides: &[&str]) -> Vec<String> {
    let ov: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    RunConfig::from_toml_str(text, &ov).unwrap_err().problems
}

fn has(problems: &[String], needle: &str) -> bool {
    problems.iter().any(|p| p.contains(needle))
}

#[test]
fn full_config_round_trips_through_to_toml() {
    let dir = data_dir();
    let cfg = RunConfig::from_toml_str(&full(dir.path()), &[]).unwrap();
    assert_eq!(cfg.global_batch_size, 8);
    assert_eq!(cfg.grad_accum_steps, 4);
    assert_eq!(cfg.train_iters, 1_000_000u64.div_ceil(8 * 512));
    assert_eq!(cfg.lr_warmup_iters, 10);
    assert_eq!(cfg.lr_decay_style, LrDecayStyle::Cosine);
    assert_eq!(cfg.precision, Precision::Bf16);
    assert_eq!(
        cfg.recompute,
        Recompute::Full {
            method: RecomputeMethod::Block,
            num_layers: 2
        }
    );
    assert_eq!(cfg.blend.len(), 2);
    assert_eq!(cfg.blend[0].0, 0.3);
    assert_eq!(cfg.split, [98.0, 2.0, 0.0]);
    let printed = cfg.to_toml();
    let again = RunConfig::from_toml_str(&printed, &[]).unwrap();
    assert_eq!(again, cfg, "printed:\n{printed}");
    assert_eq!(again.to_toml(), printed);
}

#[test]
fn defaults_follow_megatron() {
    let dir = data_dir();
    let cfg = RunConfig::from_toml_str(&minimal(dir.path()), &[]).unwrap();
    let ModelSource::Explicit(dims) = &cfg.model else {
        panic!("explicit model")
    };
    assert_eq!(dims.ffn_hidden_size, 1024);
    assert_eq!(dims.num_query_groups, 4);
    assert_eq!(dims.kv_channels, 64);
    assert_eq!(dims.max_position_embeddings, 128);
    assert_eq!((cfg.global_batch_size, cfg.grad_accum_steps), (1, 1));
    assert_eq!((cfg.lr_warmup_iters, cfg.lr_decay_iters), (0, 100));
    assert_eq!(cfg.lr_decay_style, LrDecayStyle::Linear);
    assert_eq!(cfg.precision, Precision::Fp32);
    assert_eq!(cfg.recompute, Recompute::None);
    assert_eq!(cfg.dataset_type, DatasetType::Gpt);
    assert_eq!(cfg.split, [969.0, 30.0, 1.0]);
    let r = &cfg.resolved;
    assert_eq!(
        (
            r.training.eval_interval,
            r.training.eval_iters,
            r.training.log_interval
        ),
        (1000, 100, 100)
    );
    assert_eq!(
        (
            r.optimizer.weight_decay,
            r.optimizer.adam_beta2,
            r.optimizer.clip_grad
        ),
        (0.01, 0.999, 1.0)
    );
    assert_eq!(r.precision.initial_loss_scale, 4294967296.0);
    assert_eq!(r.logging.output_dir, PathBuf::from("output"));
    // The printed config names the resolved defaults and parses back identically.
    let printed = cfg.to_toml();
    assert!(printed.contains("ffn_hidden_size = 1024"), "{printed}");
    assert!(printed.contains("# save = (unset)"), "{printed}");
    assert_eq!(RunConfig::from_toml_str(&printed, &[]).unwrap(), cfg);
}

#[test]
fn collects_every_problem() {
    let dir = data_dir();
    let text = minimal(dir.path()).replace("lr = 3e-4", "lr = 3e-4\nmin_lr = 1e-3")
        + "[precision]\nbf16 = true\nfp16 = true\n";
    let p = problems(
        &text,
        &[
            "training.global_batch_size=10",
            "training.micro_batch_size=4",
        ],
    );
    assert_eq!(p.len(), 3, "{p:#?}");
    assert!(has(
        &p,
        "training.global_batch_size (10) is not a multiple of micro_batch_size (4) x data_parallel_size (1)"
    ));
    assert!(has(
        &p,
        "optimizer.lr (0.0003) is below optimizer.min_lr (0.001)"
    ));
    assert!(has(&p, "bf16 and fp16 are mutually exclusive"));
    let msg = ConfigError { problems: p }.to_string();
    assert!(
        msg.starts_with("invalid run configuration (3 problems):"),
        "{msg}"
    );
}

#[test]
fn each_validation_error_names_its_key() {
    let dir = data_dir();
    let base = minimal(dir.path());
    let cases: &[(&[&str], &str)] = &[
        (
            &["optimizer.lr_warmup_iters=100"],
            "warmup (100 iterations) must be shorter than lr_decay_iters (100)",
        ),
        (
            &["model.max_position_embeddings=64"],
            "model.seq_length (128) exceeds model.max_position_embeddings (64)",
        ),
        (
            &[
                "training.recompute_granularity=full",
                "training.recompute_method=uniform",
                "training.recompute_num_layers=5",
            ],
            "training.recompute_num_layers (5) exceeds model.num_layers (4)",
        ),
        (
            &["training.recompute_granularity=full"],
            "training.recompute_method is required",
        ),
        (
            &[
                "optimizer.lr_warmup_iters=1",
                "optimizer.lr_warmup_tokens=5",
            ],
            "only one warmup unit (got lr_warmup_iters, lr_warmup_tokens)",
        ),
        (
            &["training.train_tokens=5"],
            "only one of train_iters and train_tokens",
        ),
        (
            &["model.num_query_groups=3"],
            "model.num_attention_heads (4) is not a multiple of model.num_query_groups (3)",
        ),
        (
            &["data.dataset_type=parquet"],
            "data.dataset_type: `parquet`",
        ),
        (&["data.split=1,x"], "data.split"),
        (
            &["optimizer.lr_decay_style=exp"],
            "optimizer.lr_decay_style",
        ),
        (
            &["checkpoint.save_interval=10"],
            "checkpoint.save_interval needs checkpoint.save",
        ),
        (
            &["training.finetune=true"],
            "training.finetune needs checkpoint.load",
        ),
        (
            &["model.load=/nonexistent/hf"],
            "model.load: `/nonexistent/hf` does not exist",
        ),
        (
            &["data.data_path=0.5 a 0.5"],
            "data.data_path: expected one prefix",
        ),
    ];
    for (ov, needle) in cases {
        let p = problems(&base, ov);
        assert!(has(&p, needle), "{ov:?}: {p:#?}");
    }
    let no_model = "[data]\ndata_path = \"x\"\n[training]\n[optimizer]\n";
    let p = problems(no_model, &[]);
    for needle in [
        "model.seq_length is required",
        "model.num_layers is required",
        "optimizer.lr is required",
        "train_iters or train_tokens is required",
    ] {
        assert!(has(&p, needle), "{needle}: {p:#?}");
    }
}

#[test]
fn unknown_keys_and_sections_are_reported_with_their_section() {
    let dir = data_dir();
    let text = minimal(dir.path()).replace(
        "train_iters = 100",
        "train_iters = 100\ntrain_iter = 5\nmicro_bach_size = 2",
    ) + "[optimiser]\nlr = 1.0\n";
    let p = problems(&text, &[]);
    assert!(has(&p, "unknown key `train_iter` in [training]"), "{p:#?}");
    assert!(
        has(&p, "unknown key `micro_bach_size` in [training]"),
        "{p:#?}"
    );
    assert!(has(&p, "unknown section [optimiser]"), "{p:#?}");
    assert_eq!(p.len(), 3, "{p:#?}");
}

#[test]
fn set_overrides_apply_and_are_checked() {
    let dir = data_dir();
    let base = minimal(dir.path());
    let ov = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let cfg = RunConfig::from_toml_str(
        &base,
        &ov(&[
            "training.train_iters=200",
            "optimizer.lr=1e-3",
            "precision.bf16=true",
            "logging.output_dir=runs/x",
        ]),
    )
    .unwrap();
    assert_eq!(cfg.train_iters, 200);
    assert_eq!(cfg.lr, 1e-3);
    assert_eq!(cfg.precision, Precision::Bf16);
    assert_eq!(cfg.resolved.logging.output_dir, PathBuf::from("runs/x"));
    // Unknown keys, bad paths and type errors are all reported together.
    let p = problems(
        &base,
        &[
            "training.nope=1",
            "bogus.lr=1",
            "lr=1",
            "training.train_iters=abc",
            "optimizer.lr=\"fast\"",
        ],
    );
    assert!(
        has(
            &p,
            "--set training.nope=1: unknown key `nope` in [training]"
        ),
        "{p:#?}"
    );
    assert!(
        has(&p, "--set bogus.lr=1: unknown section [bogus]"),
        "{p:#?}"
    );
    assert!(
        has(&p, "--set lr=1: expected section.key=value")
            || has(&p, "--set lr=1: key must be section.key"),
        "{p:#?}"
    );
    assert!(
        has(&p, "training.train_iters: invalid type: string \"abc\""),
        "{p:#?}"
    );
    assert!(
        has(&p, "optimizer.lr: invalid type: string \"fast\""),
        "{p:#?}"
    );
    assert_eq!(p.len(), 5, "{p:#?}");
}

#[test]
fn missing_data_files_are_named() {
    let dir = data_dir();
    std::fs::remove_file(dir.path().join("corpus_b.idx")).unwrap();
    let blend = format!(
        "0.3 {} 0.7 {}",
        dir.path().join("corpus_a").display(),
        dir.path().join("corpus_b").display()
    );
    let p = problems(&minimal(dir.path()), &[&format!("data.data_path={blend}")]);
    assert_eq!(
        p,
        vec![format!(
            "data.data_path: `{}` does not exist",
            dir.path().join("corpus_b.idx").display()
        )]
    );
    // sft_raw wants the files themselves.
    let p = problems(&minimal(dir.path()), &["data.dataset_type=sft_raw"]);
    assert!(
        has(
            &p,
            &format!("`{}` does not exist", dir.path().join("corpus_a").display())
        ),
        "{p:#?}"
    );
}

#[test]
fn documented_keys_cover_every_field() {
    let keys = documented_keys();
    let defaults = toml::Table::try_from(RawConfig::default()).unwrap();
    assert!(keys.len() > 50);
    for k in &keys {
        assert!(!k.doc.is_empty(), "{}.{} undocumented", k.section, k.key);
    }
    let find = |s: &str, k: &str| {
        keys.iter()
            .find(|d| d.section == s && d.key == k)
            .unwrap()
            .clone()
    };
    assert_eq!(find("data", "split").default, "\"969,30,1\"");
    assert_eq!(find("optimizer", "lr").default, "(unset)");
    assert!(
        find("training", "micro_batch_size")
            .doc
            .contains("--micro-batch-size")
    );
    // Every serialized default key is documented.
    for (section, table) in &defaults {
        for key in table.as_table().unwrap().keys() {
            assert!(
                keys.iter().any(|d| d.section == section && d.key == key),
                "{section}.{key}"
            );
        }
    }
}
