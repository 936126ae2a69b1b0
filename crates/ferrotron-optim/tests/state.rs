//! Export / import of buffers, optimizer state and scaler: N+M steps == N, save, load, M.

use ferrotron_optim::*;
use half::bf16;

fn build(precision: Precision) -> (ParamAndGradBuffer, Vec<ParamId>) {
    let mut b = ParamAndGradBufferBuilder::new(BufferConfig::new(precision.param_dtype(), 1));
    let ids = vec![
        b.register_auto("emb.weight", &[16, 8]).unwrap(),
        b.register_auto("norm.weight", &[8]).unwrap(),
        b.register_auto("out.weight", &[8, 16]).unwrap(),
    ];
    let mut buf = b.build().unwrap();
    for &id in &ids {
        let v: Vec<f32> = (0..buf.info(id).numel)
            .map(|i| ((i * 7 + id.0 * 3) % 23) as f32 / 23.0 - 0.5)
            .collect();
        buf.set_param_from_f32(id, &v).unwrap();
    }
    (buf, ids)
}

fn set_grads(buf: &mut ParamAndGradBuffer, ids: &[ParamId], step: usize, scale: f32) {
    buf.zero_grad();
    for &id in ids {
        for (i, g) in buf.grad_mut(id).iter_mut().enumerate() {
            *g = (((i + 3 * step + id.0) % 11) as f32 - 5.0) * 0.01 * scale;
        }
    }
}

fn train(
    buf: &mut ParamAndGradBuffer,
    opt: &mut Optimizer,
    sched: &mut OptimizerParamScheduler,
    ids: &[ParamId],
    steps: std::ops::Range<usize>,
) {
    for step in steps {
        set_grads(buf, ids, step, opt.loss_scale());
        if step == 3 {
            buf.grad_mut(ids[0])[0] = f32::NAN; // one skipped step (fp16) / non-finite norm
        }
        let out = opt.step(buf, sched.lr(), sched.weight_decay()).unwrap();
        if out.update_successful {
            sched.step(1);
        }
    }
}

fn scheduler() -> OptimizerParamScheduler {
    OptimizerParamScheduler::new(SchedulerConfig {
        lr: 1e-2,
        min_lr: 1e-3,
        lr_warmup_init: 0.0,
        lr_warmup_steps: 2,
        lr_decay_steps: 20,
        lr_decay_style: LrDecayStyle::Cosine,
        weight_decay: 0.1,
        unit: ScheduleUnit::Iterations,
    })
    .unwrap()
}

fn resume_is_exact(precision: Precision) {
    let cfg = OptimizerConfig::new(precision);
    // Reference: 8 steps straight.
    let (mut buf, ids) = build(precision);
    let mut opt = Optimizer::new(cfg.clone(), &buf).unwrap();
    let mut sched = scheduler();
    train(&mut buf, &mut opt, &mut sched, &ids, 0..8);

    // 5 steps, export everything (through serde for the metas), import into fresh objects.
    let (mut buf_a, _) = build(precision);
    let mut opt_a = Optimizer::new(cfg.clone(), &buf_a).unwrap();
    let mut sched_a = scheduler();
    train(&mut buf_a, &mut opt_a, &mut sched_a, &ids, 0..5);
    let (bs, os, ss) = (
        buf_a.export_state().unwrap(),
        opt_a.export_state().unwrap(),
        sched_a.export_state().unwrap(),
    );
    let os = StateDict {
        meta: serde_json::from_str(&serde_json::to_string(&os.meta).unwrap()).unwrap(),
        arrays: os.arrays,
    };
    let bs = StateDict {
        meta: serde_json::from_str(&serde_json::to_string(&bs.meta).unwrap()).unwrap(),
        arrays: bs.arrays,
    };
    drop((buf_a, opt_a, sched_a));

    let (mut buf_b, _) = build(precision);
    buf_b.set_param_from_f32(ids[0], &vec![9.0; 128]).unwrap(); // overwritten by import
    let mut opt_b = Optimizer::new(cfg, &buf_b).unwrap();
    let mut sched_b = scheduler();
    buf_b.import_state(bs).unwrap();
    opt_b.import_state(os).unwrap();
    sched_b.import_state(ss).unwrap();
    train(&mut buf_b, &mut opt_b, &mut sched_b, &ids, 5..8);

    assert_eq!(
        buf_b.param_storage().to_f32_range(0..buf.numel()),
        buf.param_storage().to_f32_range(0..buf.numel())
    );
    assert_eq!(
        opt_b.adam().exp_avg_sq().unwrap(),
        opt.adam().exp_avg_sq().unwrap()
    );
    assert_eq!(
        opt_b.adam().master_weights().unwrap(),
        opt.adam().master_weights().unwrap()
    );
    assert_eq!(opt_b.adam().step_count(), opt.adam().step_count());
    assert_eq!(opt_b.skipped_iterations(), 1);
    assert_eq!(opt_b.loss_scale(), opt.loss_scale());
    assert_eq!(sched_b.num_steps(), sched.num_steps());
}

