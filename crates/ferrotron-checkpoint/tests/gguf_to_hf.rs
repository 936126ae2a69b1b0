//! End-to-end conversion of synthetic tiny LLaMA GGUF files.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::{TinyOpts, expect_conversion_error, leftovers, tiny_llama, write};
use ferrotron_checkpoint::gguf::{GgmlType, GgufValue};
use ferrotron_checkpoint::{CheckpointError, GgufToHfOptions, OutputDtype, gguf_to_hf};
use safetensors::{Dtype, SafeTensors};

/// name -> (dtype, shape, values as f32)
fn read_safetensors(path: &Path) -> BTreeMap<String, (Dtype, Vec<u64>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let vals: Vec<f32> = match view.dtype() {
            Dtype::F32 => view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            Dtype::BF16 => view
                .data()
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::F16 => view
                .data()
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            d => panic!("unexpected dtype {d:?}"),
        };
        let shape = view.shape().iter().map(|&d| d as u64).collect();
        out.insert(name, (view.dtype(), shape, vals));
    }
    out
}

#[test]
fn tiny_llama_converts_bit_exactly() {
    let (b, expected) = tiny_llama(&TinyOpts::default());
    let dir = tempfile::tempdir().unwrap();
    let input = write(dir.path(), "in.gguf", &b.build());
    let out = dir.path().join("hf");
    let report = gguf_to_hf(&input, &out, &GgufToHfOptions::default()).unwrap();

    let got = read_safetensors(&out.join("model.safetensors"));
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        expected.keys().collect::<Vec<_>>()
    );
    assert!(
        !got.contains_key("lm_head.weight"),
        "tied model must not write lm_head"
    );
    for (name, (shape, vals)) in &expected {
        let (dtype, gshape, gvals) = &got[name];
        assert_eq!(*dtype, Dtype::F32, "{name}");
        assert_eq!(gshape, shape, "{name}");
        let same = gvals
            .iter()
            .zip(vals)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{name}: values differ");
    }
    // 2 layers x 9 + embed + norm
    assert_eq!(report.tensors_written, 20);
    assert_eq!(report.source_type_counts["F32"], 7);
    assert_eq!(report.source_type_counts["Q4_1"], 4);
    assert_eq!(report.source_type_counts["Q4_0"], 2);
    assert_eq!(report.source_type_counts["Q8_0"], 3);
    assert_eq!(report.source_type_counts["F16"], 2);
    assert_eq!(report.source_type_counts["BF16"], 2);
    assert_eq!(
        report.files,
        [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json"
        ]
    );
    let total: u64 = report
        .files
        .iter()
        .map(|f| std::fs::metadata(out.join(f)).unwrap().len())
        .sum();
    assert_eq!(report.bytes_written, total);
    assert_eq!(
        report.safetensors_bytes,
        std::fs::metadata(out.join("model.safetensors"))
            .unwrap()
            .len()
    );

    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg, report.config);
    assert_eq!(cfg["architectures"][0], "LlamaForCausalLM");
    assert_eq!(cfg["hidden_size"], 32);
    assert_eq!(cfg["intermediate_size"], 64);
    assert_eq!(cfg["num_hidden_layers"], 2);
    assert_eq!(cfg["num_attention_heads"], 4);
    assert_eq!(cfg["num_key_value_heads"], 2);
    assert_eq!(cfg["head_dim"], 8);
    assert_eq!(cfg["vocab_size"], 270);
    assert_eq!(cfg["max_position_embeddings"], 128);
    assert_eq!(cfg["rope_theta"], 100000.0);
    assert_eq!(cfg["rope_parameters"]["rope_theta"], 100000.0);
    assert_eq!(cfg["rms_norm_eps"], f64::from(1e-5f32));
    assert_eq!(cfg["tie_word_embeddings"], true);
    assert_eq!(cfg["bos_token_id"], 1);
    assert_eq!(cfg["eos_token_id"], 2);
    assert_eq!(cfg["pad_token_id"], 2);
    assert_eq!(cfg["torch_dtype"], "float32");

    let tok = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
    let enc = tok.encode("hello world<|im_end|>", true).unwrap();
    assert_eq!(enc.get_tokens(), ["hello", "Ġworld", "<|im_end|>"]);
    let tc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("tokenizer_config.json")).unwrap()).unwrap();
    assert_eq!(tc["bos_token"], "<|im_start|>");
    assert_eq!(tc["eos_token"], "<|im_end|>");
    assert_eq!(tc["unk_token"], "<|endoftext|>");
    assert_eq!(tc["add_bos_token"], false);
    assert_eq!(tc["model_max_length"], 128);
    assert!(tc["chat_template"].as_str().unwrap().contains("messages"));
    assert_eq!(
        leftovers(dir.path()),
        ["hf"],
        "no staging directory left behind"
    );
}

