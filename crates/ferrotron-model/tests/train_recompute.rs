//! Activation recompute (`TransformerConfig::recompute_granularity`): every mode gives the loss
//! and gradients of keeping everything bit for bit, on the tiny fixtures and on a deeper model
//! (layer counts the chunking does not divide); bad settings are errors naming the field; and
//! the saved-activation memory drops as Megatron's modes promise.

use ferrotron_model::families::load_hf_model;
use ferrotron_model::{GptModel, RecomputeGranularity, RecomputeMethod, TrainBatch};
use ferrotron_tensor::DType;
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

fn full(method: RecomputeMethod, num_layers: usize) -> Option<RecomputeGranularity> {
    Some(RecomputeGranularity::Full { method, num_layers })
}

/// Every recompute setting valid for `num_layers` layers.
fn all_modes(num_layers: usize) -> Vec<Option<RecomputeGranularity>> {
    let mut modes = vec![None, Some(RecomputeGranularity::Selective)];
    for n in 1..=num_layers {
        modes.push(full(RecomputeMethod::Uniform, n));
        modes.push(full(RecomputeMethod::Block, n));
    }
    modes
}

/// A deterministic batch of `b` sequences of `s` tokens with a loss mask, an ignored label and
/// positions and attention restarting mid-sequence (two packed documents).
fn batch(model: &GptModel, b: usize, s: usize) -> TrainBatch {
    let v = model.config().vocab_size;
    let tokens: Vec<u32> = (0..b * s).map(|i| ((i * 37 + 11) % v) as u32).collect();
    let mut labels: Vec<i64> = (0..b * s).map(|i| ((i * 53 + 5) % v) as i64).collect();
    labels[s - 1] = -100;
    let mask: Vec<f32> = (0..b * s).map(|i| ((i * 7) % 4) as f32 * 0.5).collect();
    let mut batch = TrainBatch::from_batch_major(&tokens, &labels, Some(&mask), b, s);
    batch.position_ids = Some(
        (0..s)
            .flat_map(|t| std::iter::repeat_n(t % (s / 2 + 1), b))
            .collect(),
    );
    // The same two documents for attention (Megatron's reset_attention_mask).
    let segments: Vec<u32> = (0..b * s).map(|i| ((i % s) / (s / 2 + 1)) as u32).collect();
    batch.set_segments(&segments);
    assert!(batch.document_starts.is_some());
    batch
}

/// Loss bits and gradients of one `forward_backward` under `recompute`.
fn run(
    model: &mut GptModel,
    batch: &TrainBatch,
    recompute: Option<RecomputeGranularity>,
) -> (u32, Vec<Vec<f32>>) {
    model.set_recompute_granularity(recompute).unwrap();
    let mut grads: Vec<Vec<f32>> = model.zero_grads();
    let mut views: Vec<&mut [f32]> = grads.iter_mut().map(|g| g.as_mut_slice()).collect();
    let stats = model.forward_backward(batch, &mut views, 2.0).unwrap();
    (stats.loss.to_bits(), grads)
}

/// Asserts every mode reproduces the no-recompute loss and gradients bit for bit.
fn assert_bit_identical(model: &mut GptModel, batch: &TrainBatch) {
    let (loss, grads) = run(model, batch, None);
    let names: Vec<String> = model.parameters().into_iter().map(|p| p.name).collect();
    for mode in all_modes(model.config().num_layers) {
        let (l, g) = run(model, batch, mode);
        assert_eq!(l, loss, "{mode:?}: loss");
        for ((name, want), got) in names.iter().zip(&grads).zip(&g) {
            let same = want
                .iter()
                .zip(got)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{mode:?}: gradient of {name} differs");
        }
    }
}

/// The tiny-llama fixture stretched to `num_layers` layers, each made distinct by a
/// deterministic perturbation of its weights.
fn deep_llama(num_layers: usize) -> GptModel {
    let (two, _) = load_hf_model(&fixture("tiny-llama"), DType::F32).unwrap();
    let mut config = two.config().clone();
    config.num_layers = num_layers;
    // Layer i of the deep model starts as layer i % 2 of the fixture.
    let by_name: std::collections::HashMap<String, usize> = two
        .parameters()
        .into_iter()
        .enumerate()
        .map(|(i, p)| (p.name, i))
        .collect();
    let tensors = ferrotron_model::families::param_mapping(&config, config.vocab_size)
        .unwrap()
        .into_iter()
        .map(|d| {
            let name = match d.layer {
                Some(l) => {
                    d.name
                        .replacen(&format!("layers.{l}."), &format!("layers.{}.", l % 2), 1)
                }
                None => d.name.clone(),
            };
            let values = two.parameter_f32(by_name[&name]).unwrap();
            ferrotron_tensor::Tensor::from_f32(&d.shape, values).unwrap()
        })
        .collect();
    let mut model = GptModel::new(config, tensors).unwrap();
    let mut params: Vec<Vec<f32>> = model.parameters_f32();
    for (pi, p) in params.iter_mut().enumerate() {
        for (i, x) in p.iter_mut().enumerate() {
            *x *= 1.0 + 0.05 * (((pi * 31 + i * 17) % 13) as f32 / 6.0 - 1.0);
        }
    }
    let srcs: Vec<&[f32]> = params.iter().map(|p| p.as_slice()).collect();
    model.load_parameters_from(&srcs).unwrap();
    model
}

