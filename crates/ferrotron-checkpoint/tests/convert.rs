//! HF <-> distributed checkpoint conversion on the committed tiny fixtures: HF -> checkpoint at
//! tp x pp in {1, 2} x {1, 2} -> HF gives every tensor back bit for bit; the shards are the
//! layout's (files, fc1 gate/up boxes); a bf16 checkpoint round-trips bf16 values; bad input
//! (unused, missing or misshapen HF tensors, layouts the model cannot take, a non-empty
//! output) is an error naming the problem, with nothing written.

use ferrotron_checkpoint::convert::{HfToCkptOptions, ckpt_to_hf, hf_to_ckpt, plan_hf_to_ckpt};
use ferrotron_checkpoint::dist::{CheckpointReader, StoredDtype, iteration_dir, read_tracker};
use ferrotron_checkpoint::{HfExportOptions, OutputDtype};
use safetensors::SafeTensors;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const FIXTURES: [&str; 4] = ["tiny-llama", "tiny-llama3", "tiny-qwen2", "tiny-mistral"];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

/// Every tensor of the HF directory's `model*.safetensors`: name -> (dtype, shape, bytes).
fn hf_tensors(dir: &Path) -> BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        if !file.starts_with("model") || !file.ends_with(".safetensors") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for (n, view) in st.tensors() {
            let v = (
                view.dtype().to_string(),
                view.shape().to_vec(),
                view.data().to_vec(),
            );
            out.insert(n, v);
        }
    }
    out
}

fn layout(t: usize, p: usize) -> HfToCkptOptions {
    HfToCkptOptions {
        tensor_model_parallel_size: t,
        pipeline_model_parallel_size: p,
        ..HfToCkptOptions::default()
    }
}

#[test]
fn hf_to_ckpt_to_hf_is_bit_exact_at_every_layout() {
    let tmp = tempfile::tempdir().unwrap();
    for name in FIXTURES {
        for (t, p) in [(1, 1), (2, 1), (1, 2), (2, 2)] {
            round_trip(tmp.path(), name, t, p);
        }
    }
}

/// The seven families added as switches, at every layout their key/value heads allow (the
/// multi-query Gemma and Falcon fixtures have one group, so no tensor parallelism).
#[test]
fn families_hf_to_ckpt_to_hf_is_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, tensor_parallel) in [
        ("tiny-olmo", true),
        ("tiny-olmo2", true),
        ("tiny-gemma", false),
        ("tiny-phi3", true),
        ("tiny-starcoder2", true),
        ("tiny-falcon", false),
        ("tiny-bloom", true),
    ] {
        round_trip(tmp.path(), name, 1, 2);
        if tensor_parallel {
            round_trip(tmp.path(), name, 2, 2);
        }
    }
}

/// The MoE families (experts stacked per layer, split over tensor-parallel ranks by every
/// expert's gate and up blocks; DeepSeek-V2's multi-latent attention, its up projections
/// split by heads, the down projections and latent norms replicated), at tp 2 and pp 2 where
/// the layers divide.
#[test]
fn moe_families_hf_to_ckpt_to_hf_is_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, pipeline) in [
        ("tiny-mixtral", true),
        ("tiny-qwen2-moe", false),
        ("tiny-olmoe", true),
        ("tiny-deepseek-v2-lite", true),
        ("tiny-deepseek-v2", false),
    ] {
        round_trip(tmp.path(), name, 2, 1);
        if pipeline {
            round_trip(tmp.path(), name, 2, 2);
        }
    }
}

