//! Checkpoints of the training loop on the tiny LLaMA fixture: a run of N+M iterations and a
//! run of N, save, resume, M more give bit-identical losses and weights; `--finetune` loads
//! weights only; mismatching models are refused with the names; keep-last pruning.

use ferrotron_checkpoint::dist::{iteration_dir, list_checkpoints, read_tracker};
use ferrotron_data::{DataLoader, Dataset, DatasetError, GptSample, LoaderConfig};
use ferrotron_model::GptModel;
use ferrotron_model::families::load_hf_model;
use ferrotron_optim::LrDecayStyle;
use ferrotron_tensor::DType;
use ferrotron_train::trainer::{LoadMode, SavePlan, TrainLog, Trainer, TrainerOptions};
use std::path::Path;
use std::sync::Arc;

const SEQ: usize = 16;

fn model(name: &str) -> GptModel {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name);
    load_hf_model(&dir, DType::F32).expect("fixture").0
}

/// Sample `k`: a pseudo-random token stream seeded by `k` (vocab 112).
struct Stream;

impl Dataset for Stream {
    fn len(&self) -> usize {
        1 << 20
    }

    fn get(&self, k: usize) -> Result<GptSample, DatasetError> {
        let text: Vec<u32> = (0..=SEQ)
            .map(|i| ((k * 7919 + i * 104_729) % 97) as u32 + 3)
            .collect();
        Ok(GptSample {
            tokens: text[..SEQ].to_vec(),
            labels: text[1..].to_vec(),
            loss_mask: vec![1.0; SEQ],
            position_ids: (0..SEQ as u32).collect(),
            segment_ids: vec![0; SEQ],
            margin: 0.0,
        })
    }
}

fn options(iters: u64) -> TrainerOptions {
    TrainerOptions {
        micro_batch_size: 2,
        global_batch_size: 4,
        train_iters: iters,
        log_interval: 1,
        eval_interval: 0,
        lr: 5e-3,
        min_lr: 5e-4,
        lr_warmup_iters: 2,
        lr_decay_iters: Some(8),
        lr_decay_style: LrDecayStyle::Cosine,
        ..TrainerOptions::default()
    }
}

/// Trains `trainer` until `options.train_iters`, reading data after `consumed` samples;
/// returns the loss of every iteration.
fn run(trainer: &mut Trainer, consumed: u64) -> Vec<f64> {
    let mut loader = DataLoader::new(
        Arc::new(Stream) as Arc<dyn Dataset>,
        &LoaderConfig::new(2, 0, 1, consumed as usize),
    )
    .unwrap();
    let mut losses = Vec::new();
    let mut sink = Vec::new();
    trainer
        .train(&mut loader, None, &mut sink, &mut |l: &TrainLog| {
            if let TrainLog::Train(line) = l {
                losses.push(line.lm_loss);
            }
        })
        .unwrap();
    losses
}

fn params(t: &Trainer) -> Vec<Vec<f32>> {
    (0..t.model().parameters().len())
        .map(|i| t.param(i))
        .collect()
}

fn plan(dir: &Path, interval: Option<u64>, keep_last: usize) -> Option<SavePlan> {
    Some(SavePlan {
        dir: dir.to_path_buf(),
        interval,
        keep_last,
        extra: serde_json::json!({"run": "test"}),
        files: Vec::new(),
    })
}

