//! A reward model (`OutputHead::Score`, `GptModel::with_score_head`) against HF's
//! `LlamaForSequenceClassification` and TRL's `RewardTrainer` loss
//! (`tools/make_reward_fixture.py`: tiny-llama, two right-padded pairs, center coefficient
//! 0.01): rewards at the last real tokens, the loss, and the gradients of the score head, the
//! final norm, the embedding and a layer weight, also with TRL's per-pair `margin`; under LoRA
//! the head still trains; with the pad token also the end token (SmolLM2's `<|im_end|>`), the
//! reward is read where HF reads it, after the last end token.

use ferrotron_model::families::load_hf_model;
use ferrotron_model::{
    GptModel, InitConfig, LoraConfig, Objective, OutputHead, RewardTargets, TrainBatch,
};
use ferrotron_tensor::DType;
use ferrotron_tensor::ops::IGNORE_INDEX;
use safetensors::SafeTensors;
use std::borrow::Cow;
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

struct Fixture {
    bytes: Vec<u8>,
}

impl Fixture {
    fn f32s(&self, name: &str) -> Vec<f32> {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st.tensor(name).unwrap_or_else(|_| panic!("{name}"));
        t.data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    fn i64s(&self, name: &str) -> Vec<i64> {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st.tensor(name).unwrap();
        t.data()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }
}

/// A reward objective without centering or margins over `pairs` pairs, reading rewards before
/// `pad`.
fn reward(pad: Option<u32>, pairs: usize) -> Objective {
    Objective::Reward(RewardTargets {
        center_rewards_coefficient: 0.0,
        pad_token_id: pad,
        margins: vec![0.0; pairs],
    })
}

/// The fixture's model (score weights set) and its pairs as a reward batch.
fn setup() -> (Fixture, GptModel, TrainBatch) {
    let f = Fixture {
        bytes: std::fs::read(fixtures().join("reward/tiny-llama.safetensors")).unwrap(),
    };
    let (base, _) = load_hf_model(&fixtures().join("tiny-llama"), DType::F32).unwrap();
    let mut model = base.with_score_head(&InitConfig::default()).unwrap();
    assert_eq!(model.config().output_head, OutputHead::Score);
    let score = model
        .parameters()
        .iter()
        .position(|p| p.name == "score.weight")
        .unwrap();
    let w = f.f32s("score.weight");
    model
        .load_parameters_with(&[score], |_| Cow::Borrowed(&w))
        .unwrap();
    let (ids, lengths) = (f.i64s("input_ids"), f.i64s("lengths"));
    let s = 16;
    let mut labels = vec![IGNORE_INDEX; 4 * s];
    for (j, &n) in lengths.iter().enumerate() {
        for t in 0..n as usize - 1 {
            labels[j * s + t] = ids[j * s + t + 1];
        }
    }
    let tokens: Vec<u32> = ids.iter().map(|&t| t as u32).collect();
    let mut batch = TrainBatch::from_batch_major(&tokens, &labels, None, 4, s);
    // The fixture's model pads with id 0 (its config.pad_token_id).
    batch.objective = Objective::Reward(RewardTargets {
        center_rewards_coefficient: 0.01,
        pad_token_id: Some(0),
        margins: vec![0.0; 2],
    });
    (f, model, batch)
}

/// Our gradients of the fixture's four parameters against its `{prefix}.<HF name>` tensors.
fn assert_grads_match(f: &Fixture, model: &GptModel, grads: &[Vec<f32>], prefix: &str) {
    let ours = |name: &str| {
        let i = model
            .parameters()
            .iter()
            .position(|p| p.name == name)
            .unwrap();
        grads[i].clone()
    };
    for (mg, hf) in [
        ("score.weight", "score.weight"),
        ("decoder.final_layernorm.weight", "model.norm.weight"),
        (
            "embedding.word_embeddings.weight",
            "model.embed_tokens.weight",
        ),
        (
            "decoder.layers.1.mlp.linear_fc2.weight",
            "model.layers.1.mlp.down_proj.weight",
        ),
    ] {
        let (got, want) = (ours(mg), f.f32s(&format!("{prefix}.{hf}")));
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            scale > 0.0 && d <= 1e-4 * scale,
            "{prefix} {mg}: {d} (max {scale})"
        );
    }
}