#[test]
fn qk_permutation_round_trips_for_mha_gqa_and_mqa() {
    // All-F32 storage: the HF q/k rows must come back exactly after llama.cpp's permutation.
    for (heads, kv) in [(4, 4), (4, 2), (4, 1), (2, 1)] {
        let opts = TinyOpts {
            heads,
            kv_heads: kv,
            layers: 1,
            types: BTreeMap::new(),
            ..TinyOpts::default()
        };
        let (b, expected) = tiny_llama(&opts);
        let dir = tempfile::tempdir().unwrap();
        let input = write(dir.path(), "in.gguf", &b.build());
        gguf_to_hf(&input, &dir.path().join("hf"), &GgufToHfOptions::default()).unwrap();
        let got = read_safetensors(&dir.path().join("hf/model.safetensors"));
        for name in [
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight",
        ] {
            assert_eq!(
                got[name].2, expected[name].1,
                "{name} heads={heads} kv={kv}"
            );
        }
    }
}

#[test]
fn untied_model_writes_lm_head() {
    let (b, expected) = tiny_llama(&TinyOpts {
        tied: false,
        ..TinyOpts::default()
    });
    let dir = tempfile::tempdir().unwrap();
    let input = write(dir.path(), "in.gguf", &b.build());
    let r = gguf_to_hf(&input, &dir.path().join("hf"), &GgufToHfOptions::default()).unwrap();
    assert_eq!(r.config["tie_word_embeddings"], false);
    let got = read_safetensors(&dir.path().join("hf/model.safetensors"));
    assert_eq!(got["lm_head.weight"].1, vec![270, 32]);
    assert_eq!(got["lm_head.weight"].2, expected["lm_head.weight"].1);
}

#[test]
fn bf16_and_f16_outputs_round_to_nearest_even() {
    let (b, expected) = tiny_llama(&TinyOpts::default());
    let dir = tempfile::tempdir().unwrap();
    let input = write(dir.path(), "in.gguf", &b.build());
    for (dtype, st, torch) in [
        (OutputDtype::BF16, Dtype::BF16, "bfloat16"),
        (OutputDtype::F16, Dtype::F16, "float16"),
    ] {
        let out = dir.path().join(torch);
        let opts = GgufToHfOptions {
            dtype,
            ..Default::default()
        };
        let r = gguf_to_hf(&input, &out, &opts).unwrap();
        assert_eq!(r.config["torch_dtype"], torch);
        let got = read_safetensors(&out.join("model.safetensors"));
        for (name, (_, vals)) in &expected {
            assert_eq!(got[name].0, st);
            let want: Vec<f32> = match dtype {
                OutputDtype::BF16 => vals
                    .iter()
                    .map(|&v| half::bf16::from_f32(v).to_f32())
                    .collect(),
                _ => vals
                    .iter()
                    .map(|&v| half::f16::from_f32(v).to_f32())
                    .collect(),
            };
            assert_eq!(got[name].2, want, "{name}");
        }
    }
}