#[test]
fn resume_continues_bit_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let mut full = Trainer::new(model("tiny-llama"), options(7)).unwrap();
    let want = run(&mut full, 0);

    let mut first = Trainer::new(model("tiny-llama"), options(3)).unwrap();
    first.set_save_plan(plan(tmp.path(), Some(2), 0));
    let head = run(&mut first, 0);
    assert_eq!(read_tracker(tmp.path()).unwrap(), Some(3));
    assert_eq!(list_checkpoints(tmp.path()).unwrap(), vec![2, 3]);
    drop(first);

    let mut resumed = Trainer::new(model("tiny-llama"), options(7)).unwrap();
    let state = resumed
        .load_checkpoint(&iteration_dir(tmp.path(), 3), LoadMode::Resume)
        .unwrap();
    assert_eq!((state.iteration, state.consumed_samples), (3, 12));
    assert_eq!(resumed.iteration(), 3);
    assert_eq!(resumed.lr(), full_lr_after(3));
    let tail = run(&mut resumed, state.consumed_samples);
    let got: Vec<f64> = head.into_iter().chain(tail).collect();
    assert_eq!(got, want, "losses differ after resume");
    assert!(
        params(&resumed) == params(&full),
        "weights differ after resume"
    );
}

/// The scheduled lr after `n` steps of `options(7)`.
fn full_lr_after(n: u64) -> f64 {
    let mut t = Trainer::new(model("tiny-llama"), options(n)).unwrap();
    run(&mut t, 0);
    t.lr()
}

#[test]
fn finetune_loads_weights_only_and_bad_models_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let mut first = Trainer::new(model("tiny-llama"), options(2)).unwrap();
    first.set_save_plan(plan(tmp.path(), None, 0));
    run(&mut first, 0);
    let dir = iteration_dir(tmp.path(), 2);

    let mut ft = Trainer::new(model("tiny-llama"), options(2)).unwrap();
    let state = ft.load_checkpoint(&dir, LoadMode::Finetune).unwrap();
    assert_eq!(state.iteration, 2);
    assert_eq!((ft.iteration(), ft.consumed_samples()), (0, 0));
    assert!(params(&ft) == params(&first));
    // The model itself carries the loaded weights: same loss as the saved trainer's model.
    let probe = vec![Stream.get(12345).unwrap(), Stream.get(777).unwrap()];
    let mb = ferrotron_data::MicroBatch::collate(probe, vec![0, 1], 2).unwrap();
    assert_eq!(
        ft.evaluate(std::slice::from_ref(&mb)).unwrap(),
        first.evaluate(std::slice::from_ref(&mb)).unwrap()
    );

    // Another architecture: every mismatch is listed.
    let mut other = Trainer::new(model("tiny-qwen2"), options(2)).unwrap();
    let err = other
        .load_checkpoint(&dir, LoadMode::Resume)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("metadata.json"), "{err}");
    assert!(err.contains("missing tensor model."), "{err}");
    assert!(
        err.contains("linear_qkv.bias") || err.contains("has shape"),
        "{err}"
    );

    // A different schedule on resume is Megatron's assertion error.
    let mut changed = options(2);
    changed.lr = 1.0;
    let mut t = Trainer::new(model("tiny-llama"), changed).unwrap();
    let err = t
        .load_checkpoint(&dir, LoadMode::Resume)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("lr") || err.contains("max_lr"), "{err}");
}

#[test]
fn keep_last_prunes_old_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(model("tiny-llama"), options(5)).unwrap();
    t.set_save_plan(plan(tmp.path(), Some(1), 2));
    let mut saved = Vec::new();
    let mut loader = DataLoader::new(
        Arc::new(Stream) as Arc<dyn Dataset>,
        &LoaderConfig::new(2, 0, 1, 0),
    )
    .unwrap();
    let mut sink = Vec::new();
    t.train(&mut loader, None, &mut sink, &mut |l: &TrainLog| {
        if let TrainLog::Saved(s) = l {
            saved.push(s.iteration);
        }
    })
    .unwrap();
    assert_eq!(saved, vec![1, 2, 3, 4, 5]);
    assert_eq!(list_checkpoints(tmp.path()).unwrap(), vec![4, 5]);
    assert_eq!(read_tracker(tmp.path()).unwrap(), Some(5));
    let jsonl = String::from_utf8(sink).unwrap();
    assert_eq!(jsonl.matches("\"kind\":\"checkpoint\"").count(), 5);
}