#[test]
fn every_mode_is_bit_identical_on_the_fixtures() {
    for name in ["tiny-llama", "tiny-llama3", "tiny-qwen2", "tiny-mistral"] {
        let (mut model, _) = load_hf_model(&fixture(name), DType::F32).unwrap();
        // Longer than tiny-mistral's sliding window, two sequences.
        let batch = batch(&model, 2, 13);
        assert_bit_identical(&mut model, &batch);
    }
}

#[test]
fn every_mode_is_bit_identical_on_a_deeper_model() {
    // 5 layers: uniform 2 and 3 leave a short last chunk, block 2 keeps a 3-layer tail.
    let mut model = deep_llama(5);
    let batch = batch(&model, 2, 128);
    assert_bit_identical(&mut model, &batch);
}

#[test]
fn bf16_storage_recompute_is_bit_identical() {
    let (mut model, _) = load_hf_model(&fixture("tiny-llama3"), DType::BF16).unwrap();
    let batch = batch(&model, 2, 9);
    assert_bit_identical(&mut model, &batch);
}

#[test]
fn bad_recompute_num_layers_is_an_error_and_leaves_the_model_alone() {
    let (mut model, _) = load_hf_model(&fixture("tiny-llama"), DType::F32).unwrap();
    let before = model.config().clone();
    for method in [RecomputeMethod::Uniform, RecomputeMethod::Block] {
        for n in [0, 3] {
            let err = model
                .set_recompute_granularity(full(method, n))
                .unwrap_err()
                .to_string();
            assert_eq!(
                err,
                format!(
                    "config field `recompute_num_layers`: {n} is not between 1 and num_layers (2)"
                )
            );
            assert_eq!(model.config(), &before);
            let mut bad = before.clone();
            bad.recompute_granularity = full(method, n);
            let err = bad.activation_memory(1, 5).unwrap_err();
            assert!(err.to_string().contains("recompute_num_layers"));
        }
    }
}

#[test]
fn recompute_saves_activation_memory() {
    let mut config = deep_llama(5).config().clone();
    let mut peak = |mode| {
        config.recompute_granularity = mode;
        config.activation_memory(2, 64).unwrap().peak_bytes
    };
    let none = peak(None);
    let selective = peak(Some(RecomputeGranularity::Selective));
    let uniform1 = peak(full(RecomputeMethod::Uniform, 1));
    let uniform5 = peak(full(RecomputeMethod::Uniform, 5));
    let block: Vec<u64> = (1..=5)
        .map(|n| peak(full(RecomputeMethod::Block, n)))
        .collect();
    assert!(selective < none, "selective {selective} vs none {none}");
    assert!(
        uniform1 < selective,
        "full uniform 1 {uniform1} vs selective {selective}"
    );
    // Recomputing more layers individually keeps less.
    assert!(
        block[0] < selective && block.windows(2).all(|w| w[1] < w[0]),
        "{block:?}"
    );
    // One 5-layer group keeps one input but re-materializes all five layers at once.
    assert!(uniform5 > uniform1, "{uniform5} vs {uniform1}");
    assert!(config.activation_memory(0, 64).is_err());
    assert!(config.activation_memory(2, 0).is_err());
}

/// SmolLM2-135M (30 layers, h 576, a 9, g 3, d 64, f 1536, v 49152) at seq 512, micro-batch 1,
/// against the byte counts worked out by hand: per token a layer keeps
/// `4h + 2 + (a + 2g)·d + 3f = 7874` floats plus `a·(d + 1) = 585` for core attention; a
/// recompute input is `h = 576` floats; the final norm `2h + 1` floats, the logits `v`, the
/// positions one usize.
#[test]
fn smollm2_135m_activation_memory() {
    let (model, _) = load_hf_model(&fixture("tiny-llama"), DType::F32).unwrap();
    let mut c = model.config().clone();
    (
        c.num_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.num_query_groups,
        c.kv_channels,
        c.ffn_hidden_size,
        c.vocab_size,
        c.max_position_embeddings,
    ) = (30, 576, 9, 3, 64, 1536, 49152, 8192);
    let rows = 512u64;
    let f32s = |per_row: u64| per_row * rows * 4;
    let fixed = rows * 8 + f32s(2 * 576 + 1) + f32s(49152);
    let layer = f32s(7874);
    let core = f32s(585);
    let input = f32s(576);
    let cases = [
        (None, fixed + 30 * (layer + core)),
        (Some(RecomputeGranularity::Selective), fixed + 30 * layer),
        (full(RecomputeMethod::Uniform, 1), fixed + 30 * input),
        (
            full(RecomputeMethod::Block, 15),
            fixed + 15 * input + 15 * (layer + core),
        ),
    ];
    for (mode, want) in cases {
        c.recompute_granularity = mode;
        let m = c.activation_memory(1, 512).unwrap();
        // With the logits held to the end of the forward, that is the peak in every mode.
        assert_eq!(
            (m.peak_bytes, m.forward_end_bytes),
            (want, want),
            "{mode:?}"
        );
        assert_eq!(m.logits_bytes, f32s(49152));
        eprintln!(
            "SmolLM2-135M s=512 b=1 {mode:?}: peak {} bytes ({:.1} MiB), logits {:.1} MiB",
            m.peak_bytes,
            m.peak_bytes as f64 / (1 << 20) as f64,
            m.logits_bytes as f64 / (1 << 20) as f64
        );
    }
}
