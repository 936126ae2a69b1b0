//! Pipeline stages: the layer split (even, or an uneven first stage), global parameter
//! names, and two stages run back to back (forward through both, backward through both)
//! giving the whole model's loss and gradients on every fixture.

use ferrotron_model::families::load_hf_model;
use ferrotron_model::{GptModel, TrainBatch, stage_layers};
use ferrotron_tensor::DType;
use std::path::PathBuf;

fn fixture(name: &str) -> GptModel {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name);
    load_hf_model(&dir, DType::F32).unwrap().0
}

fn batch(v: usize) -> TrainBatch {
    let (b, s) = (2, 6);
    let tokens: Vec<u32> = (0..b * s).map(|i| ((i * 29 + 3) % v) as u32).collect();
    let labels: Vec<i64> = (0..b * s).map(|i| ((i * 41 + 7) % v) as i64).collect();
    TrainBatch::from_batch_major(&tokens, &labels, None, b, s)
}

#[test]
fn layers_split_evenly_or_with_an_uneven_first_stage() {
    assert_eq!(stage_layers(8, 4, 2, None).unwrap(), 4..6);
    assert_eq!(stage_layers(7, 3, 0, Some(1)).unwrap(), 0..1);
    assert_eq!(stage_layers(7, 3, 2, Some(1)).unwrap(), 4..7);
    let err = stage_layers(7, 2, 0, None).unwrap_err().to_string();
    assert!(
        err.contains("num_layers (7) is not divisible by pipeline_model_parallel_size (2)"),
        "{err}"
    );
    let err = stage_layers(7, 3, 0, Some(2)).unwrap_err().to_string();
    assert!(
        err.contains("decoder_first_pipeline_num_layers (2)"),
        "{err}"
    );
}

#[test]
fn two_stages_back_to_back_equal_the_whole_model() {
    for name in ["tiny-llama", "tiny-llama3", "tiny-qwen2", "tiny-mistral"] {
        let full = fixture(name);
        let batch = batch(full.config().vocab_size);
        let mut want = full.zero_grads();
        let mut views: Vec<&mut [f32]> = want.iter_mut().map(|g| g.as_mut_slice()).collect();
        let want_loss = full.forward_backward(&batch, &mut views, 1.0).unwrap();
        let names: Vec<String> = full.parameters().into_iter().map(|p| p.name).collect();

        let first = full.pipeline_stage(0..1, true, false).unwrap();
        let last = full.pipeline_stage(1..2, false, true).unwrap();
        let last_names: Vec<String> = last.parameters().into_iter().map(|p| p.name).collect();
        assert!(
            last_names
                .iter()
                .any(|n| n == "decoder.layers.1.input_layernorm.weight"),
            "{last_names:?}"
        );
        assert!(
            !last_names.iter().any(|n| n.starts_with("decoder.layers.0")),
            "{last_names:?}"
        );
        assert_eq!(last.holds_shared_embedding_copy(), name == "tiny-llama3");
        assert_eq!(last.layers().len(), 1);
        assert_eq!(
            last.config(),
            full.config(),
            "{name}: the whole model's config"
        );

        let mut f0 = first.stage_forward(&batch, 0, None, 1.0).unwrap();
        assert!(f0.loss().is_none());
        let hidden = f0.take_output();
        let f1 = last.stage_forward(&batch, 0, Some(hidden), 1.0).unwrap();
        let loss = f1.loss().unwrap();
        assert!(
            (loss.loss_sum - want_loss.loss_sum).abs() < 1e-9 * want_loss.loss_sum,
            "{name}"
        );
        let mut g1 = last.zero_grads();
        let mut v1: Vec<&mut [f32]> = g1.iter_mut().map(|g| g.as_mut_slice()).collect();
        let dhidden = last
            .stage_backward(&batch, f1, &mut v1, None)
            .unwrap()
            .unwrap();
        let mut g0 = first.zero_grads();
        let mut v0: Vec<&mut [f32]> = g0.iter_mut().map(|g| g.as_mut_slice()).collect();
        assert!(
            first
                .stage_backward(&batch, f0, &mut v0, Some(dhidden))
                .unwrap()
                .is_none()
        );

        // every stage gradient equals the whole model's; the tied embedding's two copies sum
        let stage_grads = first
            .parameters()
            .into_iter()
            .zip(&g0)
            .chain(last.parameters().into_iter().zip(&g1));
        let mut embedding = vec![0f32; 0];
        for (p, g) in stage_grads {
            let w = &want[names.iter().position(|n| *n == p.name).unwrap()];
            if p.name == "embedding.word_embeddings.weight" && name == "tiny-llama3" {
                if embedding.is_empty() {
                    embedding = g.clone();
                } else {
                    embedding.iter_mut().zip(g).for_each(|(a, b)| *a += b);
                    assert_close(name, &p.name, &embedding, w);
                }
                continue;
            }
            assert_close(name, &p.name, g, w);
        }
    }
}