#[test]
fn existing_output_needs_force() {
    let (b, _) = tiny_llama(&TinyOpts::default());
    let dir = tempfile::tempdir().unwrap();
    let input = write(dir.path(), "in.gguf", &b.build());
    let out = dir.path().join("hf");

    // An empty directory is fine.
    std::fs::create_dir(&out).unwrap();
    gguf_to_hf(&input, &out, &GgufToHfOptions::default()).unwrap();

    // A non-empty one is refused and left as it was.
    std::fs::write(out.join("keep.txt"), b"x").unwrap();
    let err = gguf_to_hf(&input, &out, &GgufToHfOptions::default()).unwrap_err();
    assert!(matches!(err, CheckpointError::OutputExists { .. }), "{err}");
    assert!(err.to_string().contains("not empty"), "{err}");
    assert!(out.join("keep.txt").exists());

    // With force it is replaced whole.
    let force = GgufToHfOptions {
        force: true,
        ..Default::default()
    };
    gguf_to_hf(&input, &out, &force).unwrap();
    assert!(!out.join("keep.txt").exists());
    assert!(out.join("model.safetensors").exists());

    // A file is never replaced.
    let file = write(dir.path(), "plain", b"x");
    let err = gguf_to_hf(&input, &file, &force).unwrap_err();
    assert!(err.to_string().contains("not a directory"), "{err}");
    let mut left = leftovers(dir.path());
    left.sort();
    assert_eq!(left, ["hf", "plain"]);
}

#[test]
fn unexpected_missing_and_misshapen_tensors_are_errors() {
    let (mut b, _) = tiny_llama(&TinyOpts::default());
    b.tensor("blk.0.attn_q.bias", &[32], GgmlType::F32, vec![0; 128]);
    expect_conversion_error(
        &b.build(),
        &["in.gguf", "tensor blk.0.attn_q.bias", "unexpected"],
    );

    let (mut b, _) = tiny_llama(&TinyOpts::default());
    b.tensor("blk.2.attn_norm.weight", &[32], GgmlType::F32, vec![0; 128]);
    expect_conversion_error(&b.build(), &["tensor blk.2.attn_norm.weight", "unexpected"]);

    let (mut b, _) = tiny_llama(&TinyOpts::default());
    b.tensor("rope_freqs.weight", &[4], GgmlType::F32, vec![0; 16]);
    expect_conversion_error(&b.build(), &["tensor rope_freqs.weight", "unexpected"]);

    let (mut b, _) = tiny_llama(&TinyOpts::default());
    b.tensors.retain(|t| t.name != "blk.1.ffn_up.weight");
    expect_conversion_error(&b.build(), &["tensor blk.1.ffn_up.weight", "missing"]);

    let (mut b, _) = tiny_llama(&TinyOpts::default());
    b.tensor_mut("blk.0.ffn_norm.weight").dims = vec![16];
    b.tensor_mut("blk.0.ffn_norm.weight").data.truncate(64);
    expect_conversion_error(
        &b.build(),
        &["tensor blk.0.ffn_norm.weight", "expected HF shape [32]"],
    );
}

#[test]
fn unsupported_quant_type_names_type_and_tensor() {
    // Q2_K needs rows of 256: use a 256-wide model and store one q_proj as Q2_K.
    let opts = TinyOpts {
        hidden: 256,
        heads: 4,
        kv_heads: 2,
        ffn: 256,
        layers: 1,
        types: BTreeMap::new(),
        ..TinyOpts::default()
    };
    let (mut b, _) = tiny_llama(&opts);
    let t = b.tensor_mut("blk.0.attn_q.weight");
    t.type_id = common::type_id(GgmlType::Q2_K);
    t.data = vec![0; 84 * 256];
    let err = expect_conversion_error(
        &b.build(),
        &["tensor blk.0.attn_q.weight", "Q2_K", "not supported"],
    );
    assert!(matches!(err, CheckpointError::UnsupportedType { .. }));
}

