//! `ferrotron train` of an MoE model end to end (the tiny Mixtral fixture, a generated
//! corpus): `[moe]` options on a loaded model turn the balancing losses on, the log line and
//! `metrics.jsonl` carry `load_balancing_loss` / `z_loss`; expert parallelism 2 over dp 2
//! and over context parallelism 2 in-process and 4 `mpirun` processes (ep 4) give the single
//! rank's training and validation
//! losses; the expert-parallel run's checkpoint converts back to an HF Mixtral that validates
//! as the single rank's does. DeepSeek-V2 (multi-latent attention) the same under tp 2 with
//! sequence parallelism and ep 2.

use std::path::{Path, PathBuf};

mod common;
use common::{ferrotron, metrics_losses, text, tiny_corpus, train_config};

fn config(dir: &Path, prefix: &Path, out: &str) -> PathBuf {
    config_of("tiny-mixtral", dir, prefix, out)
}

/// A 4-iteration run of fixture `model` with its balancing losses on.
fn config_of(model: &str, dir: &Path, prefix: &Path, out: &str) -> PathBuf {
    let model = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(model);
    let cfg = dir.join(format!("{out}.toml"));
    std::fs::write(
        &cfg,
        format!(
            "[model]\nload = {:?}\nseq_length = 16\n\
             [data]\ndata_path = {:?}\nsplit = \"90,10,0\"\ndata_cache_path = {:?}\n\
             [training]\nmicro_batch_size = 1\nglobal_batch_size = 4\ntrain_iters = 4\n\
             log_interval = 1\neval_interval = 2\neval_iters = 1\n\
             [optimizer]\nlr = 3e-3\nmin_lr = 3e-4\nlr_warmup_iters = 1\n\
             [moe]\nmoe_router_load_balancing_type = \"aux_loss\"\nmoe_z_loss_coeff = 1e-3\n\
             [checkpoint]\nsave = {:?}\n\
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

/// `(iteration, load_balancing_loss, z_loss)` of every training line of `metrics.jsonl`.
fn moe_metrics(out_dir: &Path) -> Vec<(u64, f64, f64)> {
    std::fs::read_to_string(out_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["kind"] == "train")
        .map(|v| {
            let m = &v["moe"];
            (
                v["iteration"].as_u64().unwrap(),
                m["load_balancing_loss"].as_f64().unwrap(),
                m["z_loss"].as_f64().unwrap(),
            )
        })
        .collect()
}

fn assert_close(label: &str, got: f64, want: f64) {
    let rel = (got - want).abs() / want.abs();
    assert!(rel <= 1e-5, "{label}: {got} vs {want} (rel {rel:.1e})");
}

fn assert_same_run(label: &str, dir: &Path, got: &str, want: &str) {
    let (g, w) = (
        metrics_losses(&dir.join(got)),
        metrics_losses(&dir.join(want)),
    );
    assert_eq!(g.len(), w.len(), "{label}");
    for (g, w) in g.iter().zip(&w) {
        assert_eq!((&g.0, g.1), (&w.0, w.1), "{label}");
        assert_close(&format!("{label} {} {}", g.0, g.1), g.2, w.2);
    }
    let (g, w) = (moe_metrics(&dir.join(got)), moe_metrics(&dir.join(want)));
    assert_eq!(g.len(), w.len(), "{label}");
    for (g, w) in g.iter().zip(&w) {
        assert_close(&format!("{label} load_balancing_loss {}", g.0), g.1, w.1);
        assert_close(&format!("{label} z_loss {}", g.0), g.2, w.2);
    }
}

#[test]
fn expert_parallel_runs_match_one_rank_and_convert_back() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tiny_corpus(tmp.path());
    let log = train_config(&config(tmp.path(), &prefix, "single"), &[]);
    assert!(log.contains("| load_balancing_loss: "), "{log}");
    assert!(log.contains("| z_loss: "), "{log}");
    let metrics = moe_metrics(&tmp.path().join("single"));
    assert_eq!(metrics.len(), 4);
    assert!(
        metrics
            .iter()
            .all(|m| (0.5..4.0).contains(&m.1) && m.2 > 0.0),
        "{metrics:?}"
    );
    train_config(
        &config(tmp.path(), &prefix, "ep2"),
        &[
            "--set",
            "parallel.data_parallel_size=2",
            "--set",
            "parallel.expert_model_parallel_size=2",
        ],
    );
    assert_same_run("ep2 x dp2 in-process", tmp.path(), "ep2", "single");
    // Context parallel 2 with the experts folded over its ranks (ep 2, dp 1).
    train_config(
        &config(tmp.path(), &prefix, "cp2-ep2"),
        &[
            "--set",
            "parallel.context_parallel_size=2",
            "--set",
            "parallel.expert_model_parallel_size=2",
        ],
    );
    assert_same_run("cp2 x ep2 in-process", tmp.path(), "cp2-ep2", "single");
    // Each run's checkpoint as an HF Mixtral: the two validate alike (the same held-out
    // batches: `skip_train` evaluates the first ones).
    let single = exported_validation(tmp.path(), &prefix, "single");
    let ep2 = exported_validation(tmp.path(), &prefix, "ep2");
    assert_close("ep2 export vs single export", ep2, single);
}

/// DeepSeek-V2 (multi-latent attention, grouped routing, shared experts) from its HF
/// directory: tensor parallel 2 with sequence parallelism, expert parallel 2 over data
/// parallel 2, and both with whole experts (`expert_tensor_parallel_size` 1) give the single
/// rank's run, and the checkpoint converts back to an HF
/// DeepseekV2 that validates as the single rank's does.
#[test]
fn deepseek_v2_trains_under_tp_sp_and_ep_and_converts_back() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tiny_corpus(tmp.path());
    let cfg = |out: &str| config_of("tiny-deepseek-v2", tmp.path(), &prefix, out);
    let log = train_config(&cfg("ds-single"), &[]);
    assert!(log.contains("| load_balancing_loss: "), "{log}");
    let set = |kv: &'static str| ["--set", kv];
    let tp: Vec<&str> = [
        set("parallel.tensor_model_parallel_size=2"),
        set("parallel.sequence_parallel=true"),
    ]
    .concat();
    train_config(&cfg("ds-tp2"), &tp);
    assert_same_run("deepseek tp2 sp", tmp.path(), "ds-tp2", "ds-single");
    let ep: Vec<&str> = [
        set("parallel.data_parallel_size=2"),
        set("parallel.expert_model_parallel_size=2"),
    ]
    .concat();
    train_config(&cfg("ds-ep2"), &ep);
    assert_same_run("deepseek ep2 x dp2", tmp.path(), "ds-ep2", "ds-single");
    // tp 2 x ep 2 over dp 2 with whole experts (expert_tensor_parallel_size 1).
    let etp1 = [
        tp,
        ep,
        set("parallel.expert_tensor_parallel_size=1").to_vec(),
    ]
    .concat();
    train_config(&cfg("ds-etp1"), &etp1);
    assert_same_run(
        "deepseek tp2 x ep2 etp1",
        tmp.path(),
        "ds-etp1",
        "ds-single",
    );
    let single = exported_validation_of("tiny-deepseek-v2", tmp.path(), &prefix, "ds-single");
    let ep2 = exported_validation_of("tiny-deepseek-v2", tmp.path(), &prefix, "ds-ep2");
    assert_close("deepseek ep2 export vs single export", ep2, single);
}

/// A DeepSeek-V2 built from `[model]`, `[mla]` (query latent, YaRN) and `[moe]` (grouped,
/// scaled, pre-softmax routing; shared expert; a dense first layer): its loss falls, and its
/// checkpoint converts to an HF DeepseekV2 with the same MLA and routing keys.
#[test]
fn deepseek_v2_from_scratch() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tiny_corpus(tmp.path());
    let (out, ckpt) = (tmp.path().join("scratch"), tmp.path().join("scratch-ckpt"));
    let cfg = tmp.path().join("scratch.toml");
    std::fs::write(
        &cfg,
        format!(
            "[model]
family = \"deepseek_v2\"
num_layers = 3
hidden_size = 48
\
             num_attention_heads = 4
vocab_size = 112
seq_length = 16
ffn_hidden_size = 64
\
             [mla]
multi_latent_attention = true
q_lora_rank = 24
kv_lora_rank = 16
\
             qk_head_dim = 12
qk_pos_emb_head_dim = 8
v_head_dim = 10
\
             original_max_position_embeddings = 8
rotary_scaling_factor = 4.0
\
             mscale = 0.707
mscale_all_dim = 0.707
\
             [moe]
num_experts = 8
moe_router_topk = 2
moe_ffn_hidden_size = 16
\
             moe_layer_freq = [0, 1, 1]
moe_router_pre_softmax = true
\
             moe_router_num_groups = 4
moe_router_group_topk = 2
moe_router_group_score = \"max\"
\
             moe_router_topk_scaling_factor = 2.5
moe_shared_expert_intermediate_size = 32
\
             moe_aux_loss_coeff = 1e-3
moe_router_load_balancing_type = \"seq_aux_loss\"
\
             [data]
data_path = {:?}
split = \"90,10,0\"
data_cache_path = {:?}
\
             [training]
micro_batch_size = 2
global_batch_size = 4
train_iters = 8
\
             log_interval = 1
eval_interval = 8
eval_iters = 1
\
             [optimizer]
lr = 3e-3
min_lr = 3e-4
lr_warmup_iters = 1
\
             [checkpoint]
save = {:?}
[logging]
output_dir = {:?}
tensorboard = false
",
            prefix.to_str().unwrap(),
            tmp.path().join("cache").to_str().unwrap(),
            ckpt.to_str().unwrap(),
            out.to_str().unwrap(),
        ),
    )
    .unwrap();
    let log = train_config(&cfg, &[]);
    assert!(log.contains("| load_balancing_loss: "), "{log}");
    let losses: Vec<f64> = metrics_losses(&out)
        .into_iter()
        .filter(|l| l.0 == "train")
        .map(|l| l.2)
        .collect();
    assert!(losses[losses.len() - 1] < losses[0], "{losses:?}");
    let c = to_hf(&ckpt, &tmp.path().join("scratch-hf"));
    assert_eq!(c["architectures"][0], "DeepseekV2ForCausalLM");
    assert_eq!(
        (&c["q_lora_rank"], &c["kv_lora_rank"], &c["v_head_dim"]),
        (
            &serde_json::json!(24),
            &serde_json::json!(16),
            &serde_json::json!(10)
        )
    );
    assert_eq!(c["topk_method"], "group_limited_greedy");
    assert_eq!(c["first_k_dense_replace"], 1);
    assert_eq!(c["rope_parameters"]["rope_type"], "yarn");
}

