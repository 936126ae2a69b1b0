//! The Megatron -> HF mapping (`families::hf_export`) inverts the HF -> Megatron loading on the
//! committed tiny fixtures (tools/make_fixtures.py), in memory: every HF tensor name and shape of
//! the original checkpoint comes back, re-packing gives bit-identical parameters, and
//! `config.json` parses back to the same `TransformerConfig`.

use ferrotron_model::families::{
    HfConfigInputs, WeightSource, gpt_model_from_hf, hf_config_json, hf_tensors, load_hf_model,
    parse_hf_config,
};
use ferrotron_model::{GptModel, Result};
use ferrotron_tensor::{DType, Tensor};
use safetensors::SafeTensors;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::PathBuf;

const FIXTURES: [&str; 4] = ["tiny-llama", "tiny-llama3", "tiny-qwen2", "tiny-mistral"];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

fn original_config(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture(name).join("config.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Name -> shape of every tensor in the fixture's safetensors file(s).
fn original_shapes(name: &str) -> BTreeMap<String, Vec<usize>> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let path = entry.unwrap().path();
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        if !file.starts_with("model") || !file.ends_with(".safetensors") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for (n, view) in st.tensors() {
            out.insert(n, view.shape().to_vec());
        }
    }
    out
}

/// HF tensors held in memory, as a [`WeightSource`].
struct MemSource(BTreeMap<String, Tensor>);

impl WeightSource for MemSource {
    fn take(&mut self, name: &str) -> Result<Option<Tensor>> {
        Ok(self.0.remove(name))
    }
    fn remaining(&self) -> Vec<String> {
        self.0.keys().cloned().collect()
    }
}

fn exported(model: &GptModel) -> MemSource {
    let tensors = hf_tensors(model).unwrap();
    MemSource(
        tensors
            .iter()
            .map(|t| {
                let values = t.values();
                assert_eq!(values.len(), t.numel(), "{}", t.name);
                (t.name.clone(), Tensor::from_f32(&t.shape, values).unwrap())
            })
            .collect(),
    )
}

fn flat_params(model: &GptModel) -> Vec<Vec<f32>> {
    let bufs: Vec<Vec<f32>> = model.parameters_f32();
    bufs
}

fn assert_bit_identical(a: &GptModel, b: &GptModel, what: &str) {
    let (pa, pb) = (flat_params(a), flat_params(b));
    assert_eq!(pa.len(), pb.len(), "{what}: parameter count");
    for ((info, x), y) in a.parameters().iter().zip(&pa).zip(&pb) {
        let same = x.iter().zip(y).all(|(u, v)| u.to_bits() == v.to_bits());
        assert!(same, "{what}: {} differs", info.name);
    }
}

#[test]
fn tensors_match_the_original_names_and_shapes() {
    for name in FIXTURES {
        let (model, _) = load_hf_model(&fixture(name), DType::F32).unwrap();
        let got: BTreeMap<String, Vec<usize>> = hf_tensors(&model)
            .unwrap()
            .into_iter()
            .map(|t| (t.name, t.shape))
            .collect();
        assert_eq!(got, original_shapes(name), "{name}");
    }
}

#[test]
fn repacking_the_exported_tensors_gives_bit_identical_parameters() {
    for name in FIXTURES {
        let (model, _) = load_hf_model(&fixture(name), DType::F32).unwrap();
        let mut src = exported(&model);
        let again = gpt_model_from_hf(model.config().clone(), &mut src).unwrap();
        assert_bit_identical(&model, &again, name);
    }
}

#[test]
fn bf16_storage_widens_exactly() {
    // tiny-llama3 is bf16 on disk: the bf16-stored model exports the same values as the f32 one.
    let (m32, _) = load_hf_model(&fixture("tiny-llama3"), DType::F32).unwrap();
    let (m16, _) = load_hf_model(&fixture("tiny-llama3"), DType::BF16).unwrap();
    let (a, b) = (hf_tensors(&m32).unwrap(), hf_tensors(&m16).unwrap());
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.name, y.name);
        assert_eq!(x.values(), y.values(), "{}", x.name);
    }
}

#[test]
fn config_json_parses_back_to_the_same_config() {
    for name in FIXTURES {
        let orig = original_config(name);
        let info = parse_hf_config(&orig).unwrap();
        let with_original = HfConfigInputs::from_original(orig.clone()).unwrap();
        let plain = HfConfigInputs::from_info(&info);
        for inputs in [with_original, plain] {
            let written = hf_config_json(&info.config, &inputs, DType::F32).unwrap();
            let back = parse_hf_config(&written).unwrap();
            assert_eq!(back, info, "{name}");
            assert_eq!(written["torch_dtype"], "float32");
            assert_eq!(written["dtype"], "float32");
        }
    }
}

