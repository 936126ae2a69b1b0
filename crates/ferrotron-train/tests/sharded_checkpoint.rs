//! Sharded checkpoints: every rank of a tp 2 x pp 2 x dp 2 run with the distributed optimizer
//! writes its own shards (model boxes once per tensor, each data-parallel rank its optimizer
//! shard), and the checkpoint resumes bit-for-bit as the uninterrupted run under other
//! layouts: one rank, tp 4, pp 4, and pp 2 x dp 2; bf16 runs' master weights and moments
//! survive loading under another layout and saving again unchanged; converted (HF)
//! checkpoints train like the HF model.

mod common;

use common::layouts::*;
use ferrotron_checkpoint::dist::{CheckpointReader, iteration_dir};
use ferrotron_comm::run_local;
use ferrotron_model::{GptModel, InitConfig, TransformerConfig};
use ferrotron_train::trainer::{LoadMode, TrainError, Trainer};

/// 4 layers, 8 heads in 4 query groups (so tp 4 works), vocabulary 112 (padded per tp).
fn model(tied: bool) -> GptModel {
    let mut config = TransformerConfig::llama(4, 64, 128, 8, 4, 112, 64).unwrap();
    config.untie_embeddings_and_output_weights = !tied;
    GptModel::init_random(config, InitConfig::default()).unwrap()
}

fn layout(tp: usize, pp: usize, distributed: bool) -> Layout {
    Layout {
        tp,
        pp,
        distributed,
        ..Layout::default()
    }
}

#[test]
fn tp2_pp2_dp2_checkpoint_resumes_under_other_layouts() {
    for tied in [false, true] {
        let label = if tied { "tied" } else { "untied" };
        let mut one = Trainer::new(model(tied), dp_options(1, ITERS)).unwrap();
        let tail = tail_of(&train(&mut one, 0, ITERS));
        let dir = tempfile::tempdir().unwrap();
        let ckpt = save_after_two(8, layout(2, 2, true), || model(tied), dir.path());
        let reader = CheckpointReader::open(&ckpt).unwrap();
        let meta = reader.metadata();
        assert_eq!(
            (
                meta.parallel.tensor_model_parallel_size,
                meta.parallel.pipeline_model_parallel_size,
                meta.parallel.data_parallel_size
            ),
            (2, 2, 2)
        );
        let mut files: Vec<&str> = meta
            .tensors
            .values()
            .flat_map(|t| t.shards.iter().map(|s| s.file.as_str()))
            .collect();
        files.sort_unstable();
        files.dedup();
        let count = |prefix: &str| files.iter().filter(|f| f.starts_with(prefix)).count();
        assert_eq!(
            (count("model_"), count("optim_")),
            (4, 8),
            "{label}: {files:?}"
        );
        // linear_fc1 of a tp-2 shard is two boxes (gate and up), and a distributed-optimizer
        // shard adds row cuts: more shards than ranks.
        let fc1 = &meta.tensors["model.decoder.layers.0.mlp.linear_fc1.weight"];
        assert_eq!(fc1.shards.len(), 4, "{label}: {fc1:?}");
        let exp_avg = &meta.tensors["optimizer.exp_avg.decoder.layers.0.mlp.linear_fc1.weight"];
        assert_eq!(exp_avg.global_shape, vec![256, 64]);
        assert!(exp_avg.shards.len() >= 4, "{label}");
        drop(reader);

        for (world, target, name) in [
            (1, Layout::default(), "1 rank"),
            (4, layout(4, 1, false), "tp4"),
            (4, layout(1, 4, false), "pp4"),
            (4, layout(1, 2, true), "pp2 x dp2 + distributed optimizer"),
        ] {
            let label = format!("{label} -> {name}");
            assert_resumes(&label, world, target, || model(tied), &ckpt, &tail);
        }
    }
}