/// TRL's `margin` column: `−logσ(r_c − r_r − m)`.
#[test]
fn margins_shift_the_loss_as_trls() {
    let (f, model, mut batch) = setup();
    let margins: Vec<f64> = f.f32s("margins").iter().map(|&m| f64::from(m)).collect();
    if let Objective::Reward(t) = &mut batch.objective {
        t.margins = margins;
    }
    let mut grads = model.zero_grads();
    let mut views: Vec<&mut [f32]> = grads.iter_mut().map(|g| g.as_mut_slice()).collect();
    let stats = model.forward_backward(&batch, &mut views, 1.0).unwrap();
    let want = f.f32s("loss_margin")[0];
    assert!(
        (stats.loss - want).abs() < 1e-5,
        "loss {} vs TRL {want}",
        stats.loss
    );
    assert!(
        (want - f.f32s("loss")[0]).abs() > 1e-2,
        "the margins change nothing"
    );
    assert_grads_match(&f, &model, &grads, "grad_margin");
}

#[test]
fn rewards_loss_and_gradients_match_hf_and_trl() {
    let (f, model, batch) = setup();
    let rewards = model.rewards(&batch).unwrap();
    for (got, want) in rewards.iter().zip(f.f32s("rewards")) {
        assert!(
            (got - want as f64).abs() < 1e-4,
            "{rewards:?} vs {:?}",
            f.f32s("rewards")
        );
    }
    let mut grads = model.zero_grads();
    let mut views: Vec<&mut [f32]> = grads.iter_mut().map(|g| g.as_mut_slice()).collect();
    let stats = model.forward_backward(&batch, &mut views, 1.0).unwrap();
    let want = f.f32s("loss")[0];
    assert!(
        (stats.loss - want).abs() < 1e-5,
        "loss {} vs TRL {want}",
        stats.loss
    );
    let pairs = stats.dpo.unwrap();
    assert_eq!(
        pairs.accuracies, 1.0,
        "pair 1 prefers its chosen row, pair 0 not"
    );
    assert_grads_match(&f, &model, &grads, "grad");
}

#[test]
fn the_score_head_trains_under_lora() {
    let (_, model, batch) = setup();
    let lora = LoraConfig {
        rank: 4,
        ..LoraConfig::default()
    };
    let model = model.with_lora(lora, &InitConfig::default()).unwrap();
    let grads = {
        let mut g = model.zero_grads();
        let mut views: Vec<&mut [f32]> = g.iter_mut().map(|g| g.as_mut_slice()).collect();
        model.forward_backward(&batch, &mut views, 1.0).unwrap();
        g
    };
    for (p, g) in model.parameters().iter().zip(&grads) {
        let trains = p.name.contains(".adapter.") || p.name == "score.weight";
        assert_eq!(!p.frozen, trains, "{}", p.name);
        assert_eq!(g.is_empty(), !trains, "{}", p.name);
    }
    let lm = load_hf_model(&fixtures().join("tiny-llama"), DType::F32)
        .unwrap()
        .0;
    let mut b = batch.clone();
    b.objective = reward(Some(0), 2);
    assert!(
        lm.rewards(&b)
            .unwrap_err()
            .to_string()
            .contains("score head")
    );
}

/// HF's rule (`GenericForSequenceClassification`): the last token other than the pad id.
/// When the pad id is also the end-of-turn token, a chat row `... <end> \n <pad> <pad>` is
/// read at `\n`; a row of padding only at position 0; without a pad id at the last position.
#[test]
fn the_reward_token_is_hfs_last_non_pad_token() {
    let (_, model, _) = setup();
    let (end, newline, s) = (2u32, 13u32, 8);
    let rows: [Vec<u32>; 2] = [vec![5, 6, 7, end, newline, end, end, end], vec![end; 8]];
    let tokens: Vec<u32> = rows.concat();
    let labels = vec![IGNORE_INDEX; 2 * s];
    let batch = TrainBatch::from_batch_major(&tokens, &labels, None, 2, s);
    let with_pad = |pad| {
        let mut b = batch.clone();
        b.objective = reward(pad, 1);
        model.rewards(&b).unwrap()
    };
    // The score at a position: the reward of a row cut right after it, read at its end.
    let at = |row: &[u32], t: usize| {
        let mut cut = row[..=t].to_vec();
        cut.resize(s, 0);
        let mut b = TrainBatch::from_batch_major(&cut, &labels[..s], None, 1, s);
        b.objective = reward(Some(0), 0);
        model.rewards(&b).unwrap()[0]
    };
    let close = |a: f64, b: f64, what: &str| assert!((a - b).abs() < 1e-5, "{what}: {a} vs {b}");
    let got = with_pad(Some(end));
    close(
        got[0],
        at(&rows[0], 4),
        "read at the newline after the end token",
    );
    close(got[1], at(&rows[1], 0), "a row of padding only: position 0");
    assert!(
        (got[0] - at(&rows[0], 3)).abs() > 1e-4,
        "the end token scores the same"
    );
    close(
        with_pad(None)[0],
        at(&rows[0], 7),
        "no pad id: the last position",
    );
}
