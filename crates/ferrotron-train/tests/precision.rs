//! Mixed precision in the trainer (Megatron `--bf16` / `--fp16`): bf16/f16 parameters with
//! f32 gradients, master weights and Adam moments; fp16 dynamic loss scaling skips and
//! counts overflowing steps and lowers the scale.

use ferrotron_comm::{Communicator, run_local};
use ferrotron_data::{GptSample, MicroBatch};
use ferrotron_model::GptModel;
use ferrotron_model::families::load_hf_model;
use ferrotron_optim::{DynamicGradScalerConfig, LrDecayStyle, Precision};
use ferrotron_tensor::DType;
use ferrotron_train::trainer::{DataParallel, TrainError, Trainer, TrainerOptions};
use half::{bf16, f16};
use std::path::Path;
use std::sync::Arc;

const SEQ: usize = 12;
const PATTERN: [u32; 7] = [5, 17, 42, 8, 99, 23, 61];

fn tiny_model(dtype: DType) -> GptModel {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-llama");
    load_hf_model(&dir, dtype).expect("tiny-llama fixture").0
}

/// One global batch of 2 single-row micro-batches starting at pattern offset `k`.
fn batches(k: usize) -> Vec<MicroBatch> {
    (k..k + 2)
        .map(|i| {
            let text: Vec<u32> = (0..=SEQ)
                .map(|t| PATTERN[(i + t) % PATTERN.len()])
                .collect();
            let sample = GptSample {
                tokens: text[..SEQ].to_vec(),
                labels: text[1..].to_vec(),
                loss_mask: vec![1.0; SEQ],
                position_ids: (0..SEQ as u32).collect(),
                segment_ids: vec![0; SEQ],
                margin: 0.0,
            };
            MicroBatch::collate(vec![sample], vec![i], i + 1).unwrap()
        })
        .collect()
}

fn options(precision: Precision) -> TrainerOptions {
    TrainerOptions {
        micro_batch_size: 1,
        global_batch_size: 2,
        train_iters: 30,
        lr: 1e-2,
        min_lr: 1e-2,
        lr_decay_style: LrDecayStyle::Constant,
        precision,
        ..TrainerOptions::default()
    }
}

/// Losses of `n` steps.
fn losses(trainer: &mut Trainer, n: usize) -> Vec<f64> {
    (0..n)
        .map(|i| trainer.train_step(&batches(i)).unwrap().loss)
        .collect()
}

#[test]
fn bf16_training_tracks_f32_and_keeps_bf16_weights() {
    let mut f32_run = Trainer::new(tiny_model(DType::F32), options(Precision::Fp32)).unwrap();
    let mut bf16_run = Trainer::new(tiny_model(DType::BF16), options(Precision::Bf16)).unwrap();
    let a = losses(&mut f32_run, 30);
    let b = losses(&mut bf16_run, 30);
    // Same start (the fixture's weights are bf16-representable up to rounding), same descent.
    assert!(
        (a[0] - b[0]).abs() < 2e-2 * a[0],
        "step 1: {} vs {}",
        a[0],
        b[0]
    );
    assert!(b[29] < 0.5 * b[0], "bf16 loss did not fall: {b:?}");
    assert!((a[29] - b[29]).abs() < 0.25 * a[29] + 0.05, "{a:?}\n{b:?}");
    // The model's linear weights are the rounded master weights: exactly bf16 values.
    let w = bf16_run.param(0);
    assert!(w.iter().all(|&x| bf16::from_f32(x).to_f32() == x));
}

#[test]
fn fp16_trains_and_overflow_skips_steps_and_lowers_the_scale() {
    let mut run = Trainer::new(tiny_model(DType::F16), options(Precision::Fp16)).unwrap();
    let l = losses(&mut run, 20);
    assert!(l[19] < 0.6 * l[0], "fp16 loss did not fall: {l:?}");
    assert_eq!(run.skipped_iterations(), 0);
    assert!(run.param(0).iter().all(|&x| f16::from_f32(x).to_f32() == x));

    // A scale so large the scaled gradients overflow f32: every step is skipped until the
    // scaler has backed off enough (hysteresis 2, factor 0.5).
    let mut opts = options(Precision::Fp16);
    opts.dynamic_loss_scale = DynamicGradScalerConfig {
        initial_scale: 2f32.powi(127),
        hysteresis: 2,
        ..DynamicGradScalerConfig::default()
    };
    let mut run = Trainer::new(tiny_model(DType::F16), opts).unwrap();
    let before: Vec<f32> = run.param(0);
    let first = run.train_step(&batches(0)).unwrap();
    assert!(first.skipped, "an overflowing step must be skipped");
    assert_eq!(run.param(0), before, "a skipped step changes no weight");
    let mut n = 1;
    while run.train_step(&batches(n)).unwrap().skipped {
        n += 1;
        assert!(n < 200, "the scale never came down");
    }
    assert_eq!(run.skipped_iterations(), n as u64);
    assert!(
        n >= 2,
        "hysteresis 2 tolerates one overflow before backing off"
    );
    assert_eq!(
        run.iteration(),
        n as u64 + 1,
        "skipped steps count as iterations"
    );
}

