//! Parity with Megatron-Core 0.16.1 itself: `fixtures/gpt_dataset/reference.json` holds indices
//! and samples produced by megatron-core's `GPTDataset` / `BlendedMegatronDatasetBuilder` /
//! `helpers_cpp` and NumPy's `RandomState` on the datasets `a` and `b` written by Megatron's
//! `IndexedDatasetBuilder` (regenerate with `tools/make_gpt_index_fixture.py`).

use ferrotron_data::blended::{
    build_blending_indices, build_exhaustive_blending_indices, sizes_per_dataset,
};
use ferrotron_data::gpt_dataset::cache::sha256_hex;
use ferrotron_data::gpt_dataset::numpy_rng::RandomState;
use ferrotron_data::gpt_dataset::parse_and_normalize_split;
use ferrotron_data::indexed::IndexedDataset;
use ferrotron_data::{Blend, Dataset, GptDataset, GptDatasetConfig, Split, build_gpt_datasets};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gpt_dataset")
}

fn reference() -> Value {
    let text = std::fs::read_to_string(fixtures().join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ints(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

fn split_of(name: &str) -> Split {
    match name {
        "train" => Split::Train,
        "valid" => Split::Valid,
        _ => Split::Test,
    }
}

fn config_of(c: &Value, eod: u32) -> GptDatasetConfig {
    let flag = |k: &str| c[k].as_bool().unwrap();
    let mut cfg = GptDatasetConfig::new(
        c["seq_length"].as_u64().unwrap() as usize,
        c["seed"].as_u64().unwrap() as u32,
        eod,
    );
    cfg.split = c["split"].as_str().unwrap().to_string();
    cfg.reset_position_ids = flag("reset_position_ids");
    cfg.reset_attention_mask = flag("reset_attention_mask");
    cfg.eod_mask_loss = flag("eod_mask_loss");
    cfg.add_extra_token_to_sequence = flag("add_extra_token_to_sequence");
    cfg.drop_last_partial_validation_sequence = flag("drop_last_partial_validation_sequence");
    cfg
}

#[test]
fn gpt_indices_and_samples_equal_megatron() {
    let r = reference();
    let eod = r["eod"].as_u64().unwrap() as u32;
    let cases = r["gpt"].as_array().unwrap();
    assert!(cases.len() >= 8);
    for c in cases {
        let name = c["name"].as_str().unwrap();
        let prefix = fixtures().join(c["prefix"].as_str().unwrap());
        let indexed = Arc::new(IndexedDataset::open(&prefix).unwrap());
        let num_samples = c["num_samples"].as_u64().map(|n| n as usize);
        let split = split_of(c["index_split"].as_str().unwrap());
        let ds = GptDataset::build(indexed, split, num_samples, &config_of(c, eod)).unwrap();

        let docs = ints(&c["split_indices"]);
        assert_eq!(ds.documents(), docs[0] as usize..docs[1] as usize, "{name}");
        assert_eq!(ds.len() as i64, c["len"].as_i64().unwrap(), "{name}: len");
        let doc: Vec<i64> = ds.document_index().iter().map(|&d| d as i64).collect();
        assert_eq!(doc, ints(&c["document_index"]), "{name}: document_index");
        let sample: Vec<i64> = ds
            .sample_index()
            .iter()
            .flatten()
            .map(|&d| d as i64)
            .collect();
        let want: Vec<i64> = c["sample_index"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(ints)
            .collect();
        assert_eq!(sample, want, "{name}: sample_index");
        let shuffle: Vec<i64> = ds.shuffle_index().iter().map(|&d| d as i64).collect();
        assert_eq!(shuffle, ints(&c["shuffle_index"]), "{name}: shuffle_index");

        for (i, want) in c["samples"].as_object().unwrap() {
            let s = ds.get(i.parse().unwrap()).unwrap();
            let u = |v: &[u32]| v.iter().map(|&x| x as i64).collect::<Vec<_>>();
            assert_eq!(u(&s.tokens), ints(&want["tokens"]), "{name}[{i}] tokens");
            assert_eq!(u(&s.labels), ints(&want["labels"]), "{name}[{i}] labels");
            let mask: Vec<f64> = want["loss_mask"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            let got: Vec<f64> = s.loss_mask.iter().map(|&x| x as f64).collect();
            assert_eq!(got, mask, "{name}[{i}] loss_mask");
            assert_eq!(
                u(&s.position_ids),
                ints(&want["position_ids"]),
                "{name}[{i}] pos"
            );
            assert_eq!(
                u(&s.attention_row_starts()),
                ints(&want["attention_row_start"]),
                "{name}[{i}] attention"
            );
        }
    }
}

#[test]
fn weighted_blend_equals_megatron_builder() {
    let r = reference();
    let b = &r["blend"];
    let mut cfg = GptDatasetConfig::new(8, 7, r["eod"].as_u64().unwrap() as u32);
    cfg.split = b["split"].as_str().unwrap().into();
    let blend = Blend {
        prefixes: vec![fixtures().join("a"), fixtures().join("b")],
        weights: Some(vec![0.3, 0.7]),
    };
    let [train, valid, test] =
        build_gpt_datasets(&blend, [Some(300), Some(31), Some(0)], &cfg).unwrap();
    assert!(test.is_none());
    for (name, ds) in [("train", train.unwrap()), ("valid", valid.unwrap())] {
        let want = &b[name];
        assert_eq!(ds.len() as i64, want["len"].as_i64().unwrap(), "{name}");
        let ferrotron_data::blended::BuiltDataset::Blended(bl) = &*ds else {
            panic!("{name}: expected a blend");
        };
        let di: Vec<i64> = bl.dataset_index().iter().map(|&d| d as i64).collect();
        assert_eq!(di, ints(&want["dataset_index"]), "{name} dataset_index");
        let dsi: Vec<i64> = bl
            .dataset_sample_index()
            .iter()
            .map(|&d| d as i64)
            .collect();
        assert_eq!(
            dsi,
            ints(&want["dataset_sample_index"]),
            "{name} sample index"
        );
        let lens: Vec<i64> = bl.datasets().iter().map(|d| d.len() as i64).collect();
        assert_eq!(lens, ints(&want["dataset_len"]), "{name} dataset lengths");
        let requested: Vec<i64> = bl
            .datasets()
            .iter()
            .map(|d| d.description()["num_samples"].as_i64().unwrap())
            .collect();
        assert_eq!(
            requested,
            ints(&want["dataset_num_samples"]),
            "{name} surplus"
        );
        let tokens: Vec<i64> = ds
            .get(0)
            .unwrap()
            .tokens
            .iter()
            .map(|&t| t as i64)
            .collect();
        assert_eq!(tokens, ints(&want["sample_0_tokens"]), "{name} sample 0");
    }
    assert_eq!(sizes_per_dataset(&[0.3, 0.7], 300, 0.005), [91, 212]);
}

#[test]
fn blending_helpers_equal_megatron() {
    let r = reference();
    for c in r["blending_indices"].as_array().unwrap() {
        let w: Vec<f64> = c["weights"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let (di, dsi) = build_blending_indices(&w, c["size"].as_u64().unwrap() as usize);
        assert_eq!(
            di.iter().map(|&d| d as i64).collect::<Vec<_>>(),
            ints(&c["dataset_index"])
        );
        assert_eq!(
            dsi.iter().map(|&d| d as i64).collect::<Vec<_>>(),
            ints(&c["dataset_sample_index"])
        );
    }
    for c in r["exhaustive_blending_indices"].as_array().unwrap() {
        let sizes: Vec<usize> = ints(&c["sizes"]).iter().map(|&s| s as usize).collect();
        let (di, dsi) = build_exhaustive_blending_indices(&sizes);
        assert_eq!(
            di.iter().map(|&d| d as i64).collect::<Vec<_>>(),
            ints(&c["dataset_index"])
        );
        assert_eq!(
            dsi.iter().map(|&d| d as i64).collect::<Vec<_>>(),
            ints(&c["dataset_sample_index"])
        );
    }
}

#[test]
fn split_parsing_equals_megatron() {
    let r = reference();
    for (s, want) in r["parse_and_normalize_split"].as_object().unwrap() {
        let want: Vec<f64> = want
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(parse_and_normalize_split(s).unwrap().to_vec(), want, "{s}");
    }
}

#[test]
fn random_state_shuffle_equals_numpy() {
    let r = reference();
    for c in r["random_state_shuffle"].as_array().unwrap() {
        let seed = c["seed"].as_u64().unwrap() as u32;
        let mut rng = RandomState::new(seed);
        if let Some(ns) = c["n"].as_array() {
            // Consecutive shuffles from one state.
            for (n, want) in ns.iter().zip(c["permutation"].as_array().unwrap()) {
                let mut x: Vec<i64> = (0..n.as_i64().unwrap()).collect();
                rng.shuffle(&mut x);
                assert_eq!(x, ints(want), "seed {seed}");
            }
            continue;
        }
        let n = c["n"].as_i64().unwrap();
        let mut x: Vec<i64> = (0..n).collect();
        rng.shuffle(&mut x);
        if let Some(p) = c.get("permutation") {
            assert_eq!(x, ints(p), "seed {seed} n {n}");
        } else {
            let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
            assert_eq!(
                sha256_hex(&bytes),
                c["sha256_le_i64"].as_str().unwrap(),
                "seed {seed} n {n}"
            );
        }
    }
}
