//! `ferrotron train` with data and tensor parallelism end to end on the tiny LLaMA fixture and
//! a generated corpus: dp 2 in-process (with and without the distributed optimizer), tp 2 x
//! dp 2 with sequence parallelism, and two `mpirun` processes give the single-rank run's
//! training and validation losses; a distributed-optimizer checkpoint resumes on one rank;
//! the tensor-parallel run's HF export holds the gathered model; an HF model converted to a
//! tp 2 x pp 2 checkpoint trains like the HF directory, and a training checkpoint converts
//! back to HF.

use std::path::{Path, PathBuf};

mod common;
#[cfg(feature = "mpi")]
use common::mpirun_train;
use common::{assert_same_losses, ferrotron, metrics_losses, tiny_corpus, train_config};

fn config(dir: &Path, prefix: &Path, out: &str) -> PathBuf {
    config_saving(dir, prefix, out, true)
}

/// [`config`], with or without `checkpoint.save`.
fn config_saving(dir: &Path, prefix: &Path, out: &str, save: bool) -> PathBuf {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-llama");
    let cfg = dir.join(format!("{out}.toml"));
    std::fs::write(
        &cfg,
        format!(
            "[model]\nload = {:?}\nseq_length = 16\n\
             [data]\ndata_path = {:?}\nsplit = \"90,10,0\"\ndata_cache_path = {:?}\n\
             [training]\nmicro_batch_size = 1\nglobal_batch_size = 4\ntrain_iters = 6\n\
             log_interval = 1\neval_interval = 2\neval_iters = 1\n\
             [optimizer]\nlr = 3e-3\nmin_lr = 3e-4\nlr_warmup_iters = 1\n\
             [parallel]\nddp_bucket_size = 2000\n\
             {}[logging]\noutput_dir = {:?}\ntensorboard = false\n",
            model.to_str().unwrap(),
            prefix.to_str().unwrap(),
            dir.join("cache").to_str().unwrap(),
            if save {
                format!(
                    "[checkpoint]\nsave = {:?}\n",
                    dir.join(format!("{out}-ckpt"))
                )
            } else {
                String::new()
            },
            dir.join(out).to_str().unwrap(),
        ),
    )
    .unwrap();
    cfg
}

/// `checkpoint.export_hf=<dir/name>` and that directory.
fn export_to(dir: &Path, name: &str) -> (String, PathBuf) {
    let out = dir.join(name);
    (
        format!("checkpoint.export_hf={:?}", out.to_str().unwrap()),
        out,
    )
}

/// The validation loss of the HF directory `export` alone (`training.skip_train`), run as
/// `out` under `dir`.
fn validate_export(dir: &Path, prefix: &Path, export: &Path, out: &str) -> Vec<(String, u64, f64)> {
    let load = format!("model.load={:?}", export.to_str().unwrap());
    let cfg = config_saving(dir, prefix, out, false);
    train_config(&cfg, &["--set", &load, "--set", "training.skip_train=true"]);
    metrics_losses(&dir.join(out))
}

#[test]
fn dp2_in_process_matches_one_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tiny_corpus(tmp.path());
    train_config(&config(tmp.path(), &prefix, "single"), &[]);
    let want = metrics_losses(&tmp.path().join("single"));
    assert_eq!(
        want.iter().filter(|l| l.0 == "valid").count(),
        3,
        "{want:?}"
    );

    let err = train_config(
        &config(tmp.path(), &prefix, "dp2"),
        &["--set", "parallel.data_parallel_size=2"],
    );
    assert!(err.contains("running 2 ranks in this process"), "{err}");
    assert_same_losses("dp2", &metrics_losses(&tmp.path().join("dp2")), &want);

    // ZeRO-1 with overlapped gradient reduction and parameter gather (validation and a save
    // every 2 iterations in between), stopped at iteration 4, then resumed on ONE rank from
    // its sharded optimizer
    let zero = config(tmp.path(), &prefix, "zero1");
    let dp2_zero = [
        "--set",
        "parallel.data_parallel_size=2",
        "--set",
        "parallel.use_distributed_optimizer=true",
        "--set",
        "parallel.overlap_grad_reduce=true",
        "--set",
        "parallel.overlap_param_gather=true",
        "--set",
        "checkpoint.save_interval=2",
    ];
    train_config(
        &zero,
        &[&dp2_zero[..], &["--set", "training.exit_interval=4"]].concat(),
    );
    let ckpt = tmp.path().join("zero1-ckpt");
    let load = format!("checkpoint.load={:?}", ckpt.to_str().unwrap());
    train_config(&zero, &["--set", &load]);
    assert_same_losses(
        "dp2 zero1 + resume on 1 rank",
        &metrics_losses(&tmp.path().join("zero1")),
        &want,
    );
}