#[test]
fn metadata_errors_name_the_key() {
    let (mut b, _) = tiny_llama(&TinyOpts::default());
    b.kv("general.architecture", GgufValue::String("qwen2".into()));
    expect_conversion_error(
        &b.build(),
        &["metadata general.architecture", "qwen2", "llama"],
    );

    let (mut b, _) = tiny_llama(&TinyOpts::default());
    b.remove_kv("llama.block_count");
    expect_conversion_error(&b.build(), &["metadata llama.block_count", "missing"]);

    let (mut b, _) = tiny_llama(&TinyOpts::default());
    b.kv("llama.attention.head_count", GgufValue::String("4".into()));
    expect_conversion_error(
        &b.build(),
        &[
            "metadata llama.attention.head_count",
            "expected a non-negative integer",
        ],
    );

    let (mut b, _) = tiny_llama(&TinyOpts::default());
    b.kv("llama.attention.head_count_kv", GgufValue::U32(3));
    expect_conversion_error(
        &b.build(),
        &["llama.attention.head_count_kv", "does not divide"],
    );

    // Sizes from metadata never size an allocation: a huge layer count is just a missing tensor.
    let (mut b, _) = tiny_llama(&TinyOpts::default());
    b.kv("llama.block_count", GgufValue::U64(u64::MAX));
    expect_conversion_error(&b.build(), &["tensor blk.2.attn_norm.weight: missing"]);
    let (mut b, _) = tiny_llama(&TinyOpts::default());
    b.kv("llama.embedding_length", GgufValue::U64(1 << 62));
    expect_conversion_error(
        &b.build(),
        &[
            "tensor token_embd.weight",
            "expected HF shape [270, 4611686018427387904]",
        ],
    );

    let (mut b, _) = tiny_llama(&TinyOpts::default());
    b.kv("llama.rope.scaling.type", GgufValue::String("yarn".into()));
    expect_conversion_error(&b.build(), &["llama.rope.scaling.type", "yarn"]);

    let (mut b, _) = tiny_llama(&TinyOpts::default());
    b.kv("llama.expert_count", GgufValue::U32(8));
    expect_conversion_error(&b.build(), &["llama.expert_count", "mixture-of-experts"]);

    let (mut b, _) = tiny_llama(&TinyOpts::default());
    b.kv("tokenizer.ggml.model", GgufValue::String("llama".into()));
    expect_conversion_error(&b.build(), &["tokenizer", "\"llama\" is not supported"]);

    let (mut b, _) = tiny_llama(&TinyOpts::default());
    b.kv("tokenizer.ggml.eos_token_id", GgufValue::U32(100_000));
    expect_conversion_error(
        &b.build(),
        &["tokenizer.ggml.eos_token_id = 100000 is out of range"],
    );
}

#[test]
fn skip_tokenizer_writes_only_model_files() {
    let (mut b, _) = tiny_llama(&TinyOpts::default());
    b.kv("tokenizer.ggml.model", GgufValue::String("llama".into()));
    let dir = tempfile::tempdir().unwrap();
    let input = write(dir.path(), "in.gguf", &b.build());
    let opts = GgufToHfOptions {
        skip_tokenizer: true,
        ..Default::default()
    };
    let r = gguf_to_hf(&input, &dir.path().join("hf"), &opts).unwrap();
    assert_eq!(r.files, ["config.json", "model.safetensors"]);
    assert_eq!(r.added_tokens, None);
}

#[test]
fn linear_rope_scaling_is_carried() {
    let (mut b, _) = tiny_llama(&TinyOpts::default());
    b.kv(
        "llama.rope.scaling.type",
        GgufValue::String("linear".into()),
    );
    b.kv("llama.rope.scaling.factor", GgufValue::F32(4.0));
    let dir = tempfile::tempdir().unwrap();
    let input = write(dir.path(), "in.gguf", &b.build());
    let r = gguf_to_hf(&input, &dir.path().join("hf"), &GgufToHfOptions::default()).unwrap();
    assert_eq!(r.config["rope_scaling"]["rope_type"], "linear");
    assert_eq!(r.config["rope_scaling"]["factor"], 4.0);
    assert_eq!(r.config["rope_parameters"]["factor"], 4.0);
}
