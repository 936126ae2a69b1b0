//! LoRA against HF PEFT on the committed fixtures (`tools/make_lora_fixture.py`: PEFT 0.21.2
//! adapters on every projection of tiny-llama and tiny-qwen2, q/k/v and gate/up sharing
//! `lora_A`, random `lora_B`): the adapter read onto the base gives PEFT's logits, loss and
//! every adapter gradient; written back, it is PEFT's adapter tensor for tensor; merged, it
//! gives the same logits without adapters. Served (`PeftAdapter::served_weights`), adapters
//! as PEFT trains them — every projection with its own `lora_A`, or only q and v adapted
//! (`tools/make_served_lora_fixture.py`) — give PEFT's logits too, and so does the fused
//! fixture.

use std::collections::HashMap;
use std::path::PathBuf;

use ferrotron_checkpoint::peft::PeftAdapter;
use ferrotron_checkpoint::write_peft_adapter;
use ferrotron_model::families::load_hf_model;
use ferrotron_model::lora::LoraWeights;
use ferrotron_model::module::ParamRole;
use ferrotron_model::{GptModel, KvCache, LogitsMode, NewTokens, TrainBatch};
use ferrotron_tensor::DType;
use ferrotron_tensor::ops::IGNORE_INDEX;
use safetensors::SafeTensors;

const MODELS: [&str; 2] = ["tiny-llama", "tiny-qwen2"];

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

/// A safetensors file's tensors: shape and raw little-endian bytes by name.
type Tensors = HashMap<String, (Vec<usize>, Vec<u8>)>;

/// Every tensor of a safetensors file.
fn read(path: PathBuf) -> Tensors {
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.shape().to_vec(), v.data().to_vec())))
        .collect()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// The base model with the fixture's PEFT adapter, the adapter, and the reference tensors.
fn adapted(name: &str) -> (GptModel, PeftAdapter, Tensors) {
    let (base, _) = load_hf_model(&fixtures().join(name), DType::F32).unwrap();
    let adapter = PeftAdapter::read(&fixtures().join("lora").join(name)).unwrap();
    let model = adapter.apply_to(base).unwrap();
    let reference = read(
        fixtures()
            .join("lora")
            .join(name)
            .join("reference.safetensors"),
    );
    (model, adapter, reference)
}

/// The tiny fixture's input ids `[b, s]`.
fn input_ids(name: &str) -> (Vec<u32>, usize, usize) {
    let t = read(fixtures().join(name).join("reference.safetensors"));
    let (shape, bytes) = &t["input_ids"];
    let ids = bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32);
    (ids.collect(), shape[0], shape[1])
}

/// Logits `[b, s, v]` of `model` on the fixture's inputs.
fn logits(model: &GptModel, name: &str) -> Vec<f32> {
    logits_with(model, None, name)
}