#[test]
fn tp2_x_dp2_in_process_matches_one_rank_and_exports_the_full_model() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tiny_corpus(tmp.path());
    let (set_single, single_export) = export_to(tmp.path(), "single-export");
    train_config(
        &config(tmp.path(), &prefix, "single"),
        &["--set", &set_single],
    );
    let want = metrics_losses(&tmp.path().join("single"));
    let (set_tp, tp_export) = export_to(tmp.path(), "tp-export");
    let err = train_config(
        &config(tmp.path(), &prefix, "tp2dp2"),
        &[
            "--set",
            "parallel.tensor_model_parallel_size=2",
            "--set",
            "parallel.data_parallel_size=2",
            "--set",
            "parallel.sequence_parallel=true",
            "--set",
            &set_tp,
        ],
    );
    assert!(
        err.contains("running 4 ranks in this process (tensor 2 x pipeline 1 x data 2)"),
        "{err}"
    );
    assert_same_losses(
        "tp2 x dp2 + sp",
        &metrics_losses(&tmp.path().join("tp2dp2")),
        &want,
    );
    // The export is the whole trained model: it validates as the single-rank run's export.
    assert_same_losses(
        "exports",
        &validate_export(tmp.path(), &prefix, &tp_export, "check-tp"),
        &validate_export(tmp.path(), &prefix, &single_export, "check-single"),
    );
}

/// Pipeline parallel 2 (one layer per stage), alone and with tensor parallel 2: the single
/// rank's losses, validation included; a tp2 x pp2 run stopped at iteration 4 resumes under
/// pp2 alone, and its HF export equals the single rank's.
#[test]
fn pipeline_parallel_in_process_matches_one_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tiny_corpus(tmp.path());
    let (set_single, single_export) = export_to(tmp.path(), "single-export");
    train_config(
        &config_saving(tmp.path(), &prefix, "single", false),
        &["--set", &set_single],
    );
    let want = metrics_losses(&tmp.path().join("single"));
    let pp2 = ["--set", "parallel.pipeline_model_parallel_size=2"];
    train_config(&config_saving(tmp.path(), &prefix, "pp2", false), &pp2);
    assert_same_losses("pp2", &metrics_losses(&tmp.path().join("pp2")), &want);
    // tp2 x pp2, stopped at 4 with a checkpoint, resumed under pp2 with an export
    let cfg = config(tmp.path(), &prefix, "tp2pp2");
    let tp2pp2 = [
        &pp2[..],
        &["--set", "parallel.tensor_model_parallel_size=2"],
    ]
    .concat();
    train_config(
        &cfg,
        &[&tp2pp2[..], &["--set", "training.exit_interval=4"]].concat(),
    );
    let ckpt = tmp.path().join("tp2pp2-ckpt");
    let load = format!("checkpoint.load={:?}", ckpt.to_str().unwrap());
    let (set_pp, pp_export) = export_to(tmp.path(), "pp-export");
    train_config(
        &cfg,
        &[&pp2[..], &["--set", &load, "--set", &set_pp]].concat(),
    );
    assert_same_losses(
        "tp2 x pp2 -> pp2",
        &metrics_losses(&tmp.path().join("tp2pp2")),
        &want,
    );
    assert_same_losses(
        "pp export",
        &validate_export(tmp.path(), &prefix, &pp_export, "check-pp"),
        &validate_export(tmp.path(), &prefix, &single_export, "check-single"),
    );
}