/// The experts laid out for expert parallelism (rank e's in `_ep{e}` files) with their
/// widths split over tp or whole (`expert_tensor_parallel_size` 1): HF -> checkpoint -> HF
/// is bit-exact, and the expert stacks' boxes are the layout's.
#[test]
fn expert_layouts_hf_to_ckpt_to_hf_are_bit_exact() {
    use ferrotron_model::module::ExpertTensorParallel::{Split, Whole};
    let tmp = tempfile::tempdir().unwrap();
    for (name, t, p, ep, etp) in [
        ("tiny-mixtral", 1, 1, 2, Split),
        ("tiny-mixtral", 2, 2, 2, Split),
        ("tiny-mixtral", 2, 1, 4, Whole),
        ("tiny-deepseek-v2", 2, 1, 4, Whole),
        ("tiny-deepseek-v2-lite", 2, 2, 2, Whole),
    ] {
        let label = format!("{name} tp{t} pp{p} ep{ep} {etp:?}");
        let opts = HfToCkptOptions {
            expert_model_parallel_size: ep,
            expert_tensor_parallel: etp,
            ..layout(t, p)
        };
        let ckpt = tmp.path().join(label.replace(' ', "-"));
        let report = hf_to_ckpt(&fixture(name), &ckpt, &opts).unwrap();
        // Per stage: t files of rank 0 (with everything else), then on a stage with MoE
        // layers (ep - 1) x (t, or 1 for whole experts) expert files.
        let c = ferrotron_model::families::read_hf_config(&fixture(name))
            .unwrap()
            .config;
        let per_stage = c.num_layers / p;
        let moe_stages = (0..p)
            .filter(|s| (s * per_stage..(s + 1) * per_stage).any(|l| c.is_moe_layer(l)))
            .count();
        let expert_files = moe_stages * (ep - 1) * if etp == Whole { 1 } else { t };
        assert_eq!(
            report.files.len(),
            p * t + expert_files,
            "{label}: {:?}",
            report.files
        );
        let reader = CheckpointReader::open(&iteration_dir(&ckpt, 0)).unwrap();
        let meta = reader.metadata();
        assert_eq!(meta.parallel.expert_model_parallel_size, ep, "{label}");
        // One box per expert-parallel rank, or per tp rank every expert's gate and up block.
        let stack = "model.decoder.layers.1.mlp.experts.linear_fc1.weight";
        let e = meta.tensors[stack].global_shape[0] / meta.tensors[stack].global_shape[1];
        let experts = match name {
            "tiny-mixtral" => 4,
            "tiny-deepseek-v2" => 8,
            _ => 6,
        };
        let boxes = if etp == Whole || t == 1 {
            ep
        } else {
            t * 2 * experts
        };
        assert_eq!(meta.tensors[stack].shards.len(), boxes, "{label} ({e})");
        let back = tmp.path().join(format!("{}-hf", label.replace(' ', "-")));
        ckpt_to_hf(&ckpt, &back, &HfExportOptions::default()).unwrap();
        let (want, got) = (hf_tensors(&fixture(name)), hf_tensors(&back));
        assert_eq!(got.len(), want.len(), "{label}");
        for (tensor, w) in &want {
            assert!(got[tensor] == *w, "{label}: {tensor} differs");
        }
    }
}