/// An HF model converted to a tp 2 x pp 2 checkpoint (`convert hf-to-ckpt`) trains under
/// other layouts exactly as the model loaded from HF: weights only, iteration 0.
#[test]
fn converted_checkpoints_train_like_the_hf_model() {
    use ferrotron_checkpoint::convert::{HfToCkptOptions, hf_to_ckpt};
    for name in ["tiny-llama", "tiny-llama3"] {
        let hf = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures")
            .join(name);
        let from_hf = || common::fixture(name);
        let mut one = Trainer::new(from_hf(), dp_options(1, ITERS)).unwrap();
        let reference = train(&mut one, 0, ITERS);
        let dir = tempfile::tempdir().unwrap();
        let ckpt = dir.path().join("ckpt");
        let opts = HfToCkptOptions {
            tensor_model_parallel_size: 2,
            pipeline_model_parallel_size: 2,
            ..HfToCkptOptions::default()
        };
        hf_to_ckpt(&hf, &ckpt, &opts).unwrap();
        let ckpt = iteration_dir(&ckpt, 0);
        // The model's own weights are overwritten: start from a random model of the same shape.
        let random = || {
            let c = from_hf().config().clone();
            GptModel::init_random(c, InitConfig::default()).unwrap()
        };
        let mut t = Trainer::new(random(), dp_options(1, ITERS)).unwrap();
        let state = t.load_checkpoint(&ckpt, LoadMode::Resume).unwrap();
        assert_eq!(state.iteration, 0);
        assert_same_run(
            &format!("{name} -> 1 rank"),
            &train(&mut t, 0, ITERS),
            &reference,
        );
        let runs = run_local(2, |comm| {
            let mut t = layout(2, 1, false).trainer(comm, ITERS, random())?;
            t.load_checkpoint(&ckpt, LoadMode::Resume)?;
            Ok::<_, TrainError>(train(&mut t, 0, ITERS))
        })
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        for (r, run) in runs.iter().enumerate() {
            assert_same_run(&format!("{name} -> tp2 rank {r}"), run, &reference);
        }
    }
}

/// Every tensor of the checkpoint in `dir`, read whole.
fn all_tensors(dir: &std::path::Path) -> std::collections::BTreeMap<String, Vec<f32>> {
    let reader = CheckpointReader::open(dir).unwrap();
    reader
        .metadata()
        .tensors
        .keys()
        .map(|k| (k.clone(), reader.read(k).unwrap()))
        .collect()
}

/// bf16 weights with fp32 master weights under tp 2 x dp 2 + ZeRO-1: the sharded state
/// (weights, Adam moments, master weights) loads under one rank and under pp 2 x dp 2 and
/// saves back identical, bit for bit.
#[test]
fn bf16_optimizer_state_reshards_losslessly() {
    let bf16_model = || {
        let mut config = TransformerConfig::llama(4, 64, 128, 8, 4, 112, 64).unwrap();
        config.untie_embeddings_and_output_weights = true;
        let init = InitConfig {
            params_dtype: ferrotron_tensor::DType::BF16,
            ..InitConfig::default()
        };
        GptModel::init_random(config, init).unwrap()
    };
    let bf16 = |tp, pp, distributed| Layout {
        bf16: true,
        ..layout(tp, pp, distributed)
    };
    let dir = tempfile::tempdir().unwrap();
    let first = dir.path().join("first");
    run_local(4, |comm| {
        let mut t = bf16(2, 1, true).trainer(comm, ITERS, bf16_model())?;
        train(&mut t, 0, 2);
        t.save_checkpoint(&first, 0, serde_json::Value::Null)
            .map(|_| ())
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let want = all_tensors(&iteration_dir(&first, 2));
    assert!(want.keys().any(|k| k.starts_with("optimizer.master.")));

    let one = dir.path().join("one");
    let mut options = dp_options(1, ITERS);
    options.precision = ferrotron_optim::Precision::Bf16;
    let mut t = Trainer::new(bf16_model(), options).unwrap();
    t.load_checkpoint(&iteration_dir(&first, 2), LoadMode::Resume)
        .unwrap();
    t.save_checkpoint(&one, 0, serde_json::Value::Null).unwrap();
    assert!(all_tensors(&iteration_dir(&one, 2)) == want, "1 rank");

    let pp = dir.path().join("pp");
    run_local(4, |comm| {
        let mut t = bf16(1, 2, true).trainer(comm, ITERS, bf16_model())?;
        t.load_checkpoint(&iteration_dir(&first, 2), LoadMode::Resume)?;
        t.save_checkpoint(&pp, 0, serde_json::Value::Null)
            .map(|_| ())
    })
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(all_tensors(&iteration_dir(&pp, 2)) == want, "pp2 x dp2");
}