/// Interleaved 1F1B: pp 2 with 2 model chunks per stage (a 4-layer model from scratch,
/// rank 0 holding layers 0 and 2, rank 1 layers 1 and 3) gives the single rank's losses,
/// validation included.
#[test]
fn interleaved_pipeline_in_process_matches_one_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tiny_corpus(tmp.path());
    let from_scratch = |out: &str| {
        let cfg = config_saving(tmp.path(), &prefix, out, false);
        let text = std::fs::read_to_string(&cfg).unwrap();
        let load = text.lines().find(|l| l.starts_with("load = ")).unwrap();
        let model = "num_layers = 4\nhidden_size = 64\nnum_attention_heads = 4\n\
                     num_query_groups = 2\nvocab_size = 128\ninit_method_std = 0.2";
        std::fs::write(&cfg, text.replace(load, model)).unwrap();
        cfg
    };
    train_config(&from_scratch("single"), &[]);
    let want = metrics_losses(&tmp.path().join("single"));
    let vp2 = [
        "--set",
        "parallel.pipeline_model_parallel_size=2",
        "--set",
        "parallel.virtual_pipeline_model_parallel_size=2",
    ];
    train_config(&from_scratch("vp2"), &vp2);
    assert_same_losses("pp2 vp2", &metrics_losses(&tmp.path().join("vp2")), &want);
    // 3 micro-batches per step cannot be interleaved over 2 stages
    let o = ferrotron(
        &[
            &["train", "--config", from_scratch("bad").to_str().unwrap()][..],
            &vp2,
            &["--set", "training.global_batch_size=3"],
        ]
        .concat(),
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("gives 3 micro-batches per data-parallel rank; the interleaved schedule (parallel.virtual_pipeline_model_parallel_size = 2) needs a multiple of pipeline_model_parallel_size (2)"), "{err}");
    // the 2-layer fixture cannot be cut into 2 x 2 virtual stages
    let o = ferrotron(
        &[
            &[
                "train",
                "--config",
                config(tmp.path(), &prefix, "bad2").to_str().unwrap(),
            ][..],
            &vp2,
        ]
        .concat(),
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("num_layers (2) is not divisible by pipeline_model_parallel_size (2) x virtual_pipeline_model_parallel_size (2)"), "{err}");
}

#[test]
fn bad_parallel_settings_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tiny_corpus(tmp.path());
    let cfg = config(tmp.path(), &prefix, "bad");
    let o = ferrotron(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--set",
        "parallel.data_parallel_size=3",
        "--set",
        "parallel.overlap_param_gather=true",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("training.global_batch_size (4) is not a multiple of micro_batch_size (1) x data_parallel_size (3)"), "{err}");
    assert!(
        err.contains("parallel.overlap_param_gather needs parallel.use_distributed_optimizer"),
        "{err}"
    );
}

/// `mpirun -np N ferrotron train --dist-backend mpi`: dp 2 and dp 4 (with the distributed
/// optimizer), and tp 2 x dp 2, as separate processes: the single rank's losses.
#[cfg(feature = "mpi")]
#[test]
fn mpirun_layouts_match_one_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tiny_corpus(tmp.path());
    train_config(&config(tmp.path(), &prefix, "single"), &[]);
    let want = metrics_losses(&tmp.path().join("single"));
    let layouts: [(&str, usize, &[&str]); 4] = [
        ("mpi-dp2", 2, &[]),
        (
            "mpi-pp2",
            2,
            &["--set", "parallel.pipeline_model_parallel_size=2"],
        ),
        (
            "mpi-dp4-zero1",
            4,
            &[
                "--set",
                "parallel.use_distributed_optimizer=true",
                "--set",
                "parallel.overlap_param_gather=true",
            ],
        ),
        (
            "mpi-tp2dp2",
            4,
            &["--set", "parallel.tensor_model_parallel_size=2"],
        ),
    ];
    for (name, np, sets) in layouts {
        let cfg = config_saving(tmp.path(), &prefix, name, !name.contains("pp"));
        let o = mpirun_train(np, &cfg, sets);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{name}: mpirun failed: {err}");
        assert_same_losses(name, &metrics_losses(&tmp.path().join(name)), &want);
    }
    // Each process wrote its own shards: four optimizer shards under ZeRO-1 over dp 4.
    let last = tmp.path().join("mpi-dp4-zero1-ckpt/iter_0000006");
    let optim = std::fs::read_dir(&last)
        .unwrap()
        .filter(|e| {
            let name = e.as_ref().unwrap().file_name();
            name.to_string_lossy().starts_with("optim_")
        })
        .count();
    assert_eq!(optim, 4, "{}", last.display());
}

/// A layout that does not fit the mpirun world fails every process with the error, no hang.
#[cfg(feature = "mpi")]
#[test]
fn a_bad_mpi_layout_fails_the_job() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tiny_corpus(tmp.path());
    let cfg = config(tmp.path(), &prefix, "fail");
    // 3 processes: global batch 4 does not split over 3 data-parallel ranks
    let o = mpirun_train(3, &cfg, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && o.status.code() != Some(124), "{err}");
    assert!(
        err.contains("not a multiple of micro_batch_size (1) x data_parallel_size (3)"),
        "{err}"
    );
}

fn convert(args: &[&str]) -> String {
    let mut all = vec!["convert"];
    all.extend_from_slice(args);
    let o = ferrotron(&all);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "convert {args:?} failed: {out}\n{err}");
    out
}

