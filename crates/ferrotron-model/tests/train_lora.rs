//! LoRA adapters on the training passes: their gradients against finite differences (on
//! tiny-qwen2, whose q/k/v biases stay frozen beside the adapter), the same gradients under
//! selective and full recompute, fresh adapters that leave the model's outputs unchanged,
//! and the targets a model rejects. (PEFT parity is `ferrotron-checkpoint/tests/peft.rs`.)

mod common;
use common::{fixture, randomize_adapter_outputs};
use ferrotron_model::module::ParamRole;
use ferrotron_model::{
    GptModel, InitConfig, LoraConfig, RecomputeGranularity, RecomputeMethod, TrainBatch,
};
use std::borrow::Cow;

fn base() -> GptModel {
    fixture("tiny-qwen2")
}

fn lora() -> LoraConfig {
    lora_with(0.0)
}

fn lora_with(dropout: f32) -> LoraConfig {
    LoraConfig {
        target_modules: vec!["linear_qkv".into(), "*.layers.1.*.linear_fc2".into()],
        rank: 3,
        alpha: 6.0,
        dropout,
    }
}

/// The base with adapters whose `linear_out` is random too (a fresh one is zero, which
/// would leave `linear_in` without gradient).
fn adapted() -> GptModel {
    adapted_with(0.0)
}

/// [`adapted`] with the adapters' input dropout `dropout`.
fn adapted_with(dropout: f32) -> GptModel {
    let mut model = base()
        .with_lora(lora_with(dropout), &InitConfig::default())
        .unwrap();
    randomize_adapter_outputs(&mut model, 7);
    model
}

fn batch() -> TrainBatch {
    let (b, s) = (2, 12);
    let tokens: Vec<u32> = (0..b * s).map(|i| (3 + i * 37 % 100) as u32).collect();
    let labels: Vec<i64> = (0..b * s).map(|i| (5 + i * 53 % 100) as i64).collect();
    TrainBatch::from_batch_major(&tokens, &labels, None, b, s)
}

/// [`batch`] as a training step's: its rows keyed for dropout.
fn dropout_batch() -> TrainBatch {
    TrainBatch {
        dropout_keys: Some(vec![11, 12]),
        ..batch()
    }
}

/// (loss, gradients) of one forward/backward.
fn grads(model: &GptModel, batch: &TrainBatch) -> (f64, Vec<Vec<f32>>) {
    let mut g = model.zero_grads();
    let mut views: Vec<&mut [f32]> = g.iter_mut().map(|g| g.as_mut_slice()).collect();
    let stats = model.forward_backward(batch, &mut views, 1.0).unwrap();
    (stats.loss_sum / stats.loss_count, g)
}

#[test]
fn adapter_gradients_match_finite_differences() {
    for dropout in [0.0, 0.3] {
        adapter_gradients_match_finite_differences_with(dropout);
    }
}

/// The finite-difference check with the adapters' input dropout `dropout` (its masks are
/// the same in every pass of one batch).
fn adapter_gradients_match_finite_differences_with(dropout: f32) {
    let mut model = adapted_with(dropout);
    let batch = dropout_batch();
    let (_, analytic) = grads(&model, &batch);
    let params = model.parameters();
    let adapters: Vec<usize> = (0..params.len())
        .filter(|&i| model.layout().decls()[i].role == ParamRole::Adapter)
        .collect();
    assert_eq!(adapters.len(), 2 * 3, "qkv in both layers, fc2 in layer 1");
    let eps = 1e-2f32;
    for &pi in &adapters {
        let base = model.parameter_f32(pi).unwrap();
        let mut order: Vec<usize> = (0..base.len()).collect();
        order.sort_by(|&i, &j| analytic[pi][j].abs().total_cmp(&analytic[pi][i].abs()));
        for &idx in order.iter().take(3) {
            let mut at = |delta: f32| {
                let mut w = base.clone();
                w[idx] += delta;
                model
                    .load_parameters_with(&[pi], |_| Cow::Borrowed(&w))
                    .unwrap();
                grads(&model, &batch).0
            };
            let fd = (at(eps) - at(-eps)) / (2.0 * eps as f64);
            model
                .load_parameters_with(&[pi], |_| Cow::Borrowed(&base))
                .unwrap();
            let g = analytic[pi][idx] as f64;
            assert!(
                (fd - g).abs() <= 2e-2 * g.abs() + 1e-4,
                "{}[{idx}] (dropout {dropout}): finite difference {fd} vs analytic {g}",
                params[pi].name
            );
            assert!(
                g.abs() > 1e-4,
                "{}: a gradient worth checking",
                params[pi].name
            );
        }
    }
}

#[test]
fn recompute_keeps_adapter_gradients_bit_for_bit() {
    for dropout in [0.0, 0.3] {
        let batch = dropout_batch();
        let (loss, want) = grads(&adapted_with(dropout), &batch);
        let full = RecomputeGranularity::Full {
            method: RecomputeMethod::Uniform,
            num_layers: 1,
        };
        for r in [RecomputeGranularity::Selective, full] {
            let mut model = adapted_with(dropout);
            model.set_recompute_granularity(Some(r)).unwrap();
            let (l, got) = grads(&model, &batch);
            assert_eq!(l, loss, "{r:?} dropout {dropout}");
            assert_eq!(got, want, "{r:?} dropout {dropout}");
        }
    }
}

/// Dropout acts in a training step's pass (a batch with dropout keys) and nowhere else:
/// without keys (evaluation) the model computes what it does without dropout; other keys
/// drop other elements.
#[test]
fn dropout_acts_only_with_a_training_steps_keys() {
    let (plain, _) = grads(&adapted(), &batch());
    let model = adapted_with(0.3);
    assert_eq!(grads(&model, &batch()).0, plain, "no keys: no dropout");
    let (dropped, _) = grads(&model, &dropout_batch());
    assert!((dropped - plain).abs() > 1e-6, "{dropped} vs {plain}");
    let other = TrainBatch {
        dropout_keys: Some(vec![13, 14]),
        ..batch()
    };
    assert_ne!(grads(&model, &other).0, dropped, "other keys, other masks");
}

#[test]
fn fresh_adapters_leave_the_model_unchanged() {
    let batch = batch();
    let (want, _) = grads(&base(), &batch);
    let model = base().with_lora(lora(), &InitConfig::default()).unwrap();
    let (got, g) = grads(&model, &batch);
    assert_eq!(got, want);
    // linear_in has no gradient yet (linear_out is zero); linear_out has one.
    for (p, g) in model.parameters().iter().zip(&g) {
        if p.name.ends_with("linear_out.weight") {
            assert!(g.iter().any(|&v| v != 0.0), "{}", p.name);
        }
        assert_eq!(p.frozen, g.is_empty(), "{}", p.name);
    }
    let merged = model.merge_lora().unwrap();
    assert_eq!(merged.parameters_f32(), base().parameters_f32());
}

#[test]
fn targets_the_model_rejects_are_named() {
    let err = |l: LoraConfig| {
        base()
            .with_lora(l, &InitConfig::default())
            .unwrap_err()
            .to_string()
    };
    let none = LoraConfig {
        target_modules: vec!["*.layers.7.*".into()],
        ..lora()
    };
    assert!(err(none).contains("`*.layers.7.*` matches no linear layer"));
    let twice = adapted()
        .with_lora(lora(), &InitConfig::default())
        .unwrap_err();
    assert!(twice.to_string().contains("has LoRA adapters already"));
    assert!(base().merge_lora().is_err());
}