#[test]
fn precision_and_weights_must_agree() {
    let err = Trainer::new(tiny_model(DType::BF16), options(Precision::Fp16))
        .err()
        .expect("bf16 weights with fp16 precision");
    assert!(err.to_string().contains("f16"), "{err}");
}

/// tiny-llama in f32 with its layer-0 qkv weight (parameter `i` of `n` elements) set to
/// ±(0.5 + 0.45 ulp): 0.45 bf16 ulp above the bf16 value 0.5 the model computes with.
fn nudged_model() -> (GptModel, usize, usize) {
    let mut model = tiny_model(DType::F32);
    let name = "decoder.layers.0.self_attention.linear_qkv.weight";
    let i = model
        .parameters()
        .iter()
        .position(|p| p.name == name)
        .expect("layer 0 qkv");
    let n = model.param_table().numel(i);
    let start: Vec<f32> = (0..n)
        .map(|k| if k % 2 == 0 { 1.0 } else { -1.0 } * (0.5 + 0.45 * ULP))
        .collect();
    model
        .param_table_mut()
        .set_from_f32(i, name, &start)
        .unwrap();
    (model, i, n)
}

/// One bf16 ulp in [0.5, 1).
const ULP: f32 = 1.0 / 256.0;

/// bf16 options whose first AdamW step moves every weight by about 0.1 ulp.
fn tenth_ulp_options() -> TrainerOptions {
    let mut opts = options(Precision::Bf16);
    (opts.lr, opts.min_lr) = (0.1 * f64::from(ULP), 0.1 * f64::from(ULP));
    opts
}

/// Which elements of parameter `i` one step of `run` (this rank's `batches`) moved.
fn moved(run: &mut Trainer, i: usize, batches: &[MicroBatch]) -> Vec<bool> {
    let before = run.param(i);
    assert!(before.iter().all(|&x| x.abs() == 0.5), "rounded copies");
    run.train_step(batches).unwrap();
    run.finish_param_gather().unwrap();
    run.param(i)
        .iter()
        .zip(&before)
        .map(|(a, b)| a != b)
        .collect()
}

/// A bf16 run given f32 weights computes with their rounded copies but starts its master
/// weights from the f32 values (as PyTorch mixed precision keeps its f32 weights): weights
/// 0.45 ulp above a bf16 value move to the next one after an update of +0.1 ulp, where
/// masters started from the rounded copies (what a bf16 model gives) move none of them.
#[test]
fn f32_weights_start_the_master_weights_of_a_bf16_run() {
    let (model, i, n) = nudged_model();
    let mut rounded = model.clone();
    let narrow = rounded.param_table().to_dtype(DType::BF16);
    *rounded.param_table_mut() = narrow;
    let count = |model| {
        let mut run = Trainer::new(model, tenth_ulp_options()).unwrap();
        moved(&mut run, i, &batches(0))
            .iter()
            .filter(|&&m| m)
            .count()
    };
    let (from_f32, from_rounded) = (count(model), count(rounded));
    // About half the elements are pushed away from zero (+0.1 ulp crosses the half-ulp
    // boundary); the others move toward zero and stay.
    assert!(from_f32 > n / 4, "{from_f32} of {n} weights moved");
    assert_eq!(
        from_rounded, 0,
        "updates of 0.1 ulp round away from a rounded master"
    );
}

/// The same under the distributed optimizer on 2 ranks: each rank starts the masters of its
/// own shard from the f32 weights, and the gathered weights move as on one rank.
#[test]
fn f32_weights_start_the_sharded_master_weights() {
    let (model, i, n) = nudged_model();
    let mut one = Trainer::new(model.clone(), tenth_ulp_options()).unwrap();
    let want = moved(&mut one, i, &batches(0));
    let runs = run_local(2, |comm| {
        let rank = comm.rank();
        let group = DataParallel::new(Arc::new(comm), true);
        let opts = TrainerOptions {
            data_parallel_size: 2,
            ..tenth_ulp_options()
        };
        let mut run = Trainer::new_data_parallel(model.clone(), opts, group)?;
        Ok::<_, TrainError>(moved(&mut run, i, &batches(0)[rank..rank + 1]))
    })
    .unwrap_or_else(|e| panic!("{e}"));
    for got in runs {
        let same = got.iter().zip(&want).filter(|(a, b)| a == b).count();
        // Gradients summed in another order may flip a near-zero one's sign: a few elements.
        assert!(
            same >= n * 99 / 100,
            "{same} of {n} elements moved as on one rank"
        );
    }
}
