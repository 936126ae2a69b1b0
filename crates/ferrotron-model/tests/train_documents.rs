//! Packed documents (Megatron's `reset_attention_mask` + `reset_position_ids`): a row holding
//! two documents back to back, with per-document attention and positions, gives the loss sum
//! and gradients of the two documents run as separate rows. Bad document starts are errors.

use ferrotron_model::families::load_hf_model;
use ferrotron_model::{GptModel, TrainBatch};
use ferrotron_tensor::DType;
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

/// `(loss_sum, gradients)` of one forward/backward with loss scale 1.
fn run(model: &GptModel, batch: &TrainBatch) -> (f64, Vec<Vec<f32>>) {
    let mut grads: Vec<Vec<f32>> = model.zero_grads();
    let mut views: Vec<&mut [f32]> = grads.iter_mut().map(|g| g.as_mut_slice()).collect();
    let stats = model.forward_backward(batch, &mut views, 1.0).unwrap();
    // forward_backward scales by 1/loss_count inside; undo it to compare sums.
    for g in &mut grads {
        for x in g.iter_mut() {
            *x *= stats.loss_count as f32;
        }
    }
    (stats.loss_sum, grads)
}

fn seq(len: usize, salt: usize, v: usize) -> (Vec<u32>, Vec<i64>) {
    let tokens = (0..len)
        .map(|i| ((i * 31 + salt * 7 + 3) % v) as u32)
        .collect();
    let labels = (0..len)
        .map(|i| ((i * 17 + salt * 5 + 1) % v) as i64)
        .collect();
    (tokens, labels)
}

#[test]
fn packed_documents_equal_separate_rows() {
    for name in ["tiny-llama", "tiny-qwen2", "tiny-mistral"] {
        let (model, _) = load_hf_model(&fixture(name), DType::F32).unwrap();
        let v = model.config().vocab_size;
        let (l1, l2) = (7, 10);
        let (t1, y1) = seq(l1, 1, v);
        let (t2, y2) = seq(l2, 2, v);

        let (sum1, g1) = run(&model, &TrainBatch::from_batch_major(&t1, &y1, None, 1, l1));
        let (sum2, g2) = run(&model, &TrainBatch::from_batch_major(&t2, &y2, None, 1, l2));

        let tokens: Vec<u32> = t1.iter().chain(&t2).copied().collect();
        let labels: Vec<i64> = y1.iter().chain(&y2).copied().collect();
        let mut packed = TrainBatch::from_batch_major(&tokens, &labels, None, 1, l1 + l2);
        packed.position_ids = Some((0..l1).chain(0..l2).collect());
        let segments: Vec<u32> = (0..l1 + l2).map(|t| u32::from(t >= l1)).collect();
        packed.set_segments(&segments);
        let (sum, g) = run(&model, &packed);

        let rel = (sum - (sum1 + sum2)).abs() / (sum1 + sum2);
        assert!(rel < 1e-5, "{name}: loss sum {sum} vs {}", sum1 + sum2);
        let names: Vec<String> = model.parameters().into_iter().map(|p| p.name).collect();
        for (k, name_k) in names.iter().enumerate() {
            let (mut num, mut den) = (0f64, 0f64);
            for i in 0..g[k].len() {
                let want = (g1[k][i] + g2[k][i]) as f64;
                num += (g[k][i] as f64 - want).powi(2);
                den += want * want;
            }
            let rel = (num / den.max(1e-30)).sqrt();
            assert!(rel < 1e-4, "{name}: gradient of {name_k} rel err {rel}");
        }

        // Without the document mask the second document sees the first: a different loss.
        let mut leaky = packed.clone();
        leaky.document_starts = None;
        let (leak_sum, _) = run(&model, &leaky);
        assert!((leak_sum - sum).abs() > 1e-4, "{name}: mask had no effect");
    }
}

#[test]
fn bad_document_starts_are_errors() {
    let (model, _) = load_hf_model(&fixture("tiny-llama"), DType::F32).unwrap();
    let (t, y) = seq(6, 0, model.config().vocab_size);
    let mut grads: Vec<Vec<f32>> = model.zero_grads();
    for starts in [
        vec![0, 0, 0, 1, 3, 3],
        vec![0, 0, 0],
        vec![1, 1, 2, 3, 4, 5],
    ] {
        let mut batch = TrainBatch::from_batch_major(&t, &y, None, 1, 6);
        batch.document_starts = Some(starts.clone());
        let mut views: Vec<&mut [f32]> = grads.iter_mut().map(|g| g.as_mut_slice()).collect();
        let err = model.forward_backward(&batch, &mut views, 1.0).unwrap_err();
        assert!(
            err.to_string().contains("document_starts") || err.to_string().contains("start"),
            "{starts:?}: {err}"
        );
    }
    assert!(grads.iter().all(|g| g.iter().all(|&x| x == 0.0)));
}
