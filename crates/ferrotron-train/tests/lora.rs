//! LoRA training: only the adapters train (the base is bit-for-bit unchanged, holds no
//! gradient or optimizer state), every parallel layout gives the single rank's losses and
//! adapters (tp 2 with and without sequence parallelism, pp 2, dp 2 with the distributed
//! optimizer, tp 2 x dp 2), DPO too (with pp 2 and tp 2 x pp 2), and a LoRA checkpoint holds
//! the adapters alone and resumes exactly, on one rank and under tp 2.

mod common;

use common::layouts::*;
use common::*;
use ferrotron_checkpoint::PeftAdapter;
use ferrotron_comm::run_local;
use ferrotron_model::GptModel;
use ferrotron_model::{InitConfig, LoraConfig};
use ferrotron_train::trainer::{DpoOptions, DpoReference, TrainError, Trainer};
use std::path::Path;

/// tiny-llama with the PEFT fixture's adapters (random `lora_B`, so `lora_A` trains from
/// the first step).
fn adapted() -> GptModel {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/lora/tiny-llama");
    PeftAdapter::read(&dir)
        .unwrap()
        .apply_to(fixture("tiny-llama"))
        .unwrap()
}

#[test]
fn only_the_adapters_train() {
    let full_state = Trainer::new(fixture("tiny-llama"), dp_options(1, ITERS))
        .unwrap()
        .model_state_bytes();
    let model = adapted();
    let before = model.parameters_f32();
    let mut t = Trainer::new(model, dp_options(1, ITERS)).unwrap();
    let lora_state = t.model_state_bytes();
    let (losses, _) = train(&mut t, 0, ITERS);
    assert!(losses.last() < losses.first(), "{losses:?}");
    let infos = t.model().parameters();
    let mut adapters = 0;
    for (i, p) in infos.iter().enumerate() {
        let moved = t.param(i) != before[i];
        assert_eq!(moved, !p.frozen, "{}", p.name);
        adapters += usize::from(!p.frozen);
    }
    assert_eq!(adapters, 2 * 4 * 2, "2 layers x 4 linear layers x (A, B)");
    // Frozen weights: 4 bytes each (f32); adapters: + grads + master-less Adam (8).
    let base: usize = infos.iter().filter(|p| p.frozen).map(|p| p.numel()).sum();
    let trainable: usize = infos.iter().filter(|p| !p.frozen).map(|p| p.numel()).sum();
    assert!(lora_state < full_state / 2, "{lora_state} vs {full_state}");
    assert!(lora_state >= 4 * base + 16 * trainable, "{lora_state}");
    assert!(lora_state <= 4 * base + 16 * (trainable + 64 * adapters + 128));
}

/// [`adapted`] with the adapters' input dropout 0.2 (the fixture's values loaded into
/// adapters declared with dropout).
fn adapted_with_dropout() -> GptModel {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/lora/tiny-llama");
    let adapter = PeftAdapter::read(&dir).unwrap();
    let lora = LoraConfig {
        rank: adapter.rank,
        alpha: adapter.alpha,
        dropout: 0.2,
        ..LoraConfig::default()
    };
    let mut model = fixture("tiny-llama")
        .with_lora(lora, &InitConfig::default())
        .unwrap();
    model
        .load_peft_tensors(|n| adapter.tensors.get(n).cloned())
        .unwrap();
    model
}

/// Runs `layout` on `world` ranks over `model()` and checks every rank against `reference`.
fn assert_layout(
    label: &str,
    world: usize,
    layout: Layout,
    model: fn() -> GptModel,
    reference: &Run,
) {
    let runs = run_local(world, |comm| {
        let mut t = layout.trainer(comm, ITERS, model())?;
        Ok::<_, TrainError>(train(&mut t, 0, ITERS))
    })
    .unwrap_or_else(|e| panic!("{label}: {e}"));
    for (r, run) in runs.iter().enumerate() {
        assert_same_run(&format!("{label} rank {r}"), run, reference);
    }
}

/// Every layout gives the single rank's losses and adapters, also with the adapters' input
/// dropout (its masks keyed by sample, so the same in every layout).
#[test]
fn lora_layouts_match_one_rank() {
    let plain = lora_layouts_match_one_rank_for(adapted);
    let dropped = lora_layouts_match_one_rank_for(adapted_with_dropout);
    assert_ne!(plain.0, dropped.0, "the dropout changes nothing");
}

/// Checks the layouts over `model()`; returns the single rank's run.
fn lora_layouts_match_one_rank_for(model: fn() -> GptModel) -> Run {
    let mut one = Trainer::new(model(), dp_options(1, ITERS)).unwrap();
    let reference = train(&mut one, 0, ITERS);
    let layouts = [
        (
            "tp2",
            2,
            Layout {
                tp: 2,
                ..Layout::default()
            },
        ),
        (
            "tp2 sp",
            2,
            Layout {
                tp: 2,
                sp: true,
                ..Layout::default()
            },
        ),
        (
            "pp2",
            2,
            Layout {
                pp: 2,
                ..Layout::default()
            },
        ),
        (
            "dp2 distributed",
            2,
            Layout {
                distributed: true,
                overlap: true,
                ..Layout::default()
            },
        ),
        (
            "tp2 dp2",
            4,
            Layout {
                tp: 2,
                ..Layout::default()
            },
        ),
    ];
    for (label, world, layout) in layouts {
        assert_layout(label, world, layout, model, &reference);
    }
    reference
}

