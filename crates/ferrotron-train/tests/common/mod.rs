//! Shared by the trainer tests: the tiny LLaMA fixture (2 layers, hidden 48, GQA 4/2,
//! vocab 112), an in-memory dataset of a repeated token pattern, and run options.
#![allow(dead_code)] // each test binary uses a subset

pub mod layouts;

use ferrotron_data::{Dataset, DatasetError, GptSample, MicroBatch};
use ferrotron_model::GptModel;
use ferrotron_model::families::load_hf_model;
use ferrotron_optim::LrDecayStyle;
use ferrotron_tensor::DType;
use ferrotron_train::trainer::TrainerOptions;
use std::path::Path;

pub const SEQ: usize = 16;
const PATTERN: [u32; 10] = [5, 17, 42, 8, 99, 23, 61, 17, 3, 70];

pub fn tiny_model() -> GptModel {
    fixture("tiny-llama")
}

/// The committed fixture `name` (f32 weights).
pub fn fixture(name: &str) -> GptModel {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name);
    load_hf_model(&dir, DType::F32)
        .unwrap_or_else(|e| panic!("fixture {name}: {e}"))
        .0
}

/// `model` with fresh LoRA adapters (rank 4, alpha 8, NeMo's four targets, seeded).
pub fn with_fresh_lora(model: GptModel) -> GptModel {
    let lora = ferrotron_model::LoraConfig {
        rank: 4,
        alpha: 8.0,
        ..ferrotron_model::LoraConfig::default()
    };
    model
        .with_lora(lora, &ferrotron_model::InitConfig::default())
        .unwrap()
}

/// Sample `k`: the pattern repeated, starting at offset `k`; the loss mask drops the first
/// `2·(k mod 4)` positions so micro-batches carry different numbers of loss tokens.
pub struct PatternDataset {
    pub len: usize,
}

impl Dataset for PatternDataset {
    fn len(&self) -> usize {
        self.len
    }

    fn get(&self, k: usize) -> Result<GptSample, DatasetError> {
        let text: Vec<u32> = (0..=SEQ)
            .map(|i| PATTERN[(k + i) % PATTERN.len()])
            .collect();
        Ok(GptSample {
            tokens: text[..SEQ].to_vec(),
            labels: text[1..].to_vec(),
            loss_mask: (0..SEQ)
                .map(|i| if i < 2 * (k % 4) { 0.0 } else { 1.0 })
                .collect(),
            position_ids: (0..SEQ as u32).collect(),
            segment_ids: vec![0; SEQ],
            margin: 0.0,
        })
    }
}

/// Samples `first..first + n` as micro-batches of `mbs` rows.
pub fn micro_batches(first: usize, n: usize, mbs: usize) -> Vec<MicroBatch> {
    let ds = PatternDataset { len: usize::MAX };
    (first..first + n)
        .step_by(mbs)
        .map(|start| {
            let idx: Vec<usize> = (start..start + mbs).collect();
            let samples = idx.iter().map(|&i| ds.get(i).unwrap()).collect();
            MicroBatch::collate(samples, idx, start + mbs).unwrap()
        })
        .collect()
}

pub fn options(mbs: usize, gbs: usize, iters: u64) -> TrainerOptions {
    TrainerOptions {
        micro_batch_size: mbs,
        global_batch_size: gbs,
        train_iters: iters,
        log_interval: 5,
        eval_interval: 0,
        eval_iters: 1,
        lr: 1e-2,
        min_lr: 1e-3,
        lr_warmup_iters: 2,
        lr_decay_iters: None,
        lr_decay_style: LrDecayStyle::Cosine,
        weight_decay: 0.01,
        clip_grad: 1.0,
        ..TrainerOptions::default()
    }
}