fn assert_close(model: &str, param: &str, got: &[f32], want: &[f32]) {
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    let err = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
        / scale;
    assert!(err < 1e-5, "{model} {param}: {err:.1e}");
}

#[test]
fn stages_refuse_inputs_that_do_not_fit() {
    let full = fixture("tiny-llama");
    let batch = batch(full.config().vocab_size);
    let last = full.pipeline_stage(1..2, false, true).unwrap();
    let err = last
        .stage_forward(&batch, 0, None, 1.0)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("needs the previous stage's activations"),
        "{err}"
    );
    let err = last
        .stage_forward(&batch, 0, Some(vec![0.0; 3]), 1.0)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("pipeline stage input of 3 values"), "{err}");
    let err = last
        .forward_backward(&batch, &mut [], 1.0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("needs the whole model"), "{err}");
    assert!(full.pipeline_stage(0..3, true, false).is_err());
}

/// Running the model one layer group at a time (`part_forward` over `layer_groups`, then
/// the backwards in reverse) is `forward_backward` bit for bit, with and without recompute
/// (whose groups stay whole), and reads exactly the parameters `part_params` names.
#[test]
fn layer_groups_run_in_parts_equal_the_whole_model() {
    use ferrotron_model::{RecomputeGranularity, RecomputeMethod};
    for name in ["tiny-llama", "tiny-llama3", "tiny-qwen2"] {
        for recompute in [
            None,
            Some(RecomputeGranularity::Selective),
            Some(RecomputeGranularity::Full {
                method: RecomputeMethod::Uniform,
                num_layers: 2,
            }),
            Some(RecomputeGranularity::Full {
                method: RecomputeMethod::Block,
                num_layers: 1,
            }),
        ] {
            let mut model = fixture(name);
            model.set_recompute_granularity(recompute).unwrap();
            let batch = batch(model.config().vocab_size);
            let mut want = model.zero_grads();
            let mut views: Vec<&mut [f32]> = want.iter_mut().map(|g| g.as_mut_slice()).collect();
            let want_loss = model.forward_backward(&batch, &mut views, 0.5).unwrap();

            let groups = model.layer_groups();
            let expect_groups = if matches!(
                recompute,
                Some(RecomputeGranularity::Full {
                    method: RecomputeMethod::Uniform,
                    ..
                })
            ) {
                1
            } else {
                2
            };
            assert_eq!(groups.len(), expect_groups, "{name} {recompute:?}");
            let mut got = model.zero_grads();
            let mut views: Vec<&mut [f32]> = got.iter_mut().map(|g| g.as_mut_slice()).collect();
            let (mut states, mut x, mut loss) = (Vec::new(), None, None);
            let mut covered = 0;
            for layers in groups {
                let params = model.part_params(layers.clone());
                assert!(
                    params.start <= covered && params.end > covered,
                    "{params:?}"
                );
                covered = params.end;
                let mut s = model.part_forward(&batch, layers, x.take(), 0.5).unwrap();
                match s.loss() {
                    Some(l) => loss = Some(l),
                    None => x = Some(s.take_output()),
                }
                states.push(s);
            }
            assert_eq!(covered, model.parameters().len());
            let mut dout = None;
            for s in states.into_iter().rev() {
                dout = model.stage_backward(&batch, s, &mut views, dout).unwrap();
            }
            assert!(dout.is_none());
            // The same loss statistics; only the whole pass measures its activation peak.
            let whole = ferrotron_model::LossStats {
                activation_peak_bytes: 0,
                ..want_loss
            };
            assert_eq!(loss.unwrap(), whole, "{name} {recompute:?}");
            assert_eq!(got, want, "{name} {recompute:?}");
        }
    }
}