/// `convert hf-to-ckpt --check` with the experts laid out for expert parallelism (split over
/// tp, or whole): the checkpoint's model run at tp x ep (x pp) in-process matches the HF
/// directory layer by layer; an expert tensor-parallel size other than 1 or tp is refused.
#[test]
fn expert_layouts_convert_with_check() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, layout) in [
        ("tiny-deepseek-v2", ["2", "1", "4", "1"]),
        ("tiny-mixtral", ["2", "2", "2", "2"]),
    ] {
        let hf = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures")
            .join(name);
        let ckpt = tmp.path().join(format!("{name}-{}", layout.join("-")));
        let [t, p, ep, etp] = layout;
        let o = ferrotron(&[
            "convert",
            "hf-to-ckpt",
            "--hf",
            hf.to_str().unwrap(),
            "--output",
            ckpt.to_str().unwrap(),
            "--check",
            "--tensor-model-parallel-size",
            t,
            "--pipeline-model-parallel-size",
            p,
            "--expert-model-parallel-size",
            ep,
            "--expert-tensor-parallel-size",
            etp,
        ]);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{name} {layout:?}: {out}\n{err}");
        assert!(
            out.contains("layer   1 output") && out.contains("PASS"),
            "{out}"
        );
        assert!(err.contains(&format!("x ep {ep}")), "{err}");
    }
    let o = ferrotron(&[
        "convert",
        "hf-to-ckpt",
        "--hf",
        "fixtures/tiny-mixtral",
        "--output",
        tmp.path().join("bad").to_str().unwrap(),
        "--tensor-model-parallel-size",
        "2",
        "--expert-tensor-parallel-size",
        "3",
    ]);
    assert!(!o.status.success());
    assert!(
        text(&o).1.contains("--expert-tensor-parallel-size 3"),
        "{}",
        text(&o).1
    );
}

