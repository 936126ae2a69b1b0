//! Upcycling a dense model into an MoE model (Megatron's `--moe-use-upcycling`): whole copies
//! under Mixtral's routing compute exactly the dense model; granular and pre-softmax
//! upcycling stay within Megatron's upcycling tolerance (`test_upcycling.py`: rtol = atol =
//! 0.1 on the logits); the result round-trips through HF as a Mixtral; bad options name
//! what is wrong.

mod common;

use ferrotron_model::families::{HfConfigInputs, hf_config_json, hf_tensors, parse_hf_config};
use ferrotron_model::{GptModel, InitConfig, KvCache, LogitsMode, ModelFamily, UpcycleOptions};
use ferrotron_tensor::DType;

fn options(num_experts: usize, topk: usize, granularity: usize) -> UpcycleOptions {
    UpcycleOptions {
        num_experts,
        topk,
        granularity,
        pre_softmax: false,
        aux_loss_coeff: 0.01,
        init: InitConfig::default(),
    }
}

fn logits(model: &GptModel, tokens: &[u32]) -> Vec<f32> {
    let mut cache = KvCache::new(model.config(), 1, tokens.len()).unwrap();
    model.forward(tokens, &mut cache, LogitsMode::All).unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// Max `|a - b| / (atol + rtol·|b|)` (≤ 1 passes `torch.allclose(a, b, rtol, atol)`).
fn allclose_ratio(a: &[f32], b: &[f32], rtol: f32, atol: f32) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / (atol + rtol * y.abs()))
        .fold(0.0, f32::max)
}

#[test]
fn whole_copies_under_softmax_routing_are_the_dense_model() {
    let dense = common::fixture("tiny-llama");
    let tokens = common::tokens(dense.config().vocab_size, 7, 24);
    let want = logits(&dense, &tokens);
    let moe = dense.upcycle(&options(4, 2, 1)).unwrap();
    assert_eq!(moe.config().family, ModelFamily::Mixtral);
    let m = moe.config().moe.as_ref().unwrap();
    assert_eq!((m.num_experts(), m.router.topk), (4, 2));
    assert_eq!(m.moe_ffn_hidden_size, dense.config().ffn_hidden_size);
    let got = logits(&moe, &tokens);
    let diff = got
        .iter()
        .zip(&want)
        .fold(0f32, |d, (a, b)| d.max((a - b).abs()));
    assert!(diff <= 1e-5, "max |logit diff| {diff}");
}

/// A dense model of the fixture's shape with Megatron's init (`N(0, 0.02)`), as Megatron's
/// upcycling test builds it: small pre-activations, where SwiGLU is close to homogeneous.
fn megatron_initialised() -> GptModel {
    let config = common::fixture("tiny-llama").config().clone();
    GptModel::init_random(config, InitConfig::default()).unwrap()
}

#[test]
fn granular_and_pre_softmax_upcycling_stay_within_megatrons_tolerance() {
    let dense = megatron_initialised();
    let tokens = common::tokens(dense.config().vocab_size, 11, 24);
    let want = logits(&dense, &tokens);
    let f = dense.config().ffn_hidden_size;
    // What the MLPs contribute to the logits: the dense model against itself without them.
    let mut no_mlp = dense.clone();
    for layer in dense.layers() {
        let fc2 = layer.mlp.linears()[1].weight;
        let zeros = vec![0f32; no_mlp.param_table().numel(fc2.index())];
        no_mlp
            .param_table_mut()
            .set_from_f32(fc2.index(), "linear_fc2", &zeros)
            .unwrap();
    }
    let mlp_effect = max_diff(&logits(&no_mlp, &tokens), &want);
    // Granularity 2: 8 experts of half the width, 4 copies of the two halves, top-2.
    let granular = dense.upcycle(&options(8, 2, 2)).unwrap();
    assert_eq!(
        granular.config().moe.as_ref().unwrap().moe_ffn_hidden_size,
        f / 2
    );
    let got = logits(&granular, &tokens);
    let diff = max_diff(&got, &want);
    eprintln!("granular: max |diff| {diff}, the MLPs' effect {mlp_effect}");
    let ratio = allclose_ratio(&got, &want, 0.1, 0.1);
    assert!(ratio <= 1.0, "granular: allclose ratio {ratio}");
    // Tighter than Megatron's check on small logits: within 5% of what the MLPs add (an
    // unscaled granular upcycle adds half of it).
    assert!(
        diff <= 0.05 * mlp_effect,
        "granular: {diff} vs {mlp_effect}"
    );
    let mut pre = options(4, 2, 1);
    pre.pre_softmax = true;
    let pre = dense.upcycle(&pre).unwrap();
    let got = logits(&pre, &tokens);
    let diff = max_diff(&got, &want);
    eprintln!("pre-softmax: max |diff| {diff}, the MLPs' effect {mlp_effect}");
    let ratio = allclose_ratio(&got, &want, 0.1, 0.1);
    assert!(ratio <= 1.0, "pre-softmax: allclose ratio {ratio}");
    // The top-k weights sum to about k/E, not exactly: within 25% of what the MLPs add.
    assert!(
        diff <= 0.25 * mlp_effect,
        "pre-softmax: {diff} vs {mlp_effect}"
    );
}

#[test]
fn an_upcycled_model_is_a_mixtral_for_hf() {
    let moe = common::fixture("tiny-llama")
        .upcycle(&options(4, 2, 1))
        .unwrap();
    let json = hf_config_json(moe.config(), &HfConfigInputs::default(), DType::F32).unwrap();
    assert_eq!(json["architectures"][0], "MixtralForCausalLM");
    assert_eq!(json["num_local_experts"], 4);
    assert_eq!(json["output_router_logits"], true);
    let back = parse_hf_config(&json).unwrap().config;
    assert_eq!(&back, moe.config());
    let names: Vec<String> = hf_tensors(&moe)
        .unwrap()
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert!(names.contains(&"model.layers.1.block_sparse_moe.experts.3.w2.weight".to_string()));
    assert!(names.contains(&"model.layers.0.block_sparse_moe.gate.weight".to_string()));
}

#[test]
fn bad_upcycling_options_say_what_is_wrong() {
    let dense = common::fixture("tiny-llama");
    let err = |o: UpcycleOptions| dense.upcycle(&o).unwrap_err().to_string();
    assert!(err(options(4, 2, 3)).contains("moe_upcycling_granularity"));
    assert!(err(options(4, 5, 1)).contains("moe_router_topk"));
    let moe = dense.upcycle(&options(4, 2, 1)).unwrap();
    assert!(
        moe.upcycle(&options(4, 2, 1))
            .unwrap_err()
            .to_string()
            .contains("dense")
    );
    // Pre-softmax routing is a Ferrotron model, but not a Mixtral HF config.
    let mut pre = options(4, 2, 1);
    pre.pre_softmax = true;
    let pre = dense.upcycle(&pre).unwrap();
    let e = hf_config_json(pre.config(), &HfConfigInputs::default(), DType::F32)
        .unwrap_err()
        .to_string();
    assert!(e.contains("moe_router_pre_softmax"), "{e}");
}
