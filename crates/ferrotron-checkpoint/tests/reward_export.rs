//! A reward model exported as HF `LlamaForSequenceClassification` (one label, `score.weight`)
//! loads back as one, with the same rewards.

use ferrotron_checkpoint::{HfExportOptions, HfExportSource, export_hf};
use ferrotron_model::families::load_hf_model;
use ferrotron_model::{InitConfig, Objective, OutputHead, RewardTargets, TrainBatch};
use ferrotron_tensor::DType;
use ferrotron_tensor::ops::IGNORE_INDEX;
use std::path::PathBuf;

#[test]
fn a_reward_model_round_trips_as_sequence_classification() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-llama");
    let (base, _) = load_hf_model(&dir, DType::F32).unwrap();
    let init = InitConfig {
        init_method_std: 0.5,
        ..InitConfig::default()
    };
    let model = base.with_score_head(&init).unwrap();
    let out = tempfile::tempdir().unwrap();
    let path = out.path().join("rm");
    let source = HfExportSource::from_dir(&dir).unwrap();
    let opts = HfExportOptions::default();
    let report = export_hf(&model, &source, &path, &opts).unwrap();
    assert_eq!(
        report.config["architectures"][0],
        "LlamaForSequenceClassification"
    );
    assert_eq!(report.config["id2label"]["0"], "LABEL_0");
    let (back, _) = load_hf_model(&path, DType::F32).unwrap();
    assert_eq!(back.config().output_head, OutputHead::Score);
    let tokens: Vec<u32> = (0..2 * 8).map(|i| 3 + (i * 13 % 100) as u32).collect();
    let labels: Vec<i64> = (0..16)
        .map(|i| if i % 8 < 6 { 5 } else { IGNORE_INDEX })
        .collect();
    let mut batch = TrainBatch::from_batch_major(&tokens, &labels, None, 2, 8);
    batch.objective = Objective::Reward(RewardTargets {
        center_rewards_coefficient: 0.0,
        pad_token_id: None,
        margins: vec![0.0],
    });
    assert_eq!(
        back.rewards(&batch).unwrap(),
        model.rewards(&batch).unwrap()
    );
}