/// `convert ckpt-to-hf` of `ckpt` into `hf`; the written `config.json`.
fn to_hf(ckpt: &Path, hf: &Path) -> serde_json::Value {
    let o = ferrotron(&[
        "convert",
        "ckpt-to-hf",
        "--ckpt",
        ckpt.to_str().unwrap(),
        "--output",
        hf.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o).1);
    serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap()).unwrap()
}

/// The validation loss of run `run`'s checkpoint converted to HF.
fn exported_validation(dir: &Path, prefix: &Path, run: &str) -> f64 {
    exported_validation_of("tiny-mixtral", dir, prefix, run)
}

/// [`exported_validation`] of a run of fixture `model`.
fn exported_validation_of(model: &str, dir: &Path, prefix: &Path, run: &str) -> f64 {
    let hf = dir.join(format!("{run}-hf"));
    let config_json = to_hf(&dir.join(format!("{run}-ckpt")), &hf);
    let want: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../fixtures")
                .join(model)
                .join("config.json"),
        )
        .unwrap(),
    )
    .unwrap();
    assert_eq!(config_json["architectures"], want["architectures"]);
    let load = format!("model.load={:?}", hf.to_str().unwrap());
    let valid_run = format!("{run}-hf-valid");
    let cfg = config_of(model, dir, prefix, &valid_run);
    train_config(&cfg, &["--set", &load, "--set", "training.skip_train=true"]);
    metrics_losses(&dir.join(valid_run))
        .into_iter()
        .find(|l| l.0 == "valid")
        .expect("a validation line")
        .2
}

/// `mpirun -np 4 ferrotron train --dist-backend mpi` with expert parallelism 4: the
/// single rank's losses.
#[cfg(feature = "mpi")]
#[test]
fn mpirun_expert_parallel_4_matches_one_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tiny_corpus(tmp.path());
    train_config(&config(tmp.path(), &prefix, "single"), &[]);
    let cfg = config(tmp.path(), &prefix, "mpi-ep4");
    let o = common::mpirun_train(4, &cfg, &["--set", "parallel.expert_model_parallel_size=4"]);
    assert!(o.status.success(), "mpirun failed: {}", text(&o).1);
    assert_same_run("mpi ep4", tmp.path(), "mpi-ep4", "single");
}
