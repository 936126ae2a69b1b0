//! The single-rank training loop on the tiny LLaMA fixture (2 layers, hidden 48, GQA 4/2,
//! vocab 112) with an in-memory dataset of a repeated token pattern.

use ferrotron_data::{DataLoader, Dataset, LoaderConfig};
use ferrotron_train::trainer::{TrainLog, Trainer, TrainerOptions};
use std::sync::Arc;

mod common;

use common::*;

#[test]
fn loss_falls_and_metrics_are_written() {
    let opts = TrainerOptions {
        eval_interval: 10,
        ..options(2, 4, 30)
    };
    let mut trainer = Trainer::new(tiny_model(), opts).unwrap();
    let valid = micro_batches(10_000, 4, 2);
    let before = trainer.evaluate(&valid).unwrap();
    let dataset: Arc<dyn Dataset> = Arc::new(PatternDataset { len: 1000 });
    let mut loader = DataLoader::new(dataset, &LoaderConfig::new(2, 0, 1, 0)).unwrap();
    let mut metrics = Vec::new();
    let mut lines = Vec::new();
    let mut provider = || Ok(valid.clone());
    let summary = trainer
        .train(
            &mut loader,
            Some(&mut provider),
            &mut metrics,
            &mut |l: &TrainLog| lines.push(l.clone()),
        )
        .unwrap();
    assert_eq!(summary.iterations, 30);
    assert_eq!(summary.consumed_samples, 120);
    assert!(!summary.data_exhausted);
    let after = summary.last_eval_loss.unwrap();
    assert!(
        after < 0.5 * before,
        "validation loss {before} -> {after} did not fall clearly"
    );

    let train: Vec<_> = lines
        .iter()
        .filter_map(|l| match l {
            TrainLog::Train(t) => Some(t),
            TrainLog::Valid(_) | TrainLog::Saved(_) => None,
        })
        .collect();
    assert_eq!(train.len(), 6, "one line per 5 iterations");
    assert!(train[5].lm_loss < 0.5 * train[0].lm_loss, "{train:?}");
    assert_eq!(train[5].consumed_samples, 120);
    assert!(
        train
            .iter()
            .all(|t| t.tflops > 0.0 && t.tokens_per_second > 0.0)
    );
    assert_eq!(lines.len(), 6 + 3, "validation at 10, 20, 30");

    let text = String::from_utf8(metrics).unwrap();
    let json: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(json.len(), 9);
    assert_eq!(json[0]["kind"], "train");
    assert_eq!(json[0]["iteration"], 5);
    let valid_last = json.iter().rfind(|j| j["kind"] == "valid").unwrap();
    assert_eq!(valid_last["iteration"], 30);
    assert!((valid_last["lm_loss"].as_f64().unwrap() - after).abs() < 1e-12);
}

/// The same global batch of 4 split as 1x4, 2x2 and 4x1 micro-batches gives the same
/// per-token losses and weights (per-token loss over the global batch; micro-batches carry
/// different numbers of loss tokens).
#[test]
fn gradient_accumulation_is_split_invariant() {
    let run = |mbs: usize| {
        let mut t = Trainer::new(tiny_model(), options(mbs, 4, 4)).unwrap();
        let losses: Vec<f64> = (0..4)
            .map(|it| t.train_step(&micro_batches(4 * it, 4, mbs)).unwrap().loss)
            .collect();
        let n = t.model().parameters().len();
        let params: Vec<Vec<f32>> = (0..n).map(|i| t.param(i)).collect();
        (losses, params)
    };
    let (loss4, p4) = run(4);
    for mbs in [2, 1] {
        let (loss, p) = run(mbs);
        for (a, b) in loss4.iter().zip(&loss) {
            assert!(
                (a - b).abs() <= 1e-5 * a.abs(),
                "mbs {mbs}: {loss4:?} vs {loss:?}"
            );
        }
        for (i, (a, b)) in p4.iter().zip(&p).enumerate() {
            let diff: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
            let norm: f64 = a.iter().map(|&x| (x as f64).powi(2)).sum();
            let rel = (diff / norm).sqrt();
            assert!(
                rel <= 1e-5,
                "mbs {mbs}: parameter {i} differs by {rel:e} relative"
            );
        }
    }
    assert!(loss4[3] < loss4[0]);
}

/// The forward-only validation loss equals the training forward's loss on the same batch,
/// and the model's weights follow the optimizer's buffer after a step.
#[test]
fn evaluate_matches_training_loss_and_weights_sync() {
    let mut t = Trainer::new(tiny_model(), options(2, 4, 3)).unwrap();
    let batch = micro_batches(0, 4, 2);
    let eval = t.evaluate(&batch).unwrap();
    let stats = t.train_step(&batch).unwrap();
    let first_loss = stats.loss;
    assert!(
        (eval - stats.loss).abs() <= 1e-4 * stats.loss,
        "eval {eval} vs train {}",
        stats.loss
    );
    assert_eq!(stats.iteration, 1);
    assert_eq!(stats.tokens, 4 * SEQ);
    assert!(!stats.skipped && stats.grad_norm.unwrap() > 0.0);
    // Megatron's schedule: step 0 of a warmup runs at lr 0, the next at lr·1/2.
    assert_eq!(stats.lr, 0.0);
    assert_eq!(t.lr(), 5e-3);
    let stats = t.train_step(&batch).unwrap();
    assert_eq!(stats.lr, 5e-3);
    assert_eq!(stats.loss, first_loss, "lr 0 left the weights as they were");
    assert!(
        t.evaluate(&batch).unwrap() < eval,
        "the lr 5e-3 step lowers the loss"
    );
    let n = t.model().parameters().len();
    let mut copy: Vec<Vec<f32>> = t.model().zero_grads();
    let mut views: Vec<&mut [f32]> = copy.iter_mut().map(|c| c.as_mut_slice()).collect();
    t.model().copy_parameters_to(&mut views).unwrap();
    for (i, c) in copy.iter().enumerate().take(n) {
        assert_eq!(*c, t.param(i));
    }
    // A wrong number of micro-batches is an error, not a panic.
    assert!(t.train_step(&batch[..1]).is_err());
}
