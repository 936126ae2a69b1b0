//! The families expressed as switches on the one skeleton (OLMo, OLMo2, Gemma, Phi-3,
//! StarCoder2, Falcon, Bloom) and the MoE families (Mixtral, Qwen2-MoE, OLMoE) against
//! transformers 5.23 on the committed tiny fixtures (`tools/make_family_fixtures.py`,
//! `tools/make_moe_model_fixtures.py`): logits within 1e-4 with the same argmax everywhere,
//! greedy generation token for token through the KV cache, the loss and **every** gradient
//! vs PyTorch, and HF -> model -> HF bit-exact (config and tensors).

use ferrotron_model::families::{
    HfConfigInputs, hf_config_json, hf_tensors, load_hf_model, parse_hf_config,
};
use ferrotron_model::module::LayerMlp;
use ferrotron_model::{GptModel, KvCache, LoadBalancing, LogitsMode, ParamId, TrainBatch};
use ferrotron_tensor::ops::{IGNORE_INDEX, argmax};
use ferrotron_tensor::{DType, Tensor};
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::path::PathBuf;

const FAMILIES: [&str; 12] = [
    "tiny-olmo",
    "tiny-olmo2",
    "tiny-gemma",
    "tiny-phi3",
    "tiny-starcoder2",
    "tiny-falcon",
    "tiny-bloom",
    "tiny-mixtral",
    "tiny-qwen2-moe",
    "tiny-olmoe",
    "tiny-deepseek-v2",
    "tiny-deepseek-v2-lite",
];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

fn read(name: &str, file: &str) -> Vec<u8> {
    std::fs::read(fixture(name).join(file)).unwrap_or_else(|e| panic!("{name}/{file}: {e}"))
}

