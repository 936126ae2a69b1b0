//! Tensor parallelism is exact: on every fixture, a tensor-parallel forward + backward over 2
//! in-process ranks, with and without sequence parallelism, gives the full model's loss and,
//! gathered, its gradients; the shards reassemble into the full model's weights.

use std::sync::Arc;

use ferrotron_comm::run_local;
use ferrotron_model::families::load_hf_model;
use ferrotron_model::{GptModel, ModelError, TrainBatch};
use ferrotron_nn::TensorParallel;
use ferrotron_tensor::DType;
use std::path::PathBuf;

fn fixture(name: &str) -> GptModel {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name);
    load_hf_model(&dir, DType::F32).unwrap().0
}

/// b = 2 rows of s = 8 tokens, a partial loss mask and one ignored label.
fn batch(v: usize) -> TrainBatch {
    let (b, s) = (2, 8);
    let tokens: Vec<u32> = (0..b * s).map(|i| ((i * 37 + 5) % v) as u32).collect();
    let mut labels: Vec<i64> = (0..b * s).map(|i| ((i * 53 + 11) % v) as i64).collect();
    labels[3] = -100;
    let mask: Vec<f32> = (0..b * s)
        .map(|i| if i % 5 == 0 { 0.0 } else { 1.0 })
        .collect();
    TrainBatch::from_batch_major(&tokens, &labels, Some(&mask), b, s)
}

fn forward_backward(
    model: &GptModel,
    batch: &TrainBatch,
) -> Result<(f64, Vec<Vec<f32>>), ModelError> {
    let mut grads = model.zero_grads();
    let mut views: Vec<&mut [f32]> = grads.iter_mut().map(|g| g.as_mut_slice()).collect();
    let stats = model.forward_backward(batch, &mut views, 1.0)?;
    model.finalize_grads(&mut views)?;
    Ok((stats.loss_sum, grads))
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
        / scale
}

#[test]
fn tp2_and_sequence_parallel_match_the_full_model() {
    for name in ["tiny-llama", "tiny-llama3", "tiny-qwen2", "tiny-mistral"] {
        let full = fixture(name);
        let batch = batch(full.config().vocab_size);
        let (want_loss, want_grads) = forward_backward(&full, &batch).unwrap();
        let want_params = full.parameters_f32();
        for sp in [false, true] {
            let out = run_local(2, |comm| {
                let tp = TensorParallel::new(Arc::new(comm), sp);
                let shard = full.tensor_parallel_shard(tp, 128)?;
                let (loss, grads) = forward_backward(&shard, &batch)?;
                let grads = shard.gather_tensor_parallel(grads)?;
                let params = shard.gather_tensor_parallel(shard.parameters_f32())?;
                Ok::<_, ModelError>((loss, grads, params))
            })
            .unwrap_or_else(|e| panic!("{name} sp={sp}: {e}"));
            let names: Vec<String> = full.parameters().into_iter().map(|p| p.name).collect();
            for (r, (loss, grads, params)) in out.iter().enumerate() {
                let what = format!("{name} tp2 sp={sp} rank {r}");
                let rel = (loss - want_loss).abs() / want_loss;
                assert!(rel < 1e-6, "{what}: loss {loss} vs {want_loss}");
                assert_eq!(
                    params, &want_params,
                    "{what}: shards do not reassemble the weights"
                );
                for (i, (g, w)) in grads.iter().zip(&want_grads).enumerate() {
                    let e = max_rel(g, w);
                    assert!(e < 1e-5, "{what}: gradient of {} off by {e:.1e}", names[i]);
                }
            }
        }
    }
}

#[test]
fn indivisible_heads_and_sequences_are_errors() {
    let full = fixture("tiny-llama");
    let err = run_local(4, |comm| {
        full.tensor_parallel_shard(TensorParallel::new(Arc::new(comm), false), 128)
            .map(|_| ())
    })
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("num_query_groups (2) is not divisible by tensor_model_parallel_size (4)"),
        "{err}"
    );
    let err = run_local(2, |comm| {
        let shard = full.tensor_parallel_shard(TensorParallel::new(Arc::new(comm), true), 128)?;
        let tokens = vec![1u32; 3];
        let odd = TrainBatch::from_batch_major(&tokens, &[2, 3, 4], None, 1, 3);
        forward_backward(&shard, &odd).map(|_| ())
    })
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("3 tokens do not split over tensor_model_parallel_size 2"),
        "{err}"
    );
}
