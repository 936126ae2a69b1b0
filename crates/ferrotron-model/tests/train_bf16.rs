//! bf16 training keeps its activations in bf16 (`GptModel::activation_dtype`): the loss
//! and gradients stay close to keeping them in f32 for the same weights, and the
//! saved-activation memory of SmolLM2-135M drops to what the hand count says.

use ferrotron_model::families::load_hf_model;
use ferrotron_model::{GptModel, TrainBatch, TransformerConfig};
use ferrotron_tensor::DType;
use std::path::PathBuf;

fn tiny_llama3(dtype: DType) -> GptModel {
    // bf16 on disk: loaded as f32 it holds exactly the bf16 weights, widened.
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-llama3");
    load_hf_model(&dir, dtype).unwrap().0
}

fn grads(model: &GptModel, batch: &TrainBatch) -> (f32, Vec<Vec<f32>>) {
    let mut grads = model.zero_grads();
    let mut views: Vec<&mut [f32]> = grads.iter_mut().map(|g| g.as_mut_slice()).collect();
    let stats = model.forward_backward(batch, &mut views, 1.0).unwrap();
    (stats.loss, grads)
}

#[test]
fn bf16_activations_track_f32_activations() {
    let (wide, narrow) = (tiny_llama3(DType::F32), tiny_llama3(DType::BF16));
    assert_eq!(wide.activation_dtype(), DType::F32);
    assert_eq!(narrow.activation_dtype(), DType::BF16);
    let v = wide.config().vocab_size;
    let (b, s) = (2, 16);
    let tokens: Vec<u32> = (0..b * s).map(|i| ((i * 37 + 11) % v) as u32).collect();
    let labels: Vec<i64> = (0..b * s).map(|i| ((i * 53 + 5) % v) as i64).collect();
    let batch = TrainBatch::from_batch_major(&tokens, &labels, None, b, s);
    let (loss_w, g_w) = grads(&wide, &batch);
    let (loss_n, g_n) = grads(&narrow, &batch);
    assert!(
        ((loss_n - loss_w) / loss_w).abs() < 1e-2,
        "{loss_n} vs {loss_w}"
    );
    let names = wide.parameters();
    let mut differs = false;
    for ((p, a), b) in names.iter().zip(&g_w).zip(&g_n) {
        let norm = |x: &[f32]| x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
        let diff: Vec<f32> = a.iter().zip(b).map(|(x, y)| x - y).collect();
        let rel = norm(&diff) / norm(a).max(1e-12);
        assert!(rel < 5e-2, "{}: relative L2 difference {rel:.2e}", p.name);
        differs |= rel > 0.0;
    }
    // the activations really were rounded
    assert!(differs, "bf16 activations changed no gradient");
}

/// SmolLM2-135M at seq 512, micro-batch 1, no recompute: a layer keeps `2h + 2 = 1154` f32
/// and `2h + (a + 2g)·d + 3f = 6720` bf16 values per token, core attention `a·d = 576` bf16
/// and `a = 9` f32; the final norm, logits and positions stay as in f32.
#[test]
fn smollm2_135m_bf16_activation_memory() {
    let c = TransformerConfig::llama(30, 576, 1536, 9, 3, 49152, 8192).unwrap();
    let rows = 512u64;
    let fixed = rows * 8 + rows * 4 * (2 * 576 + 1) + rows * 4 * 49152;
    let layer = rows * (4 * 1154 + 2 * 6720);
    let core = rows * (2 * 576 + 4 * 9);
    let bf16 = c.activation_memory_in(1, 512, DType::BF16).unwrap();
    assert_eq!(bf16.peak_bytes, fixed + 30 * (layer + core));
    let f32 = c.activation_memory(1, 512).unwrap();
    let per_layer = |m: u64| (m - fixed) as f64 / 30.0;
    let ratio = per_layer(bf16.peak_bytes) / per_layer(f32.peak_bytes);
    assert!((0.55..0.6).contains(&ratio), "{ratio}");
    eprintln!(
        "SmolLM2-135M s=512 b=1: saved activations {:.1} MiB in bf16 vs {:.1} MiB in f32",
        bf16.peak_bytes as f64 / (1 << 20) as f64,
        f32.peak_bytes as f64 / (1 << 20) as f64
    );
}