fn f32s(st: &SafeTensors<'_>, key: &str) -> Vec<f32> {
    st.tensor(key)
        .unwrap_or_else(|_| panic!("{key} missing"))
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// An int64 `[b, s]` tensor as (ids, b, s).
fn ids(st: &SafeTensors<'_>, key: &str) -> (Vec<u32>, usize, usize) {
    let t = st.tensor(key).unwrap_or_else(|_| panic!("{key} missing"));
    let ids = t
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect();
    (ids, t.shape()[0], t.shape()[1])
}

/// `[b, s]` -> `[s, b]`.
fn to_sb(ids: &[u32], b: usize, s: usize) -> Vec<u32> {
    (0..s)
        .flat_map(|t| (0..b).map(move |j| ids[j * s + t]))
        .collect()
}

fn load(name: &str) -> GptModel {
    load_hf_model(&fixture(name), DType::F32)
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .0
}

fn check_logits(name: &str) {
    let model = load(name);
    let bytes = read(name, "reference.safetensors");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (ids, b, s) = ids(&st, "input_ids");
    let want = f32s(&st, "logits");
    let v = model.config().vocab_size;
    let mut cache = KvCache::new(model.config(), b, s).unwrap();
    let got = model
        .forward(&to_sb(&ids, b, s), &mut cache, LogitsMode::All)
        .unwrap();
    let mut max_diff = 0f32;
    for j in 0..b {
        for t in 0..s {
            let g = &got[(t * b + j) * v..][..v];
            let w = &want[(j * s + t) * v..][..v];
            for (x, y) in g.iter().zip(w) {
                max_diff = max_diff.max((x - y).abs());
            }
            assert_eq!(argmax(g), argmax(w), "{name}: argmax at batch {j} pos {t}");
        }
    }
    eprintln!("{name}: max |logit diff| = {max_diff:e}");
    assert!(max_diff <= 1e-4, "{name}: max |logit diff| {max_diff}");
}

/// Greedy decoding of `prompt_ids` through the KV cache (one prefill, then a token at a
/// time) equals transformers' `generate(do_sample=False)`.
fn check_greedy(name: &str) {
    let model = load(name);
    let bytes = read(name, "reference.safetensors");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (prompt, b, p) = ids(&st, "prompt_ids");
    let (want, _, total) = ids(&st, "greedy");
    let v = model.config().vocab_size;
    let mut cache = KvCache::new(model.config(), b, total).unwrap();
    let mut seqs: Vec<Vec<u32>> = (0..b).map(|j| prompt[j * p..][..p].to_vec()).collect();
    let mut logits = model
        .forward(&to_sb(&prompt, b, p), &mut cache, LogitsMode::Last)
        .unwrap();
    while seqs[0].len() < total {
        let next: Vec<u32> = (0..b)
            .map(|j| argmax(&logits[j * v..][..v]) as u32)
            .collect();
        for (s, &t) in seqs.iter_mut().zip(&next) {
            s.push(t);
        }
        if seqs[0].len() < total {
            logits = model.forward(&next, &mut cache, LogitsMode::Last).unwrap();
        }
    }
    for (j, s) in seqs.iter().enumerate() {
        assert_eq!(
            s.as_slice(),
            &want[j * total..][..total],
            "{name}: sequence {j}"
        );
    }
}

/// The fixture's input ids as a batch with HF's shifted labels (last position ignored).
fn batch(name: &str) -> TrainBatch {
    let bytes = read(name, "reference.safetensors");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (tokens, b, s) = ids(&st, "input_ids");
    let labels: Vec<i64> = (0..b * s)
        .map(|i| {
            if i % s == s - 1 {
                IGNORE_INDEX
            } else {
                tokens[i + 1] as i64
            }
        })
        .collect();
    TrainBatch::from_batch_major(&tokens, &labels, None, b, s)
}

/// Our gradients under the names of HF's `named_parameters()`: a model whose parameters are
/// the gradients, exported; an MoE layer's experts under transformers 5's fused in-memory
/// names (`mlp.experts.gate_up_proj` `[E, 2f, h]`, expert `e`'s gate rows then up rows: our
/// `linear_fc1` stack; `mlp.experts.down_proj` `[E, h, f]`: our `linear_fc2` stack) and its
/// router as `mlp.gate.weight` (Mixtral's too, which is `block_sparse_moe.gate` on disk).
fn hf_grads(model: &GptModel, grads: Vec<Vec<f32>>) -> HashMap<String, Vec<f32>> {
    let params = model
        .layout()
        .decls()
        .iter()
        .zip(&grads)
        .map(|(d, g)| Tensor::from_f32(&d.shape, g.clone()).unwrap())
        .collect();
    let as_model = GptModel::new(model.config().clone(), params).unwrap();
    let mut out: HashMap<String, Vec<f32>> = hf_tensors(&as_model)
        .unwrap()
        .into_iter()
        .map(|t| (t.name.clone(), t.values()))
        .collect();
    for layer in model.layers() {
        let LayerMlp::Moe(m) = layer.mlp else {
            continue;
        };
        let prefix = format!("model.layers.{}.", layer.number);
        out.retain(|name, _| {
            !(name.starts_with(&prefix) && (name.contains(".experts.") || name.contains(".gate.")))
        });
        let g = |id: ParamId| grads[id.index()].clone();
        out.insert(
            format!("{prefix}mlp.experts.gate_up_proj"),
            g(m.experts_fc1),
        );
        out.insert(format!("{prefix}mlp.experts.down_proj"), g(m.experts_fc2));
        out.insert(format!("{prefix}mlp.gate.weight"), g(m.router));
    }
    out
}

fn check_grads(name: &str) {
    let model = load(name);
    let batch = batch(name);
    let mut grads = model.zero_grads();
    let mut views: Vec<&mut [f32]> = grads.iter_mut().map(|g| g.as_mut_slice()).collect();
    let loss = model
        .forward_backward(&batch, &mut views, 1.0)
        .unwrap()
        .loss;
    let bytes = read(name, "grads.safetensors");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let want_loss = f32s(&st, "loss")[0];
    assert!(
        ((loss - want_loss) / want_loss).abs() <= 1e-5,
        "{name}: loss {loss} vs {want_loss}"
    );
    let ours = hf_grads(&model, grads);
    let mut worst = 0f64;
    let mut checked = 0;
    for key in st.names() {
        let Some(p) = key.strip_prefix("grad.") else {
            continue;
        };
        let want = f32s(&st, key);
        let got = ours
            .get(p)
            .unwrap_or_else(|| panic!("{name}: no gradient for {p}"));
        assert_eq!(got.len(), want.len(), "{name}: {p} size");
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
        let diff = got
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs())) as f64;
        let err = diff / scale.max(1e-12);
        assert!(
            err <= 1e-4,
            "{name}: grad {p} max diff {diff} (max |g| {scale})"
        );
        worst = worst.max(err);
        checked += 1;
    }
    assert_eq!(checked, ours.len(), "{name}: parameter sets differ");
    eprintln!("{name}: loss {loss} (torch {want_loss}), {checked} gradients, rel <= {worst:.2e}");
}

/// HF -> model -> HF: the config parses back to the same model config, and every tensor is
/// bit-identical to the file's.
fn check_round_trip(name: &str) {
    let original: serde_json::Value = serde_json::from_slice(&read(name, "config.json")).unwrap();
    let info = parse_hf_config(&original).unwrap();
    let model = load(name);
    let inputs = HfConfigInputs::from_info(&info);
    let written = hf_config_json(model.config(), &inputs, DType::F32).unwrap();
    let again = parse_hf_config(&written).unwrap();
    assert_eq!(again.config, info.config, "{name}: config round trip");
    let bytes = read(name, "model.safetensors");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let tensors = hf_tensors(&model).unwrap();
    assert_eq!(tensors.len(), st.names().len(), "{name}: tensor count");
    for t in tensors {
        let want = f32s(&st, &t.name);
        assert_eq!(t.values(), want, "{name}: {}", t.name);
    }
}