/// HF `name` -> a tp `t` x pp `p` checkpoint -> HF: every tensor and the config as before.
fn round_trip(tmp: &Path, name: &str, t: usize, p: usize) {
    let original = hf_tensors(&fixture(name));
    let label = format!("{name} tp{t} pp{p}");
    let ckpt = tmp.join(format!("{name}-{t}-{p}"));
    let report = hf_to_ckpt(&fixture(name), &ckpt, &layout(t, p)).unwrap();
    assert_eq!(read_tracker(&ckpt).unwrap(), Some(0), "{label}");
    let reader = CheckpointReader::open(&iteration_dir(&ckpt, 0)).unwrap();
    let meta = reader.metadata();
    assert_eq!(meta.parallel.tensor_model_parallel_size, t, "{label}");
    assert_eq!(meta.parallel.pipeline_model_parallel_size, p, "{label}");
    assert_eq!(report.files.len(), t * p, "{label}: {:?}", report.files);
    let config = |dir: &Path| {
        let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        ferrotron_model::families::parse_hf_config(&serde_json::from_str(&text).unwrap())
            .unwrap()
            .config
    };
    // A gated linear_fc1 splits its gate and up blocks separately.
    let blocks = if config(&fixture(name)).gated_linear_unit {
        2
    } else {
        1
    };
    let c = config(&fixture(name));
    // The first dense layer's linear_fc1, or layer 0's stacked experts (each expert's gate
    // and up blocks split).
    let (fc1, blocks) = match c.moe.as_ref().filter(|m| m.is_moe_layer(0)) {
        None => ("model.decoder.layers.0.mlp.linear_fc1.weight", blocks),
        Some(m) => (
            "model.decoder.layers.0.mlp.experts.linear_fc1.weight",
            2 * m.num_experts(),
        ),
    };
    assert_eq!(
        meta.tensors[fc1].shards.len(),
        if t == 1 { 1 } else { blocks * t },
        "{label}"
    );
    let back = tmp.join(format!("{name}-{t}-{p}-hf"));
    // Written back in the original's dtype (tiny-llama3 is bf16).
    let bf16 = original.values().all(|(d, _, _)| d == "BF16");
    let opts = HfExportOptions {
        max_shard_size: 40_000,
        dtype: if bf16 {
            OutputDtype::BF16
        } else {
            OutputDtype::F32
        },
        ..HfExportOptions::default()
    };
    ckpt_to_hf(&ckpt, &back, &opts).unwrap();
    let got = hf_tensors(&back);
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        original.keys().collect::<Vec<_>>(),
        "{label}"
    );
    for (tensor, want) in &original {
        assert!(got[tensor] == *want, "{label}: {tensor} differs");
    }
    assert_eq!(config(&back), config(&fixture(name)), "{label}");
    assert!(back.join("generation_config.json").is_file(), "{label}");
}

#[test]
fn bf16_checkpoints_store_bf16_rounded_values() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let opts = HfToCkptOptions {
        dtype: StoredDtype::BF16,
        ..layout(2, 1)
    };
    hf_to_ckpt(&fixture("tiny-llama"), &ckpt, &opts).unwrap();
    let back = tmp.path().join("hf");
    let export = HfExportOptions {
        dtype: OutputDtype::BF16,
        ..HfExportOptions::default()
    };
    ckpt_to_hf(&ckpt, &back, &export).unwrap();
    let original = hf_tensors(&fixture("tiny-llama"));
    for (name, (dtype, shape, bytes)) in hf_tensors(&back) {
        assert_eq!(dtype, "BF16");
        let (_, want_shape, want) = &original[&name];
        assert_eq!(&shape, want_shape);
        let want_bf16: Vec<u8> = want
            .chunks_exact(4)
            .flat_map(|b| {
                half::bf16::from_f32(f32::from_le_bytes(b.try_into().unwrap())).to_le_bytes()
            })
            .collect();
        assert!(bytes == want_bf16, "{name}");
    }
}

/// Copies the fixture's files into `dst`, rewriting `model.safetensors` with `edit` applied
/// to its (name -> (shape, f32 values)) map.
fn edited_fixture(
    dst: &Path,
    edit: impl FnOnce(&mut BTreeMap<String, (Vec<usize>, Vec<f32>)>),
) -> PathBuf {
    std::fs::create_dir_all(dst).unwrap();
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(fixture("tiny-llama").join(f), dst.join(f)).unwrap();
    }
    let mut tensors: BTreeMap<String, (Vec<usize>, Vec<f32>)> = hf_tensors(&fixture("tiny-llama"))
        .into_iter()
        .map(|(n, (_, shape, bytes))| {
            let v = bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (n, (shape, v))
        })
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, (shape, v))| {
            let bytes: &[u8] = bytemuck::cast_slice(v);
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                    .unwrap();
            (n.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dst.join("model.safetensors")).unwrap();
    dst.to_path_buf()
}