/// `convert hf-to-ckpt --check` passes for each family added as switches: the sharded
/// checkpoint's forward matches the HF directory's layer by layer (tp 2 x pp 2 where the
/// key/value heads split, pp 2 for the multi-query fixtures).
#[test]
fn families_convert_with_check() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, tp) in [
        ("tiny-olmo", 2),
        ("tiny-olmo2", 2),
        ("tiny-gemma", 1),
        ("tiny-phi3", 2),
        ("tiny-starcoder2", 2),
        ("tiny-falcon", 1),
        ("tiny-bloom", 2),
    ] {
        let hf = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures")
            .join(name);
        let ckpt = tmp.path().join(name);
        let tp = tp.to_string();
        let out = convert(&[
            "hf-to-ckpt",
            "--hf",
            hf.to_str().unwrap(),
            "--output",
            ckpt.to_str().unwrap(),
            "--check",
            "--tensor-model-parallel-size",
            &tp,
            "--pipeline-model-parallel-size",
            "2",
        ]);
        assert!(
            out.contains("layer   1 output") && out.contains("PASS"),
            "{name}: {out}"
        );
    }
}

/// `convert hf-to-ckpt` for tp 2 x pp 2 (dry run, then for real with `--check`); training
/// tp 2 from that checkpoint (`model.load`), and one rank from it resharded with
/// `ckpt-to-ckpt`, give the single rank's losses from the HF directory; the single run's own
/// training checkpoint converts back to HF (`--check` passing) and validates as its
/// `export_hf`.
#[test]
fn converted_checkpoints_train_and_convert_back() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tiny_corpus(tmp.path());
    let hf = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-llama");
    let hf = hf.to_str().unwrap();
    let ckpt = tmp.path().join("converted");
    let ckpt_s = ckpt.to_str().unwrap();
    let layout = [
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
    ];
    let dry = convert(
        &[
            &["hf-to-ckpt", "--hf", hf, "--output", ckpt_s, "--dry-run"],
            &layout[..],
        ]
        .concat(),
    );
    assert!(dry.contains("model_tp01_pp001.safetensors at"), "{dry}");
    assert!(dry.contains("0 problems; nothing written"), "{dry}");
    assert!(!ckpt.exists());
    let out = convert(
        &[
            &["hf-to-ckpt", "--hf", hf, "--output", ckpt_s, "--check"],
            &layout[..],
        ]
        .concat(),
    );
    assert!(
        out.contains("layer   1 output") && out.contains("PASS"),
        "{out}"
    );

    let (set_single, single_export) = export_to(tmp.path(), "single-export");
    train_config(
        &config(tmp.path(), &prefix, "single"),
        &["--set", &set_single],
    );
    let want = metrics_losses(&tmp.path().join("single"));
    let load = format!("model.load={ckpt_s:?}");
    train_config(
        &config_saving(tmp.path(), &prefix, "from-ckpt", false),
        &[
            "--set",
            &load,
            "--set",
            "parallel.tensor_model_parallel_size=2",
        ],
    );
    assert_same_losses(
        "tp2 from the converted checkpoint",
        &metrics_losses(&tmp.path().join("from-ckpt")),
        &want,
    );

    // Resharded offline to one rank, it trains like the HF directory too.
    let resharded = tmp.path().join("resharded");
    let out = convert(&[
        "ckpt-to-ckpt",
        "--ckpt",
        ckpt_s,
        "--output",
        resharded.to_str().unwrap(),
    ]);
    assert!(out.contains("in 1 files"), "{out}");
    let load = format!("model.load={:?}", resharded.to_str().unwrap());
    train_config(
        &config_saving(tmp.path(), &prefix, "from-resharded", false),
        &["--set", &load],
    );
    assert_same_losses(
        "1 rank from the resharded checkpoint",
        &metrics_losses(&tmp.path().join("from-resharded")),
        &want,
    );

    let trained = tmp.path().join("single-ckpt");
    let back = tmp.path().join("back");
    let out = convert(&[
        "ckpt-to-hf",
        "--ckpt",
        trained.to_str().unwrap(),
        "--output",
        back.to_str().unwrap(),
        "--check",
    ]);
    assert!(out.contains("PASS"), "{out}");
    assert_same_losses(
        "ckpt-to-hf of the training checkpoint",
        &validate_export(tmp.path(), &prefix, &back, "check-back"),
        &validate_export(tmp.path(), &prefix, &single_export, "check-export"),
    );
}