macro_rules! family_tests {
    ($($test:ident: $fixture:literal),* $(,)?) => {
        mod logits { $( #[test] fn $test() { super::check_logits($fixture); } )* }
        mod greedy { $( #[test] fn $test() { super::check_greedy($fixture); } )* }
        mod gradients { $( #[test] fn $test() { super::check_grads($fixture); } )* }
        mod round_trip { $( #[test] fn $test() { super::check_round_trip($fixture); } )* }
    };
}

family_tests! {
    olmo: "tiny-olmo",
    olmo2: "tiny-olmo2",
    gemma: "tiny-gemma",
    phi3: "tiny-phi3",
    starcoder2: "tiny-starcoder2",
    falcon: "tiny-falcon",
    bloom: "tiny-bloom",
    mixtral: "tiny-mixtral",
    qwen2_moe: "tiny-qwen2-moe",
    olmoe: "tiny-olmoe",
    deepseek_v2: "tiny-deepseek-v2",
    deepseek_v2_lite: "tiny-deepseek-v2-lite",
}

/// `model` with its MoE layers' balancing losses as the MoE fixtures' `aux_grads` computes
/// them: Megatron's `aux_loss` at 0.01 (the fixtures' `router_aux_loss_coef`; DeepSeek-V2's
/// HF config has no such key) and a z-loss of 1e-3.
fn with_balancing_losses(model: &GptModel) -> GptModel {
    let mut c = model.config().clone();
    let moe = c.moe.as_mut().expect("an MoE model");
    moe.load_balancing_type = LoadBalancing::AuxLoss;
    moe.aux_loss_coeff = 0.01;
    moe.z_loss_coeff = Some(1e-3);
    let params = (0..model.param_table().len())
        .map(|i| model.param_table().view(i).to_tensor())
        .collect();
    GptModel::new(c, params).unwrap()
}

/// The MoE fixtures with Megatron's balancing losses on: the LM loss as before, each layer's
/// aux and z losses, and the gradients of the total (the embedding's, which every layer's
/// losses reach, and each router's) vs PyTorch.
fn check_balancing_losses(name: &str) {
    let model = with_balancing_losses(&load(name));
    let batch = batch(name);
    let mut grads = model.zero_grads();
    let mut views: Vec<&mut [f32]> = grads.iter_mut().map(|g| g.as_mut_slice()).collect();
    let stats = model.forward_backward(&batch, &mut views, 1.0).unwrap();
    let bytes = read(name, "aux_grads.safetensors");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let close = |what: &str, got: f64, want: f32| {
        let err = (got - want as f64).abs() / (want as f64).abs();
        assert!(err <= 1e-5, "{name}: {what} {got} vs torch {want}");
    };
    close("lm loss", stats.loss as f64, f32s(&st, "lm_loss")[0]);
    let sum = |prefix: &str| -> f32 {
        st.names()
            .iter()
            .filter(|k| k.starts_with(prefix))
            .map(|k| f32s(&st, k)[0])
            .sum()
    };
    let moe = model.config().moe.as_ref().unwrap();
    let aux = stats.moe.load_balancing_loss * f64::from(moe.aux_loss_coeff);
    close("aux loss", aux, sum("aux."));
    close("z loss", stats.moe.z_loss * 1e-3, sum("z."));
    let moe_layers = model
        .layers()
        .iter()
        .filter(|l| matches!(l.mlp, LayerMlp::Moe(_)))
        .count();
    assert_eq!(
        stats.moe.layers, moe_layers as f64,
        "{name}: MoE layers counted"
    );
    let ours = hf_grads(&model, grads);
    let mut checked = 0;
    for key in st.names() {
        let Some(p) = key.strip_prefix("grad.") else {
            continue;
        };
        let (want, got) = (f32s(&st, key), &ours[p]);
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let diff = got
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            diff <= 1e-4 * scale,
            "{name}: grad {p} max diff {diff} (max |g| {scale})"
        );
        checked += 1;
    }
    assert_eq!(checked, moe_layers + 1, "{name}: gradients checked");
}

mod balancing_losses {
    #[test]
    fn mixtral() {
        super::check_balancing_losses("tiny-mixtral");
    }
    #[test]
    fn qwen2_moe() {
        super::check_balancing_losses("tiny-qwen2-moe");
    }
    #[test]
    fn olmoe() {
        super::check_balancing_losses("tiny-olmoe");
    }
    #[test]
    fn deepseek_v2() {
        super::check_balancing_losses("tiny-deepseek-v2");
    }
    #[test]
    fn deepseek_v2_lite() {
        super::check_balancing_losses("tiny-deepseek-v2-lite");
    }
}

#[test]
fn every_family_has_a_fixture() {
    for name in FAMILIES {
        assert!(fixture(name).join("config.json").is_file(), "{name}");
    }
}