#[test]
fn config_json_fields_are_what_transformers_reads() {
    let c = |name: &str| {
        let orig = original_config(name);
        let info = parse_hf_config(&orig).unwrap();
        let inputs = HfConfigInputs::from_original(orig).unwrap();
        hf_config_json(&info.config, &inputs, DType::BF16).unwrap()
    };
    let llama3 = c("tiny-llama3");
    let rope = json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
    assert_eq!(llama3["rope_parameters"], rope);
    assert_eq!(llama3["rope_scaling"]["rope_type"], "llama3");
    assert_eq!(llama3["rope_theta"], 500000.0);
    assert_eq!(llama3["tie_word_embeddings"], true);
    assert_eq!(llama3["torch_dtype"], "bfloat16");
    assert_eq!(
        llama3["rms_norm_eps"], 1e-5,
        "shortest f32 decimal, not 9.99e-6"
    );
    assert_eq!(llama3["head_dim"], 12);
    assert_eq!(llama3["attention_bias"], false);
    assert_eq!(llama3["eos_token_id"], 2);
    // Kept from the original: fields the mapping does not own; dropped: derived ones.
    assert_eq!(llama3["initializer_range"], 0.02);
    assert_eq!(llama3["pretraining_tp"], 1);
    assert!(llama3.get("transformers_version").is_none());

    let llama = c("tiny-llama");
    assert_eq!(llama["rope_scaling"], Value::Null);
    assert_eq!(llama["tie_word_embeddings"], false);

    let mistral = c("tiny-mistral");
    assert_eq!(mistral["sliding_window"], 8);
    assert_eq!(mistral["head_dim"], 24);

    let qwen = c("tiny-qwen2");
    assert_eq!(qwen["architectures"], json!(["Qwen2ForCausalLM"]));
    assert_eq!(qwen["use_sliding_window"], false);
    assert!(
        qwen.get("head_dim").is_none(),
        "hidden/heads is Qwen2's own default"
    );
    assert!(qwen.get("layer_types").is_none(), "derived by Qwen2Config");
    assert_eq!(qwen["max_window_layers"], 28);
}

#[test]
fn inexpressible_configs_and_mismatched_originals_are_errors_naming_the_field() {
    let orig = original_config("tiny-llama");
    let info = parse_hf_config(&orig).unwrap();
    let plain = HfConfigInputs::from_info(&info);

    let mut c = info.config.clone();
    c.add_proj_bias = true;
    let e = hf_config_json(&c, &plain, DType::F32)
        .unwrap_err()
        .to_string();
    assert!(e.contains("add_proj_bias"), "{e}");

    let mut c = info.config.clone();
    c.sliding_window = Some(4);
    let e = hf_config_json(&c, &plain, DType::F32)
        .unwrap_err()
        .to_string();
    assert!(e.contains("sliding_window"), "{e}");

    let mut c = info.config.clone();
    c.rotary_base = f32::NAN;
    let e = hf_config_json(&c, &plain, DType::F32)
        .unwrap_err()
        .to_string();
    assert!(e.contains("rotary_base"), "{e}");

    let qwen = HfConfigInputs::from_original(original_config("tiny-qwen2")).unwrap();
    let e = hf_config_json(&info.config, &qwen, DType::F32)
        .unwrap_err()
        .to_string();
    assert!(e.contains("architectures"), "{e}");

    let mut bad = orig.clone();
    bad["pad_token_id"] = json!("x");
    let e = HfConfigInputs::from_original(bad).unwrap_err().to_string();
    assert!(e.contains("pad_token_id"), "{e}");
}

#[test]
fn parameters_disagreeing_with_the_config_are_errors_naming_them() {
    let (model, _) = load_hf_model(&fixture("tiny-llama"), DType::F32).unwrap();
    let mut config = model.config().clone();
    let tensors = |m: &ferrotron_model::GptModel| -> Vec<ferrotron_tensor::Tensor> {
        m.parameters()
            .iter()
            .enumerate()
            .map(|(i, p)| {
                ferrotron_tensor::Tensor::from_f32(&p.shape, m.parameter_f32(i).unwrap()).unwrap()
            })
            .collect()
    };
    config.ffn_hidden_size += 2;
    let e = GptModel::new(config, tensors(&model))
        .unwrap_err()
        .to_string();
    assert!(e.contains("decoder.layers.0.mlp.linear_fc1.weight"), "{e}");

    let mut config = model.config().clone();
    config.add_qkv_bias = true;
    let e = GptModel::new(config, tensors(&model))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("parameter tensors given, the model declares"),
        "{e}"
    );
}

/// The config-only mapping agrees with the model: the parameters of `GptModel::parameters`
/// (names, shapes, order), the tensor-parallel splits of a tp-2 shard, and the HF tensors.
#[test]
fn config_mapping_matches_the_model_and_its_shards() {
    use ferrotron_model::families::param_mapping;
    use ferrotron_model::padded_vocab_size;
    use ferrotron_nn::TensorParallel;
    use std::sync::Arc;
    for name in FIXTURES {
        let (model, _) = load_hf_model(&fixture(name), DType::F32).unwrap();
        let c = model.config();
        let padded = padded_vocab_size(c.vocab_size, 128, 2);
        let mapping = param_mapping(c, padded).unwrap();
        let params = model.parameters();
        let got: Vec<(&str, &[usize])> = mapping
            .iter()
            .map(|m| (m.name.as_str(), m.shape.as_slice()))
            .collect();
        let want: Vec<(&str, &[usize])> = params
            .iter()
            .map(|p| (p.name.as_str(), p.shape.as_slice()))
            .collect();
        assert_eq!(got, want, "{name}");
        let hf: Vec<String> = mapping
            .iter()
            .flat_map(|m| m.hf.iter().map(|p| p.name.clone()))
            .collect();
        let exported: Vec<String> = hf_tensors(&model)
            .unwrap()
            .into_iter()
            .map(|t| t.name)
            .collect();
        assert_eq!(hf, exported, "{name}");
        let splits = ferrotron_comm::run_local(2, |comm| {
            let shard =
                model.tensor_parallel_shard(TensorParallel::new(Arc::new(comm), false), 128)?;
            let splits: Vec<_> = shard.layout().decls().iter().map(|d| d.split).collect();
            Ok::<_, ferrotron_model::ModelError>(splits)
        })
        .unwrap();
        let mapped: Vec<_> = mapping.iter().map(|m| m.split).collect();
        assert_eq!(mapped, splits[0], "{name}");
    }
}