/// Logits `[b, s, v]` of `model` with the served adapter `lora` on the fixture's inputs.
fn logits_with(model: &GptModel, lora: Option<&LoraWeights>, name: &str) -> Vec<f32> {
    let (ids, b, s) = input_ids(name);
    let sb: Vec<u32> = (0..s * b).map(|i| ids[(i % b) * s + i / b]).collect();
    let mut cache = KvCache::new(model.config(), b, s).unwrap();
    let out = model
        .forward_with_lora(&sb, &mut cache, LogitsMode::All, lora, NewTokens::Any)
        .unwrap();
    let v = model.config().vocab_size;
    let mut bsv = vec![0f32; out.len()];
    for t in 0..s {
        for j in 0..b {
            bsv[(j * s + t) * v..][..v].copy_from_slice(&out[(t * b + j) * v..][..v]);
        }
    }
    bsv
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn peft_adapters_give_pefts_logits_and_merge_to_them() {
    for name in MODELS {
        let (model, _, reference) = adapted(name);
        let want = f32s(&reference["logits"].1);
        let (base, _) = load_hf_model(&fixtures().join(name), DType::F32).unwrap();
        assert!(
            max_diff(&logits(&base, name), &want) > 1e-2,
            "{name}: the adapter matters"
        );
        let got = logits(&model, name);
        let d = max_diff(&got, &want);
        assert!(d < 1e-4, "{name}: logits differ from PEFT's by {d}");
        let merged = model.merge_lora().unwrap();
        assert!(merged.config().lora.is_none());
        assert_eq!(
            merged.parameters().len(),
            load_hf_model(&fixtures().join(name), DType::F32)
                .unwrap()
                .0
                .parameters()
                .len()
        );
        let d = max_diff(&logits(&merged, name), &want);
        assert!(d < 1e-4, "{name}: merged logits differ from PEFT's by {d}");
    }
}

#[test]
fn adapter_gradients_match_peft() {
    for name in MODELS {
        let (model, _, reference) = adapted(name);
        let (ids, b, s) = input_ids(name);
        let labels: Vec<i64> = (0..b * s)
            .map(|i| {
                if i % s == s - 1 {
                    IGNORE_INDEX
                } else {
                    ids[i + 1] as i64
                }
            })
            .collect();
        let batch = TrainBatch::from_batch_major(&ids, &labels, None, b, s);
        let mut grads = model.zero_grads();
        let mut views: Vec<&mut [f32]> = grads.iter_mut().map(|g| g.as_mut_slice()).collect();
        let loss = model
            .forward_backward(&batch, &mut views, 1.0)
            .unwrap()
            .loss;
        let want_loss = f32s(&reference["loss"].1)[0];
        assert!(
            (loss - want_loss).abs() < 1e-5,
            "{name}: loss {loss} vs PEFT {want_loss}"
        );
        // Only the adapters have gradients.
        for (p, g) in model.parameters().iter().zip(&grads) {
            assert_eq!(p.frozen, g.is_empty(), "{}", p.name);
        }
        let checked = assert_peft_grads(name, &model, &grads, &reference);
        assert_eq!(checked, 28, "{name}: 2 layers x 7 projections x (A, B)");
    }
}

/// Checks `grads` (the model's, table order) against PEFT's `grad.<adapter tensor>` entries of
/// `reference`: each lora_B exactly as PEFT's, each fused layer's shared lora_A as the sum of
/// its projections' lora_A gradients. Returns the tensors checked.
fn assert_peft_grads(
    name: &str,
    model: &GptModel,
    grads: &[Vec<f32>],
    reference: &Tensors,
) -> usize {
    let mut as_values = model.clone();
    let adapters: Vec<usize> = (0..grads.len())
        .filter(|&i| model.layout().decls()[i].role == ParamRole::Adapter)
        .collect();
    as_values
        .load_parameters_with(&adapters, |i| std::borrow::Cow::Borrowed(&grads[i]))
        .unwrap();
    let ours: HashMap<String, Vec<f32>> = as_values
        .peft_tensors()
        .unwrap()
        .into_iter()
        .map(|t| (t.name, t.values))
        .collect();
    let grad = |n: &str| f32s(&reference[&format!("grad.{n}")].1);
    let mut checked = 0;
    for (n, got) in &ours {
        let want = if n.contains("lora_A") {
            // A fused layer's shared lora_A gets the sum of its projections' gradients.
            let fused: &[&str] = match () {
                _ if n.contains("self_attn") && !n.contains("o_proj") => {
                    &["q_proj", "k_proj", "v_proj"]
                }
                _ if n.contains("gate_proj") || n.contains("up_proj") => &["gate_proj", "up_proj"],
                _ => &[""],
            };
            let own = fused
                .iter()
                .find(|p| !p.is_empty() && n.contains(*p))
                .copied();
            let mut sum = vec![0f32; got.len()];
            for p in fused {
                let other = match own {
                    Some(own) => n.replace(own, p),
                    None => n.clone(),
                };
                sum.iter_mut().zip(grad(&other)).for_each(|(s, g)| *s += g);
            }
            sum
        } else {
            grad(n)
        };
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-3);
        let d = max_diff(got, &want);
        assert!(
            d <= 1e-4 * scale,
            "{name}: {n} gradient differs from PEFT's by {d} (max {scale})"
        );
        checked += 1;
    }
    checked
}

