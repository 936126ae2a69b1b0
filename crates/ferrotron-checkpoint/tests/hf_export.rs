//! `export_hf` on the committed tiny fixtures (tools/make_fixtures.py): load -> export -> load
//! gives bit-identical parameters and identical logits; the files hold exactly the original HF
//! tensor names and shapes; sharded exports index every tensor once; outputs are atomic.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use ferrotron_checkpoint::{
    CheckpointError, HfExportOptions, HfExportSource, OutputDtype, export_hf,
};
use ferrotron_model::families::load_hf_model;
use ferrotron_model::{GptModel, KvCache, LogitsMode};
use ferrotron_tensor::DType;
use safetensors::SafeTensors;
use serde_json::Value;

const FIXTURES: [&str; 4] = ["tiny-llama", "tiny-llama3", "tiny-qwen2", "tiny-mistral"];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&fs::read_to_string(path).unwrap()).unwrap()
}

/// Safetensors file name -> (tensor name -> shape) for every `model*.safetensors` in `dir`.
fn headers(dir: &Path) -> BTreeMap<String, BTreeMap<String, Vec<usize>>> {
    let mut out = BTreeMap::new();
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        if file.starts_with("model") && file.ends_with(".safetensors") {
            let bytes = fs::read(&path).unwrap();
            let st = SafeTensors::deserialize(&bytes).unwrap();
            let shapes = st
                .tensors()
                .into_iter()
                .map(|(n, v)| (n, v.shape().to_vec()))
                .collect();
            out.insert(file, shapes);
        }
    }
    out
}

fn all_shapes(dir: &Path) -> BTreeMap<String, Vec<usize>> {
    headers(dir).into_values().flatten().collect()
}

fn flat_params(model: &GptModel) -> Vec<Vec<f32>> {
    let bufs: Vec<Vec<f32>> = model.parameters_f32();
    bufs
}

fn logits(model: &GptModel) -> Vec<f32> {
    let (b, s) = (2, 24);
    let v = model.config().vocab_size as u32;
    let ids: Vec<u32> = (0..b * s as u32).map(|i| (i * 37 + 11) % v).collect();
    let mut cache = KvCache::new(model.config(), b as usize, s as usize).unwrap();
    model.forward(&ids, &mut cache, LogitsMode::All).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Loads `src`, exports it to `out` with `opts`, reloads, and checks parameters and logits are
/// bit-identical. Returns the reloaded model.
fn round_trip(src: &Path, out: &Path, opts: &HfExportOptions) -> GptModel {
    let (model, _) = load_hf_model(src, DType::F32).unwrap();
    let source = HfExportSource::from_dir(src).unwrap();
    let report = export_hf(&model, &source, out, opts).unwrap();
    assert_eq!(report.output, out);
    let (again, _) = load_hf_model(out, DType::F32).unwrap();
    for ((info, a), b) in model
        .parameters()
        .iter()
        .zip(flat_params(&model))
        .zip(flat_params(&again))
    {
        assert_eq!(
            bits(&a),
            bits(&b),
            "{}: {} differs",
            src.display(),
            info.name
        );
    }
    assert_eq!(
        bits(&logits(&model)),
        bits(&logits(&again)),
        "{}",
        src.display()
    );
    again
}

#[test]
fn round_trip_is_bit_identical_with_the_original_tensor_names_and_shapes() {
    let tmp = tempfile::tempdir().unwrap();
    for name in FIXTURES {
        let out = tmp.path().join(name);
        round_trip(&fixture(name), &out, &HfExportOptions::default());
        assert_eq!(all_shapes(&out), all_shapes(&fixture(name)), "{name}");
        assert!(out.join("model.safetensors").is_file(), "{name}: one file");
        assert!(!out.join("model.safetensors.index.json").exists(), "{name}");
        assert_eq!(
            read_json(&out.join("generation_config.json")),
            read_json(&fixture(name).join("generation_config.json")),
            "{name}"
        );
        let config = read_json(&out.join("config.json"));
        assert_eq!(config["torch_dtype"], "float32", "{name}");
    }
}

#[test]
fn sharded_export_indexes_every_tensor_once() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("qwen2");
    let opts = HfExportOptions {
        max_shard_size: 40_000,
        ..Default::default()
    };
    round_trip(&fixture("tiny-qwen2"), &out, &opts);
    let headers = headers(&out);
    assert!(headers.len() > 2, "{} shards", headers.len());
    let index = read_json(&out.join("model.safetensors.index.json"));
    let weight_map = index["weight_map"].as_object().unwrap();
    let mut from_files = BTreeMap::new();
    let mut total = 0;
    let n = headers.len();
    for (i, (file, shapes)) in headers.iter().enumerate() {
        assert_eq!(file, &format!("model-{:05}-of-{n:05}.safetensors", i + 1));
        let bytes: usize = shapes
            .values()
            .map(|s| s.iter().product::<usize>() * 4)
            .sum();
        assert!(
            bytes <= 40_000 || shapes.len() == 1,
            "{file}: {bytes} bytes"
        );
        total += bytes;
        for t in shapes.keys() {
            assert!(
                from_files.insert(t.clone(), file.clone()).is_none(),
                "{t} twice"
            );
        }
    }
    let listed: BTreeMap<String, String> = weight_map
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
        .collect();
    assert_eq!(listed, from_files);
    assert_eq!(index["metadata"]["total_size"], total);
    assert_eq!(all_shapes(&out), all_shapes(&fixture("tiny-qwen2")));
}

