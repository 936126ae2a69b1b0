//! `GptModel::init_random` and `TransformerConfig::llama`: Megatron's init statistics per
//! parameter, determinism in the seed, bf16 storage, config errors, and a short SGD run on a
//! repeating sequence whose loss must fall far below `ln(v)`.

use ferrotron_model::{GptModel, InitConfig, ModelError, TrainBatch, TransformerConfig};
use ferrotron_tensor::DType;

/// Every parameter as (Megatron name, f32 values), in `GptModel::parameters` order.
fn params(model: &GptModel) -> Vec<(String, Vec<f32>)> {
    let infos = model.parameters();
    let mut values: Vec<Vec<f32>> = infos.iter().map(|p| vec![0f32; p.numel()]).collect();
    let mut views: Vec<&mut [f32]> = values.iter_mut().map(|v| v.as_mut_slice()).collect();
    model.copy_parameters_to(&mut views).unwrap();
    infos.into_iter().map(|p| p.name).zip(values).collect()
}

fn mean_std(x: &[f32]) -> (f64, f64) {
    let n = x.len() as f64;
    let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

/// 4 layers, GQA 4 heads / 2 groups, untied, with biases: 4096 to 16384 draws per weight.
fn stats_config() -> TransformerConfig {
    let mut c = TransformerConfig::llama(4, 64, 128, 4, 2, 256, 32).unwrap();
    c.add_qkv_bias = true;
    c.add_proj_bias = true;
    c.add_mlp_bias = true;
    c
}

#[test]
fn each_parameter_follows_megatrons_init() {
    let c = stats_config();
    let sigma = 0.02;
    let scaled = sigma / (2.0 * c.num_layers as f64).sqrt();
    let model = GptModel::init_random(c, InitConfig::default()).unwrap();
    let all = params(&model);
    // embedding, 4 × (2 norms, 4 weights, 4 biases), final norm, output layer.
    assert_eq!(all.len(), 1 + 4 * 10 + 2);
    for (name, x) in &all {
        if name.ends_with("layernorm.weight") {
            assert!(x.iter().all(|&v| v == 1.0), "{name} gain is not 1");
        } else if name.ends_with(".bias") {
            assert!(x.iter().all(|&v| v == 0.0), "{name} is not 0");
        } else {
            let want = if name.contains("linear_proj") || name.contains("linear_fc2") {
                scaled
            } else {
                sigma
            };
            let (mean, std) = mean_std(x);
            let n = x.len() as f64;
            // 5 standard errors: the mean's is σ/√n, the sample std's about σ/√(2n).
            assert!(
                mean.abs() < 5.0 * want / n.sqrt(),
                "{name}: mean {mean} (n {n})"
            );
            assert!(
                (std / want - 1.0).abs() < 5.0 / (2.0 * n).sqrt(),
                "{name}: std {std}, want {want} (n {n})"
            );
            // Normal, not merely the right std: P(|z| < σ) = 0.6827, P(|z| < 2σ) = 0.9545.
            for (k, p) in [(1.0, 0.6827), (2.0, 0.9545)] {
                let inside = x.iter().filter(|&&v| (v as f64).abs() < k * want).count() as f64;
                let se = (p * (1.0 - p) / n).sqrt();
                assert!(
                    (inside / n - p).abs() < 5.0 * se,
                    "{name}: {} inside {k}σ, want {p}",
                    inside / n
                );
            }
        }
    }
    // Every weight is its own draw (no two share a stream).
    let weights: Vec<&Vec<f32>> = all
        .iter()
        .filter(|(n, _)| n.ends_with(".weight") && !n.contains("layernorm"))
        .map(|(_, x)| x)
        .collect();
    for (i, a) in weights.iter().enumerate() {
        for b in &weights[i + 1..] {
            assert_ne!(a[..16], b[..16]);
        }
    }
}

#[test]
fn same_seed_same_model_other_seed_other_model() {
    let c = stats_config();
    let init = |seed| {
        let cfg = InitConfig {
            seed,
            ..InitConfig::default()
        };
        params(&GptModel::init_random(c.clone(), cfg).unwrap())
    };
    let (a, b, other) = (init(7), init(7), init(8));
    assert_eq!(a, b);
    for ((name, x), (_, y)) in a.iter().zip(&other) {
        if name.ends_with(".bias") || name.contains("layernorm") {
            assert_eq!(x, y, "{name}");
        } else {
            let same = x.iter().zip(y).filter(|(p, q)| p == q).count();
            assert!(same * 100 < x.len(), "{name}: {same} equal values");
        }
    }
}

#[test]
fn a_parameter_does_not_depend_on_the_others() {
    // Tying the output layer and adding biases leave every shared parameter unchanged.
    let untied_biased =
        params(&GptModel::init_random(stats_config(), InitConfig::default()).unwrap());
    let mut c = TransformerConfig::llama(4, 64, 128, 4, 2, 256, 32).unwrap();
    c.untie_embeddings_and_output_weights = false;
    let tied = params(&GptModel::init_random(c, InitConfig::default()).unwrap());
    assert_eq!(tied.len(), 1 + 4 * 6 + 1);
    for (name, x) in &tied {
        let (_, y) = untied_biased.iter().find(|(n, _)| n == name).unwrap();
        assert_eq!(x, y, "{name}");
    }
}

#[test]
fn bf16_storage_rounds_the_f32_draws() {
    let c = TransformerConfig::llama(2, 32, 64, 4, 4, 64, 16).unwrap();
    let f32_model = GptModel::init_random(c.clone(), InitConfig::default()).unwrap();
    let bf16_init = InitConfig {
        params_dtype: DType::BF16,
        ..InitConfig::default()
    };
    let bf16_model = GptModel::init_random(c, bf16_init).unwrap();
    let layout = bf16_model.layout();
    let dtype = |id| bf16_model.param(id).dtype();
    assert_eq!(dtype(layout.embedding.unwrap()), DType::BF16);
    let fc2 = layout.layers[1].mlp.linears()[1].weight;
    assert_eq!(dtype(fc2), DType::BF16);
    assert_eq!(dtype(layout.output_layer.unwrap()), DType::BF16);
    let norm = layout.layers[1]
        .pre_mlp_layernorm
        .and_then(|n| n.weight)
        .unwrap();
    // One dtype for the whole table: norm gains too (Megatron's bf16 params).
    assert_eq!(dtype(norm), DType::BF16);
    for ((name, x), (_, y)) in params(&f32_model).iter().zip(&params(&bf16_model)) {
        let rounded: Vec<f32> = x
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        assert_eq!(&rounded, y, "{name}");
    }
}

#[test]
fn llama_config_fills_the_plain_defaults() {
    let c = TransformerConfig::llama(4, 256, 688, 8, 4, 1000, 512).unwrap();
    assert_eq!(c.kv_channels, 32);
    assert_eq!(c.rotary_base, 10000.0);
    assert_eq!(c.layernorm_epsilon, 1e-5);
    assert!(c.untie_embeddings_and_output_weights);
    assert!(!c.add_qkv_bias && !c.add_proj_bias && !c.add_mlp_bias);
    assert_eq!(c.sliding_window, None);
    let model = GptModel::init_random(c.clone(), InitConfig::default()).unwrap();
    let total: usize = model.parameters().iter().map(|p| p.numel()).sum();
    assert_eq!(total, c.num_parameters());
}

fn field_of(err: ModelError) -> String {
    match err {
        ModelError::ConfigField { field, .. } => field,
        other => panic!("expected a config field error, got {other}"),
    }
}

#[test]
fn bad_dimensions_and_std_name_the_field() {
    let bad = |r: ferrotron_model::Result<TransformerConfig>| field_of(r.unwrap_err());
    assert_eq!(
        bad(TransformerConfig::llama(2, 30, 64, 4, 4, 64, 16)),
        "hidden_size"
    );
    assert_eq!(
        bad(TransformerConfig::llama(2, 32, 64, 0, 1, 64, 16)),
        "num_attention_heads"
    );
    assert_eq!(
        bad(TransformerConfig::llama(2, 32, 64, 4, 3, 64, 16)),
        "num_query_groups"
    );
    assert_eq!(
        bad(TransformerConfig::llama(0, 32, 64, 4, 4, 64, 16)),
        "num_layers"
    );
    assert_eq!(
        bad(TransformerConfig::llama(2, 32, 0, 4, 4, 64, 16)),
        "ffn_hidden_size"
    );
    assert_eq!(
        bad(TransformerConfig::llama(2, 32, 64, 4, 4, 0, 16)),
        "vocab_size"
    );
    // Head dim 36 / 4 = 9 is odd: no rotary embedding.
    assert_eq!(
        bad(TransformerConfig::llama(2, 36, 64, 4, 4, 64, 16)),
        "kv_channels"
    );
    let c = TransformerConfig::llama(2, 32, 64, 4, 4, 64, 16).unwrap();
    for std in [0.0, -0.02, f32::NAN, f32::INFINITY] {
        let init = InitConfig {
            init_method_std: std,
            ..InitConfig::default()
        };
        let err = GptModel::init_random(c.clone(), init).unwrap_err();
        assert_eq!(field_of(err), "init_method_std", "std {std}");
    }
}

#[test]
fn sgd_from_scratch_learns_a_repeating_sequence() {
    // v = 32, a period-8 sequence: the next token is a function of the current one, so the
    // loss can approach 0; at init it is ln(32) ≈ 3.47.
    let c = TransformerConfig::llama(2, 32, 64, 4, 2, 32, 64).unwrap();
    let mut model = GptModel::init_random(c, InitConfig::default()).unwrap();
    let (b, s) = (2, 32);
    let period = [3u32, 17, 5, 29, 11, 0, 23, 8];
    let stream: Vec<u32> = (0..b * s + 1 + 4)
        .map(|i| period[i % period.len()])
        .collect();
    // Sequence j starts 4·j tokens in; labels are the next tokens.
    let mut tokens = Vec::new();
    let mut labels = Vec::new();
    for j in 0..b {
        tokens.extend_from_slice(&stream[4 * j..4 * j + s]);
        labels.extend(stream[4 * j + 1..4 * j + s + 1].iter().map(|&t| t as i64));
    }
    let batch = TrainBatch::from_batch_major(&tokens, &labels, None, b, s);
    let infos = model.parameters();
    let mut weights: Vec<Vec<f32>> = infos.iter().map(|p| vec![0f32; p.numel()]).collect();
    let mut views: Vec<&mut [f32]> = weights.iter_mut().map(|w| w.as_mut_slice()).collect();
    model.copy_parameters_to(&mut views).unwrap();
    let lr = 0.5;
    let mut losses = Vec::new();
    for _ in 0..30 {
        let mut grads: Vec<Vec<f32>> = infos.iter().map(|p| vec![0f32; p.numel()]).collect();
        let mut gviews: Vec<&mut [f32]> = grads.iter_mut().map(|g| g.as_mut_slice()).collect();
        losses.push(
            model
                .forward_backward(&batch, &mut gviews, 1.0)
                .unwrap()
                .loss,
        );
        for (w, g) in weights.iter_mut().zip(&grads) {
            for (wi, gi) in w.iter_mut().zip(g) {
                *wi -= lr * gi;
            }
        }
        let src: Vec<&[f32]> = weights.iter().map(|w| w.as_slice()).collect();
        model.load_parameters_from(&src).unwrap();
    }
    // At init the logits are about N(0, σ²·h) = N(0, 0.11²): the loss is ln(v) up to the
    // sampling spread of the 8 distinct (token, next) pairs (about ±0.05 across seeds).
    let ln_v = (32f32).ln();
    assert!((losses[0] - ln_v).abs() < 0.3, "initial loss {}", losses[0]);
    let last = *losses.last().unwrap();
    assert!(last < 0.1, "loss after 30 SGD steps: {losses:?}");
}