#[test]
fn written_adapters_are_pefts_tensor_for_tensor() {
    for name in MODELS {
        let (model, adapter, _) = adapted(name);
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("adapter");
        write_peft_adapter(&model, &out, &format!("fixtures/{name}"), false).unwrap();
        let ours = read(out.join("adapter_model.safetensors"));
        let theirs = read(
            fixtures()
                .join("lora")
                .join(name)
                .join("adapter_model.safetensors"),
        );
        assert_eq!(ours.len(), theirs.len());
        for (n, (shape, bytes)) in &theirs {
            assert_eq!(
                ours.get(n),
                Some(&(shape.clone(), bytes.clone())),
                "{name}: {n}"
            );
        }
        let back = PeftAdapter::read(&out).unwrap();
        assert_eq!((back.rank, back.alpha), (adapter.rank, adapter.alpha));
        // An existing output is kept unless forced.
        assert!(write_peft_adapter(&model, &out, "x", false).is_err());
        write_peft_adapter(&model, &out, "x", true).unwrap();
    }
}

#[test]
fn bad_adapters_are_named() {
    let (base, _) = load_hf_model(&fixtures().join("tiny-llama"), DType::F32).unwrap();
    let mut adapter = PeftAdapter::read(&fixtures().join("lora/tiny-llama")).unwrap();
    let k = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight";
    adapter.tensors.get_mut(k).unwrap().values[0] += 1.0;
    let err = adapter.apply_to(base.clone()).unwrap_err().to_string();
    assert!(
        err.contains("k_proj.lora_A.weight differs from") && err.contains("share lora_A"),
        "{err}"
    );
    let mut partial = PeftAdapter::read(&fixtures().join("lora/tiny-llama")).unwrap();
    partial
        .tensors
        .retain(|n, _| !n.contains("layers.1.self_attn.v_proj"));
    let err = partial.apply_to(base.clone()).unwrap_err().to_string();
    assert!(
        err.contains("adapts only some of") && err.contains("linear_qkv"),
        "{err}"
    );
    let mut extra = PeftAdapter::read(&fixtures().join("lora/tiny-llama")).unwrap();
    let mut head = extra.tensors.values().next().unwrap().clone();
    head.name = "base_model.model.lm_head.lora_A.weight".into();
    extra.tensors.insert(head.name.clone(), head);
    let err = extra.apply_to(base).unwrap_err().to_string();
    assert!(
        err.contains("lm_head.lora_A.weight") && err.contains("no LoRA adapter"),
        "{err}"
    );
}

#[test]
fn served_adapters_give_pefts_logits() {
    let (base, _) = load_hf_model(&fixtures().join("tiny-llama"), DType::F32).unwrap();
    let plain = logits(&base, "tiny-llama");
    let served = fixtures().join("lora/served");
    // (adapter, linear layers adapted in the two layers)
    let cases = [
        (served.join("qv"), 2),  // q and v only: linear_qkv, k's rows zero
        (served.join("all"), 8), // q, k, v (and gate, up) with distinct lora_A: stacked
        (fixtures().join("lora/tiny-llama"), 8), // lora_A shared: rank r as it is
    ];
    for (dir, adapted) in cases {
        let adapter = PeftAdapter::read(&dir).unwrap();
        let weights = adapter.served_weights(&base).unwrap();
        let want = f32s(&read(dir.join("reference.safetensors"))["logits"].1);
        assert!(
            max_diff(&plain, &want) > 1e-2,
            "{dir:?}: the adapter changes nothing"
        );
        let d = max_diff(&logits_with(&base, Some(&weights), "tiny-llama"), &want);
        assert!(d < 1e-4, "{dir:?}: logits differ from PEFT's by {d}");
        assert_eq!(weights.num_adapted(), adapted, "{dir:?}");
    }
}