#[test]
fn lora_checkpoints_hold_the_adapters_and_resume() {
    let mut one = Trainer::new(adapted(), dp_options(1, ITERS)).unwrap();
    let reference = train(&mut one, 0, ITERS);
    let tail = tail_of(&reference);
    let dir = tempfile::tempdir().unwrap();
    let ckpt = save_after_two(1, Layout::default(), adapted, dir.path());
    let reader = ferrotron_checkpoint::dist::CheckpointReader::open(&ckpt).unwrap();
    let names: Vec<String> = reader.metadata().tensors.keys().cloned().collect();
    assert!(!names.is_empty());
    assert!(names.iter().all(|n| n.contains(".adapter.")), "{names:?}");
    assert_resumes("1 rank", 1, Layout::default(), adapted, &ckpt, &tail);
    let tp2 = Layout {
        tp: 2,
        ..Layout::default()
    };
    assert_resumes("tp2", 2, tp2, adapted, &ckpt, &tail);
}

/// bf16 LoRA (Megatron's `--bf16`): bf16 base and adapters, fp32 master weights of the
/// adapters only; the base stays bit-for-bit, the losses track the f32 LoRA run's.
#[test]
fn bf16_lora_tracks_f32() {
    let to_bf16 = |m: GptModel| {
        let values = (0..m.parameters().len())
            .map(|i| m.param_table().value(i))
            .map(|v| match v {
                ferrotron_model::ParamValue::Dense(t) => {
                    ferrotron_model::ParamValue::Dense(t.to_dtype(ferrotron_tensor::DType::BF16))
                }
                q => q,
            })
            .collect();
        GptModel::from_values(m.config().clone(), values).unwrap()
    };
    let mut f32_run = Trainer::new(adapted(), dp_options(1, ITERS)).unwrap();
    let (want, _) = train(&mut f32_run, 0, ITERS);
    let model = to_bf16(adapted());
    let before = model.parameters_f32();
    let mut options = dp_options(1, ITERS);
    options.precision = ferrotron_optim::Precision::Bf16;
    let mut t = Trainer::new(model, options).unwrap();
    let (got, _) = train(&mut t, 0, ITERS);
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() < 2e-2 * w, "bf16 {got:?} vs f32 {want:?}");
    }
    for (i, p) in t.model().parameters().iter().enumerate() {
        assert_eq!(t.param(i) != before[i], !p.frozen, "{}", p.name);
    }
}

/// DPO options on pairs of the layout tests' rows (each micro-batch of 2 rows is one pair).
fn dpo_options(reference: DpoReference) -> ferrotron_train::trainer::TrainerOptions {
    ferrotron_train::trainer::TrainerOptions {
        dpo: Some(DpoOptions {
            beta: 0.1,
            label_smoothing: 0.0,
            reference,
        }),
        ..dp_options(1, ITERS)
    }
}

/// DPO with LoRA (the reference: adapters disabled, its log-probs through the pipeline under
/// pp, summed over the context-parallel ranks under cp): every layout gives the single rank's
/// losses and adapters; fresh adapters start at ln 2 and a frozen copy as the reference gives
/// the same run.
#[test]
fn dpo_layouts_match_one_rank() {
    let reference_run = |model: GptModel, reference| {
        let mut t = Trainer::new(model, dpo_options(reference)).unwrap();
        let stats = t.train_step(&rank_batches(0, 0, 1)).unwrap();
        let d = stats.dpo.unwrap();
        assert_eq!(d.pairs, (GBS / 2) as f64);
        let mut run = train(&mut t, 1, ITERS - 1);
        run.0.insert(0, stats.loss);
        run
    };
    let one = reference_run(adapted(), DpoReference::AdaptersDisabled);
    assert!(one.0.last() < one.0.first(), "{:?}", one.0);
    for (label, world, layout) in [
        (
            "tp2",
            2,
            Layout {
                tp: 2,
                ..Layout::default()
            },
        ),
        (
            "tp2 sp",
            2,
            Layout {
                tp: 2,
                sp: true,
                ..Layout::default()
            },
        ),
        (
            "dp2 distributed",
            2,
            Layout {
                distributed: true,
                ..Layout::default()
            },
        ),
        (
            "pp2",
            2,
            Layout {
                pp: 2,
                ..Layout::default()
            },
        ),
        (
            "tp2 pp2",
            4,
            Layout {
                tp: 2,
                pp: 2,
                ..Layout::default()
            },
        ),
        (
            "cp2",
            2,
            Layout {
                cp: 2,
                ..Layout::default()
            },
        ),
        (
            "cp2 dp2 zero3",
            4,
            Layout {
                cp: 2,
                sharding: ferrotron_train::trainer::ShardingStrategy::OptimGradsParams,
                ..Layout::default()
            },
        ),
    ] {
        let layout = Layout {
            dpo: Some(DpoReference::AdaptersDisabled),
            ..layout
        };
        assert_layout(&format!("DPO {label}"), world, layout, adapted, &one);
    }
    // Fresh adapters: policy = reference at step 0.
    let fresh = || with_fresh_lora(fixture("tiny-llama"));
    let a = reference_run(fresh(), DpoReference::AdaptersDisabled);
    assert_eq!(a.0[0], std::f64::consts::LN_2);
    let b = reference_run(fresh(), DpoReference::FrozenCopy);
    assert_same_run("frozen copy vs adapters disabled", &b, &a);
}
