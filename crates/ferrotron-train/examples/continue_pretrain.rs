//! A short real run until `ferrotron train` exists: an HF model (default `.cache/smollm2-hf`)
//! continue-pretrained on a Megatron dataset prefix (e.g. the KJV from
//! `ferrotron preprocess-data`) for 5 iterations at seq 128, global batch 4, printing the
//! Megatron-style log lines:
//! `cargo run --release -p ferrotron-train --example continue_pretrain -- MODEL_DIR DATA_PREFIX`.

use ferrotron_data::{
    Blend, DataLoader, Dataset, GptDatasetConfig, LoaderConfig, build_gpt_datasets,
};
use ferrotron_model::families::load_hf_model;
use ferrotron_optim::LrDecayStyle;
use ferrotron_tensor::DType;
use ferrotron_train::trainer::{TrainLog, Trainer, TrainerOptions};
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn main() {
    let mut args = std::env::args().skip(1);
    let model_dir = args
        .next()
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.cache/smollm2-hf"));
    let Some(prefix) = args.next().map(PathBuf::from) else {
        eprintln!("usage: continue_pretrain MODEL_DIR DATA_PREFIX");
        std::process::exit(2);
    };
    let (model, _) = load_hf_model(&model_dir, DType::F32).unwrap();
    let (seq, mbs, gbs, iters) = (128, 2, 4, 5);
    let blend = Blend {
        prefixes: vec![prefix],
        weights: None,
    };
    let config = GptDatasetConfig::new(seq, 1234, 0);
    let [train, valid, _] =
        build_gpt_datasets(&blend, [Some(gbs * iters), Some(8), None], &config).unwrap();
    let train: Arc<dyn Dataset> = train.unwrap();
    let valid: Arc<dyn Dataset> = valid.unwrap();
    let valid_batches: Vec<_> = DataLoader::new(valid, &LoaderConfig::new(mbs, 0, 1, 0))
        .unwrap()
        .take(2)
        .collect::<Result<_, _>>()
        .unwrap();
    let opts = TrainerOptions {
        micro_batch_size: mbs,
        global_batch_size: gbs,
        train_iters: iters as u64,
        log_interval: 1,
        eval_interval: iters as u64,
        eval_iters: 1,
        lr: 3e-4,
        min_lr: 3e-5,
        lr_warmup_iters: 1,
        lr_decay_style: LrDecayStyle::Cosine,
        weight_decay: 0.1,
        adam_beta2: 0.95,
        ..TrainerOptions::default()
    };
    let mut trainer = Trainer::new(model, opts).unwrap();
    let mut loader = DataLoader::new(train, &LoaderConfig::new(mbs, 0, 1, 0)).unwrap();
    let mut metrics = Vec::new();
    let mut provider = || Ok(valid_batches.clone());
    let summary = trainer
        .train(
            &mut loader,
            Some(&mut provider),
            &mut metrics,
            &mut |l: &TrainLog| println!("{l}"),
        )
        .unwrap();
    assert_eq!(summary.iterations, iters as u64);
    assert!(summary.last_loss.is_finite());
    print!("metrics.jsonl:\n{}", String::from_utf8(metrics).unwrap());
}