/// DPO against TRL's loss (`tools/make_dpo_fixture.py`: two pairs on tiny-llama with the PEFT
/// adapter, the reference being the base with the adapter disabled, β 0.1): the reference and
/// policy log-probs, the loss and every adapter gradient; and at step 0 (fresh adapters,
/// policy = reference) the loss is exactly ln 2.
#[test]
fn dpo_matches_trl() {
    use ferrotron_model::{DpoTargets, Objective};
    let (mut model, _, _) = adapted("tiny-llama");
    let dpo = read(fixtures().join("lora/tiny-llama/dpo.safetensors"));
    let i64s = |n: &str| -> Vec<i64> {
        let b = &dpo[n].1;
        b.chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let (ids, mask) = (i64s("input_ids"), i64s("completion_mask"));
    let n = dpo["input_ids"].0[1];
    // TRL's rows [c0, c1, r0, r1] as our pairs [c0, r0, c1, r1].
    let order = [0, 2, 1, 3];
    let s = n - 1;
    let (mut tokens, mut labels, mut loss_mask) = (Vec::new(), Vec::new(), Vec::new());
    for &r in &order {
        let row = &ids[r * n..(r + 1) * n];
        tokens.extend(row[..s].iter().map(|&t| t as u32));
        labels.extend_from_slice(&row[1..]);
        loss_mask.extend(mask[r * n + 1..(r + 1) * n].iter().map(|&m| m as f32));
    }
    let mut batch = TrainBatch::from_batch_major(&tokens, &labels, Some(&loss_mask), 4, s);
    let reordered = |name: &str| -> Vec<f64> {
        let v = f32s(&dpo[name].1);
        order.iter().map(|&r| v[r] as f64).collect()
    };
    model.set_adapters_enabled(false);
    let reference = model.sequence_logps(&batch).unwrap();
    model.set_adapters_enabled(true);
    let policy = model.sequence_logps(&batch).unwrap();
    for (got, want) in [
        (&reference, reordered("reference_logps")),
        (&policy, reordered("policy_logps")),
    ] {
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-4, "log-probs {got:?} vs TRL {want:?}");
        }
    }
    let targets = DpoTargets {
        beta: 0.1,
        label_smoothing: 0.0,
        reference_logps: reference.clone(),
    };
    batch.objective = Objective::Dpo(targets.clone());
    let mut grads = model.zero_grads();
    let mut views: Vec<&mut [f32]> = grads.iter_mut().map(|g| g.as_mut_slice()).collect();
    let stats = model.forward_backward(&batch, &mut views, 1.0).unwrap();
    let want = f32s(&dpo["loss"].1)[0];
    assert!(
        (stats.loss - want).abs() < 1e-6,
        "loss {} vs TRL {want}",
        stats.loss
    );
    let d = stats.dpo.unwrap();
    assert_eq!(d.pairs, 2.0);
    let chosen: f64 = 0.1 * ((policy[0] - reference[0]) + (policy[2] - reference[2]));
    assert!((d.rewards_chosen - chosen).abs() < 1e-9);
    assert_eq!(assert_peft_grads("dpo", &model, &grads, &dpo), 28);
    // Step 0: fresh adapters leave the policy equal to the reference.
    let (base, _) = load_hf_model(&fixtures().join("tiny-llama"), DType::F32).unwrap();
    let fresh = base
        .with_lora(
            ferrotron_model::LoraConfig::default(),
            &ferrotron_model::InitConfig::default(),
        )
        .unwrap();
    let mut batch0 = batch.clone();
    let reference0 = fresh.sequence_logps(&batch0).unwrap();
    batch0.objective = Objective::Dpo(DpoTargets {
        reference_logps: reference0,
        ..targets
    });
    let mut grads = fresh.zero_grads();
    let mut views: Vec<&mut [f32]> = grads.iter_mut().map(|g| g.as_mut_slice()).collect();
    let stats = fresh.forward_backward(&batch0, &mut views, 1.0).unwrap();
    assert_eq!(stats.loss_sum / 2.0, std::f64::consts::LN_2);
    let d = stats.dpo.unwrap();
    assert_eq!((d.rewards_chosen, d.rewards_rejected), (0.0, 0.0));
}
