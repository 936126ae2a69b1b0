//! Whole-model gradients of `GptModel::forward_backward` against PyTorch on the committed tiny
//! fixtures (`tools/make_grad_fixtures.py`: loss of `model(input_ids, labels=input_ids)`,
//! every parameter's gradient norm and a few full gradients), plus gradient accumulation.

use ferrotron_model::families::load_hf_model;
use ferrotron_model::{GptModel, TrainBatch};
use ferrotron_tensor::DType;
use ferrotron_tensor::ops::IGNORE_INDEX;
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

fn f32s(st: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    st.tensor(name)
        .unwrap_or_else(|_| panic!("{name} missing"))
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// The fixture's `[b, s]` input ids as a batch with HF's shifted labels (last position ignored).
fn batch(name: &str) -> TrainBatch {
    let bytes = std::fs::read(fixture(name).join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let ids = st.tensor("input_ids").unwrap();
    let (b, s) = (ids.shape()[0], ids.shape()[1]);
    let ids: Vec<i64> = ids
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let labels: Vec<i64> = (0..b * s)
        .map(|i| {
            if i % s == s - 1 {
                IGNORE_INDEX
            } else {
                ids[i + 1]
            }
        })
        .collect();
    let tokens: Vec<u32> = ids.iter().map(|&x| x as u32).collect();
    TrainBatch::from_batch_major(&tokens, &labels, None, b, s)
}

fn zero_grads(model: &GptModel) -> Vec<Vec<f32>> {
    model.zero_grads()
}

fn run(model: &GptModel, batch: &TrainBatch, grads: &mut [Vec<f32>]) -> f32 {
    let mut views: Vec<&mut [f32]> = grads.iter_mut().map(|g| g.as_mut_slice()).collect();
    model.forward_backward(batch, &mut views, 1.0).unwrap().loss
}

/// Our Megatron-named gradients re-expressed under HF names (q/k/v and gate/up unpacked).
fn hf_grads(model: &GptModel, grads: &[Vec<f32>]) -> HashMap<String, Vec<f32>> {
    let c = model.config();
    let (d, g, f) = (c.kv_channels, c.num_query_groups, c.ffn_hidden_size);
    let qpg = c.heads_per_group() * d;
    let mut out = HashMap::new();
    for (p, gr) in model.parameters().iter().zip(grads) {
        let name = p.name.as_str();
        if name == "embedding.word_embeddings.weight" {
            out.insert("model.embed_tokens.weight".into(), gr.clone());
            continue;
        }
        if name == "decoder.final_layernorm.weight" {
            out.insert("model.norm.weight".into(), gr.clone());
            continue;
        }
        if name == "output_layer.weight" {
            out.insert("lm_head.weight".into(), gr.clone());
            continue;
        }
        let rest = name.strip_prefix("decoder.layers.").unwrap();
        let (i, rest) = rest.split_once('.').unwrap();
        let pre = format!("model.layers.{i}");
        let (module, kind) = rest.rsplit_once('.').unwrap();
        // Row width: weights are [rows, cols], biases and norms [rows].
        let cols = if p.shape.len() == 2 { p.shape[1] } else { 1 };
        let rows_of = |r: std::ops::Range<usize>| gr[r.start * cols..r.end * cols].to_vec();
        match module {
            "self_attention.linear_qkv" => {
                let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
                for gi in 0..g {
                    let base = gi * (qpg + 2 * d);
                    q.extend(rows_of(base..base + qpg));
                    k.extend(rows_of(base + qpg..base + qpg + d));
                    v.extend(rows_of(base + qpg + d..base + qpg + 2 * d));
                }
                out.insert(format!("{pre}.self_attn.q_proj.{kind}"), q);
                out.insert(format!("{pre}.self_attn.k_proj.{kind}"), k);
                out.insert(format!("{pre}.self_attn.v_proj.{kind}"), v);
            }
            "mlp.linear_fc1" => {
                out.insert(format!("{pre}.mlp.gate_proj.{kind}"), rows_of(0..f));
                out.insert(format!("{pre}.mlp.up_proj.{kind}"), rows_of(f..2 * f));
            }
            _ => {
                let hf = match module {
                    "input_layernorm" => "input_layernorm",
                    "pre_mlp_layernorm" => "post_attention_layernorm",
                    "self_attention.linear_proj" => "self_attn.o_proj",
                    "mlp.linear_fc2" => "mlp.down_proj",
                    other => panic!("unexpected parameter {other}"),
                };
                out.insert(format!("{pre}.{hf}.{kind}"), gr.clone());
            }
        }
    }
    out
}

fn norm(x: &[f32]) -> f64 {
    x.iter()
        .map(|&v| (v as f64) * (v as f64))
        .sum::<f64>()
        .sqrt()
}

/// (loss rel err, max grad-norm rel err, max full-grad rel err).
fn check_fixture(name: &str) -> (f64, f64, f64) {
    let (model, _) = load_hf_model(&fixture(name), DType::F32).unwrap();
    let batch = batch(name);
    let mut grads = zero_grads(&model);
    let loss = run(&model, &batch, &mut grads);
    let bytes = std::fs::read(fixture(name).join("grads.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let want_loss = f32s(&st, "loss")[0];
    let loss_err = ((loss - want_loss) / want_loss).abs() as f64;
    assert!(loss_err <= 1e-5, "{name}: loss {loss} vs {want_loss}");
    let ours = hf_grads(&model, &grads);
    let mut norm_names = 0;
    let mut worst_norm = 0f64;
    let mut worst_full = 0f64;
    for key in st.names() {
        if let Some(p) = key.strip_prefix("grad_norm.") {
            norm_names += 1;
            let got = ours
                .get(p)
                .unwrap_or_else(|| panic!("{name}: no gradient for {p}"));
            let want = f32s(&st, key)[0] as f64;
            let err = (norm(got) - want).abs() / want.max(1e-12);
            assert!(err <= 1e-4, "{name}: |grad {p}| {} vs {want}", norm(got));
            worst_norm = worst_norm.max(err);
        } else if let Some(p) = key.strip_prefix("grad.") {
            let want = f32s(&st, key);
            let got = &ours[p];
            assert_eq!(got.len(), want.len(), "{name}: {p} size");
            let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
            let max_diff = got
                .iter()
                .zip(&want)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs())) as f64;
            let err = max_diff / scale.max(1e-12);
            assert!(
                err <= 1e-4,
                "{name}: grad {p} max diff {max_diff} (max |g| {scale})"
            );
            worst_full = worst_full.max(err);
        }
    }
    assert_eq!(norm_names, ours.len(), "{name}: parameter sets differ");
    eprintln!(
        "{name}: loss rel {loss_err:.2e}, grad norms rel <= {worst_norm:.2e}, full grads rel <= {worst_full:.2e}"
    );
    (loss_err, worst_norm, worst_full)
}

#[test]
fn llama_gradients_match_pytorch() {
    check_fixture("tiny-llama");
}

#[test]
fn llama3_tied_gradients_match_pytorch() {
    check_fixture("tiny-llama3");
}

#[test]
fn qwen2_bias_gradients_match_pytorch() {
    check_fixture("tiny-qwen2");
}

#[test]
fn mistral_sliding_window_gradients_match_pytorch() {
    check_fixture("tiny-mistral");
}

#[test]
fn gradients_accumulate_across_calls() {
    let (model, _) = load_hf_model(&fixture("tiny-llama3"), DType::F32).unwrap();
    let batch = batch("tiny-llama3");
    let mut once = zero_grads(&model);
    run(&model, &batch, &mut once);
    let mut twice = zero_grads(&model);
    run(&model, &batch, &mut twice);
    run(&model, &batch, &mut twice);
    // Accumulation adds in a different order (e.g. the tied embedding's two terms), so the
    // sums agree to f32 rounding relative to the tensor's scale, not bit for bit.
    for (p, (a, b)) in model.parameters().iter().zip(once.iter().zip(&twice)) {
        let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
        for (x, y) in a.iter().zip(b) {
            assert!(
                (y - 2.0 * x).abs() <= 1e-6 * scale,
                "{}: {y} vs 2·{x} (max |g| {scale})",
                p.name
            );
        }
    }
}

#[test]
fn parameters_round_trip_and_name_megatron_layout() {
    let (mut model, _) = load_hf_model(&fixture("tiny-qwen2"), DType::F32).unwrap();
    let params = model.parameters();
    assert_eq!(params[0].name, "embedding.word_embeddings.weight");
    assert!(params[0].is_embedding);
    assert_eq!(params[1].name, "decoder.layers.0.input_layernorm.weight");
    assert_eq!(
        params[2].name,
        "decoder.layers.0.self_attention.linear_qkv.weight"
    );
    assert_eq!(
        params[3].name,
        "decoder.layers.0.self_attention.linear_qkv.bias"
    );
    assert!(params[3].is_norm_or_bias && !params[2].is_norm_or_bias);
    assert_eq!(params.last().unwrap().name, "output_layer.weight");
    let total: usize = params.iter().map(|p| p.numel()).sum();
    // Biases included (Qwen2's q/k/v biases).
    assert_eq!(total, model.config().num_parameters());
    let mut bufs: Vec<Vec<f32>> = params.iter().map(|p| vec![0f32; p.numel()]).collect();
    let mut views: Vec<&mut [f32]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    model.copy_parameters_to(&mut views).unwrap();
    for b in &mut bufs {
        for x in b.iter_mut() {
            *x += 0.5;
        }
    }
    let srcs: Vec<&[f32]> = bufs.iter().map(|b| b.as_slice()).collect();
    model.load_parameters_from(&srcs).unwrap();
    let mut back: Vec<Vec<f32>> = params.iter().map(|p| vec![0f32; p.numel()]).collect();
    let mut views: Vec<&mut [f32]> = back.iter_mut().map(|b| b.as_mut_slice()).collect();
    model.copy_parameters_to(&mut views).unwrap();
    assert_eq!(back, bufs);
    assert!(model.load_parameters_from(&srcs[1..]).is_err());
}

/// Central differences of the loss (with a loss mask, a loss scale and reset position ids,
/// which the PyTorch fixtures do not cover) against the analytic gradient, for the largest
/// gradient entries of a few parameters.
#[test]
fn masked_loss_gradients_match_finite_differences() {
    let (mut model, _) = load_hf_model(&fixture("tiny-mistral"), DType::F32).unwrap();
    let batch = masked_batch("tiny-mistral");
    let checked = check_finite_differences(&mut model, &batch, |name| {
        name.contains("layers.0.self_attention.linear_qkv")
            || name.contains("layers.1.mlp.linear_fc1")
            || name.contains("layers.1.pre_mlp_layernorm")
            || name.contains("final_layernorm")
            || name.contains("word_embeddings")
            || name.contains("output_layer")
    });
    assert_eq!(checked, 18);
}

/// Multi-latent attention (DeepSeek-V2's: query latent, interleaved YaRN rope with both
/// mscales, unequal head dims; dense MLPs so no routing flips under the perturbation) against
/// central differences, every projection and latent norm, with the masked, restarted batch.
#[test]
fn multi_latent_attention_gradients_match_finite_differences() {
    let (loaded, _) = load_hf_model(&fixture("tiny-deepseek-v2"), DType::F32).unwrap();
    let mut config = loaded.config().clone();
    config.moe = None;
    let init = ferrotron_model::InitConfig {
        init_method_std: 0.2,
        ..Default::default()
    };
    let mut model = GptModel::init_random(config, init).unwrap();
    let batch = masked_batch("tiny-deepseek-v2");
    let checked = check_finite_differences(&mut model, &batch, |name| {
        name.starts_with("decoder.layers.0.self_attention.")
    });
    // q down / norm / up, kv down / norm / up, linear_proj.
    assert_eq!(checked, 3 * 7);
}

/// `name`'s reference batch with a loss mask and position ids restarting at `s/2`.
fn masked_batch(name: &str) -> TrainBatch {
    let mut batch = batch(name);
    let (b, s) = (batch.micro_batch, batch.seq);
    batch.loss_mask = Some((0..b * s).map(|i| ((i * 7) % 5) as f32 * 0.25).collect());
    // Two "documents" per sequence: positions restart at s/2.
    batch.position_ids = Some(
        (0..s)
            .flat_map(|t| std::iter::repeat_n(t % (s / 2), b))
            .collect(),
    );
    batch
}

/// The analytic gradient at loss scale 3 against central differences (step 1e-2) of the
/// loss for the 3 largest gradient entries of every parameter `pick` selects; returns how
/// many entries were checked.
fn check_finite_differences(
    model: &mut GptModel,
    batch: &TrainBatch,
    pick: impl Fn(&str) -> bool,
) -> usize {
    let scale = 3.0;
    let mut grads = zero_grads(model);
    let mut views: Vec<&mut [f32]> = grads.iter_mut().map(|g| g.as_mut_slice()).collect();
    let stats = model.forward_backward(batch, &mut views, scale).unwrap();
    assert!((stats.loss as f64 - stats.loss_sum / stats.loss_count).abs() < 1e-6);
    assert_eq!(stats.loss_count, batch.loss_token_count());
    let params = model.parameters();
    let mut base: Vec<Vec<f32>> = params.iter().map(|p| vec![0f32; p.numel()]).collect();
    let mut views: Vec<&mut [f32]> = base.iter_mut().map(|b| b.as_mut_slice()).collect();
    model.copy_parameters_to(&mut views).unwrap();
    let loss_at = |model: &mut GptModel, pi: usize, idx: usize, delta: f32| -> f64 {
        let mut w = base.clone();
        w[pi][idx] += delta;
        let srcs: Vec<&[f32]> = w.iter().map(|b| b.as_slice()).collect();
        model.load_parameters_from(&srcs).unwrap();
        let mut g = zero_grads(model);
        let mut v: Vec<&mut [f32]> = g.iter_mut().map(|g| g.as_mut_slice()).collect();
        model.forward_backward(batch, &mut v, 1.0).unwrap().loss_sum / batch.loss_token_count()
    };
    let eps = 1e-2f32;
    let mut checked = 0;
    for (pi, p) in params.iter().enumerate() {
        if !pick(&p.name) {
            continue;
        }
        let mut order: Vec<usize> = (0..p.numel()).collect();
        order.sort_by(|&i, &j| grads[pi][j].abs().total_cmp(&grads[pi][i].abs()));
        for &idx in order.iter().take(3) {
            let plus = loss_at(model, pi, idx, eps);
            let minus = loss_at(model, pi, idx, -eps);
            let fd = scale as f64 * (plus - minus) / (2.0 * eps as f64);
            let g = grads[pi][idx] as f64;
            assert!(
                (fd - g).abs() <= 2e-2 * g.abs() + 1e-4,
                "{}[{idx}]: finite difference {fd} vs analytic {g}",
                p.name
            );
            checked += 1;
        }
    }
    checked
}

/// bf16 storage (llama3 is bf16 on disk, so the weights are exact): `load_parameters_from`
/// rounds every parameter to bf16, norm gains too (one table dtype, as Megatron's bf16
/// params and HF's `model.to(torch.bfloat16)`). (bf16 training's loss and
/// gradients, with bf16 activations, are checked against f32 in `train_bf16.rs`.)
#[test]
fn bf16_storage_rounds_loaded_weights() {
    let (mut m16, _) = load_hf_model(&fixture("tiny-llama3"), DType::BF16).unwrap();
    let params = m16.parameters();
    let src: Vec<Vec<f32>> = params
        .iter()
        .map(|p| vec![1.0 + 1.0 / 1024.0; p.numel()])
        .collect();
    let srcs: Vec<&[f32]> = src.iter().map(|v| v.as_slice()).collect();
    m16.load_parameters_from(&srcs).unwrap();
    let mut back: Vec<Vec<f32>> = params.iter().map(|p| vec![0f32; p.numel()]).collect();
    let mut views: Vec<&mut [f32]> = back.iter_mut().map(|b| b.as_mut_slice()).collect();
    m16.copy_parameters_to(&mut views).unwrap();
    // 1 + 2^-10 rounds to 1.0 in bf16 (8 significand bits), for the embedding and the norms.
    assert!(back[0].iter().all(|&x| x == 1.0));
    let fin = params
        .iter()
        .position(|p| p.name == "decoder.final_layernorm.weight")
        .unwrap();
    assert!(back[fin].iter().all(|&x| x == 1.0));
}