#[test]
fn bf16_export_of_a_bf16_checkpoint_is_lossless() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("llama3-bf16");
    let opts = HfExportOptions {
        dtype: OutputDtype::BF16,
        ..Default::default()
    };
    round_trip(&fixture("tiny-llama3"), &out, &opts);
    assert_eq!(
        read_json(&out.join("config.json"))["torch_dtype"],
        "bfloat16"
    );
    let bytes = fs::read(out.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert!(
        st.tensors()
            .iter()
            .all(|(_, v)| v.dtype() == safetensors::Dtype::BF16)
    );
}

#[test]
fn tokenizer_files_are_copied() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = tmp.path().join("tok");
    fs::create_dir(&tok).unwrap();
    fs::write(tok.join("tokenizer.json"), b"{\"version\": \"1.0\"}").unwrap();
    fs::write(tok.join("tokenizer_config.json"), b"{}").unwrap();
    fs::write(tok.join("unrelated.txt"), b"x").unwrap();
    let out = tmp.path().join("out");
    let opts = HfExportOptions {
        tokenizer_dir: Some(tok.clone()),
        ..Default::default()
    };
    round_trip(&fixture("tiny-llama"), &out, &opts);
    assert_eq!(
        fs::read(out.join("tokenizer.json")).unwrap(),
        fs::read(tok.join("tokenizer.json")).unwrap()
    );
    assert!(out.join("tokenizer_config.json").is_file());
    assert!(!out.join("unrelated.txt").exists());

    let empty = tmp.path().join("empty");
    fs::create_dir(&empty).unwrap();
    let (model, info) = load_hf_model(&fixture("tiny-llama"), DType::F32).unwrap();
    let source = HfExportSource {
        config: ferrotron_model::families::HfConfigInputs::from_info(&info),
        generation_config: None,
    };
    let bad = HfExportOptions {
        tokenizer_dir: Some(empty.clone()),
        ..Default::default()
    };
    let e = export_hf(&model, &source, &tmp.path().join("x"), &bad).unwrap_err();
    assert!(e.to_string().contains("tokenizer_dir"), "{e}");
    assert!(!tmp.path().join("x").exists());
}

#[test]
fn non_empty_output_needs_force_and_errors_leave_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixture("tiny-mistral");
    let (model, _) = load_hf_model(&src, DType::F32).unwrap();
    let source = HfExportSource::from_dir(&src).unwrap();
    let out = tmp.path().join("out");
    fs::create_dir(&out).unwrap();
    fs::write(out.join("keep.txt"), b"old").unwrap();
    let e = export_hf(&model, &source, &out, &HfExportOptions::default()).unwrap_err();
    assert!(matches!(e, CheckpointError::OutputExists { .. }), "{e}");
    assert_eq!(fs::read(out.join("keep.txt")).unwrap(), b"old");

    let force = HfExportOptions {
        force: true,
        ..Default::default()
    };
    let report = export_hf(&model, &source, &out, &force).unwrap();
    assert!(!out.join("keep.txt").exists());
    assert_eq!(report.shards, 1);
    assert!(report.files.contains(&"config.json".to_string()));

    let zero = HfExportOptions {
        max_shard_size: 0,
        ..Default::default()
    };
    let e = export_hf(&model, &source, &tmp.path().join("z"), &zero).unwrap_err();
    assert!(e.to_string().contains("max_shard_size"), "{e}");

    // A pipeline stage is not a whole model.
    let stage = model.pipeline_stage(0..1, true, false).unwrap();
    let e = export_hf(&stage, &source, &tmp.path().join("b"), &force).unwrap_err();
    assert!(e.to_string().contains("whole model"), "{e}");
    let leftovers: Vec<_> = fs::read_dir(tmp.path()).unwrap().collect();
    assert_eq!(
        leftovers.len(),
        1,
        "only `out`: no staging dirs, no `z` or `b`"
    );
}