#[test]
fn resume_is_bit_exact_fp32() {
    resume_is_exact(Precision::Fp32);
}

#[test]
fn resume_is_bit_exact_bf16() {
    resume_is_exact(Precision::Bf16);
}

#[test]
fn resume_is_bit_exact_fp16_with_scaler() {
    resume_is_exact(Precision::Fp16);
}

#[test]
fn bf16_params_round_trip_through_master_weights() {
    let (mut buf, ids) = build(Precision::Bf16);
    let mut opt = Optimizer::new(OptimizerConfig::new(Precision::Bf16), &buf).unwrap();
    // Master starts as the exact f32 value of each bf16 param.
    let master: Vec<f32> = opt.adam().master_weights().unwrap().unwrap();
    assert_eq!(master, buf.param_storage().to_f32_range(0..buf.numel()));
    // A tiny lr moves the master but (mostly) not the rounded bf16 param; params are always
    // the round-to-nearest-even of the master.
    set_grads(&mut buf, &ids, 0, 1.0);
    opt.step(&mut buf, 1e-6, 0.0).unwrap();
    let master = opt.adam().master_weights().unwrap().unwrap();
    let params = buf.params_flat::<bf16>().unwrap();
    assert!(
        params
            .iter()
            .zip(&master)
            .all(|(p, m)| *p == bf16::from_f32(*m))
    );
    let moved = master
        .iter()
        .zip(params)
        .filter(|(m, p)| **m != p.to_f32())
        .count();
    assert!(moved > 0, "master keeps the sub-bf16 update");
    // Loading new weights into the buffer and reloading refreshes the master.
    buf.set_param_from_f32(ids[1], &[0.25; 8]).unwrap();
    opt.reload_model_params(&buf).unwrap();
    let off = buf.info(ids[1]).offset;
    assert_eq!(
        &opt.adam().master_weights().unwrap().unwrap()[off..off + 8],
        &[0.25; 8]
    );
}

#[test]
fn mismatched_state_is_rejected() {
    let (buf, _) = build(Precision::Bf16);
    let opt = Optimizer::new(OptimizerConfig::new(Precision::Bf16), &buf).unwrap();
    let mut b = ParamAndGradBufferBuilder::new(BufferConfig::new(Precision::Bf16.param_dtype(), 1));
    b.register_auto("emb.weight", &[16, 8]).unwrap();
    b.register_auto("other.weight", &[8]).unwrap();
    b.register_auto("out.weight", &[8, 16]).unwrap();
    let mut other = b.build().unwrap();
    let e = other
        .import_state(buf.export_state().unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("`norm.weight` vs `other.weight`"), "{e}");
    let (buf32, _) = build(Precision::Fp32);
    let mut opt32 = Optimizer::new(OptimizerConfig::new(Precision::Fp32), &buf32).unwrap();
    let e = opt32
        .import_state(opt.export_state().unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("precision"), "{e}");
    let mut state = opt.export_state().unwrap();
    state.arrays.remove("exp_avg");
    let mut opt2 = Optimizer::new(OptimizerConfig::new(Precision::Bf16), &buf).unwrap();
    let e = opt2.import_state(state).unwrap_err().to_string();
    assert!(e.contains("`exp_avg` is missing"), "{e}");
}