#[test]
fn bad_checkpoints_and_layouts_are_errors_naming_every_problem() {
    let tmp = tempfile::tempdir().unwrap();
    let bad = edited_fixture(&tmp.path().join("bad"), |t| {
        t.remove("model.layers.1.mlp.up_proj.weight");
        t.insert(
            "model.layers.0.extra.weight".into(),
            (vec![2], vec![1.0, 2.0]),
        );
        let k = t.get_mut("model.layers.0.self_attn.k_proj.weight").unwrap();
        k.0 = vec![k.0[1], k.0[0]];
    });
    let plan = plan_hf_to_ckpt(&bad, &layout(1, 1)).unwrap();
    let problems = plan.problems().join("\n");
    for needle in [
        "missing HF tensor model.layers.1.mlp.up_proj.weight",
        "unused HF tensor model.layers.0.extra.weight",
        "model.layers.0.self_attn.k_proj.weight: got",
    ] {
        assert!(problems.contains(needle), "{needle} not in\n{problems}");
    }
    let out = tmp.path().join("out");
    let e = hf_to_ckpt(&bad, &out, &layout(1, 1))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unused HF tensor model.layers.0.extra.weight"),
        "{e}"
    );
    assert!(!out.exists(), "nothing is written on error");

    // tiny-llama: 4 heads in 2 query groups, 2 layers.
    let e = hf_to_ckpt(&fixture("tiny-llama"), &out, &layout(4, 3))
        .unwrap_err()
        .to_string();
    assert!(e.contains("num_query_groups (2)"), "{e}");
    assert!(e.contains("pipeline"), "{e}");
    assert!(!out.exists());

    hf_to_ckpt(&fixture("tiny-llama"), &out, &layout(1, 1)).unwrap();
    let e = hf_to_ckpt(&fixture("tiny-llama"), &out, &layout(2, 1))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not empty"), "{e}");
    let forced = HfToCkptOptions {
        force: true,
        ..layout(2, 1)
    };
    hf_to_ckpt(&fixture("tiny-llama"), &out, &forced).unwrap();
    let reader = CheckpointReader::open(&iteration_dir(&out, 0)).unwrap();
    assert_eq!(reader.metadata().parallel.tensor_model_parallel_size, 2);

    let e = ckpt_to_hf(
        &tmp.path().join("bad"),
        &tmp.path().join("x"),
        &HfExportOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("not a checkpoint"), "{e}");
}

/// A tp 2 x pp 2 checkpoint resharded to tp 1 x pp 1 and to tp 2 x pp 1 (and that to tp 1 x
/// pp 2) converts back to the original HF tensors bit for bit.
#[test]
fn resharding_keeps_every_tensor() {
    use ferrotron_checkpoint::convert::{plan_reshard, reshard_ckpt};
    let tmp = tempfile::tempdir().unwrap();
    for name in ["tiny-qwen2", "tiny-llama3"] {
        let original = hf_tensors(&fixture(name));
        let bf16 = original.values().all(|(d, _, _)| d == "BF16");
        let src = tmp.path().join(format!("{name}-src"));
        hf_to_ckpt(&fixture(name), &src, &layout(2, 2)).unwrap();
        let mut from = src;
        for (k, (t, p)) in [(1, 1), (2, 1), (1, 2)].into_iter().enumerate() {
            let plan = plan_reshard(&from, &layout(t, p)).unwrap();
            assert!(plan.problems().is_empty(), "{:?}", plan.problems());
            assert_eq!(plan.files.len(), t * p);
            let to = tmp.path().join(format!("{name}-{k}"));
            reshard_ckpt(&from, &to, &layout(t, p)).unwrap();
            let meta = CheckpointReader::open(&iteration_dir(&to, 0)).unwrap();
            assert_eq!(meta.metadata().parallel.tensor_model_parallel_size, t);
            let back = tmp.path().join(format!("{name}-{k}-hf"));
            let opts = HfExportOptions {
                dtype: if bf16 {
                    OutputDtype::BF16
                } else {
                    OutputDtype::F32
                },
                ..HfExportOptions::default()
            };
            ckpt_to_hf(&to, &back, &opts).unwrap();
            let got = hf_tensors(&back);
            assert_eq!(got.len(), original.len(), "{name} -> tp{t} pp{p}");
            for (tensor, want) in &original {
                assert!(
                    got[tensor] == *want,
                    "{name} -> tp{t} pp{p}: {tensor} differs"
                );
            }
            from = to;
        }
    }
}
