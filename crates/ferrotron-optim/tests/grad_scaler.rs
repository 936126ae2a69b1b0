//! DynamicGradScaler state machine (Megatron grad_scaler.py) and the fp16 optimizer step.

use ferrotron_optim::*;
use half::f16;

fn dynamic(initial: f32) -> DynamicGradScaler {
    DynamicGradScaler::new(DynamicGradScalerConfig {
        initial_scale: initial,
        ..DynamicGradScalerConfig::default()
    })
    .unwrap()
}

fn scale(s: &DynamicGradScaler) -> f32 {
    s.scale()
}

#[test]
fn megatron_defaults() {
    let c = DynamicGradScalerConfig::default();
    assert_eq!(c.initial_scale, 4294967296.0);
    assert_eq!(
        (c.min_scale, c.growth_factor, c.backoff_factor),
        (1.0, 2.0, 0.5)
    );
    assert_eq!((c.growth_interval, c.hysteresis), (1000, 2));
}

#[test]
fn backoff_with_hysteresis_then_growth_after_interval() {
    let two = |e: i32| 2f32.powi(e);
    let mut s = dynamic(two(32));
    // First inf: hysteresis 2 -> 1, scale kept.
    s.update(true);
    assert_eq!(
        (scale(&s), s.hysteresis_tracker(), s.growth_tracker()),
        (two(32), 1, 0)
    );
    // Second consecutive inf: hysteresis exhausted -> back off.
    s.update(true);
    assert_eq!((scale(&s), s.hysteresis_tracker()), (two(31), 0));
    // Every further inf backs off again until the next growth.
    s.update(true);
    assert_eq!((scale(&s), s.hysteresis_tracker()), (two(30), -1));
    // Clean steps alone do not refill the hysteresis (Megatron resets it only on growth).
    for _ in 0..999 {
        s.update(false);
    }
    assert_eq!((scale(&s), s.growth_tracker()), (two(30), 999));
    s.update(true);
    assert_eq!(
        (scale(&s), s.hysteresis_tracker(), s.growth_tracker()),
        (two(29), -2, 0)
    );
    // 1000 clean steps: grow by 2, refill hysteresis, reset the tracker.
    for i in 0..1000 {
        assert_eq!(scale(&s), two(29), "before growth, step {i}");
        s.update(false);
    }
    assert_eq!(
        (scale(&s), s.hysteresis_tracker(), s.growth_tracker()),
        (two(30), 2, 0)
    );
    // Hysteresis is back: one inf does not back off.
    s.update(true);
    assert_eq!(scale(&s), two(30));
}

#[test]
fn scale_is_floored_at_min_scale() {
    let mut s = DynamicGradScaler::new(DynamicGradScalerConfig {
        initial_scale: 4.0,
        hysteresis: 1,
        ..DynamicGradScalerConfig::default()
    })
    .unwrap();
    for want in [2.0, 1.0, 1.0, 1.0] {
        s.update(true);
        assert_eq!(scale(&s), want);
    }
    let g = GradScaler::Dynamic(s);
    assert_eq!(g.inv_scale(), 1.0);
    assert_eq!(
        GradScaler::constant(3.0).unwrap().inv_scale(),
        (1.0f64 / 3.0) as f32
    );
}

#[test]
fn invalid_settings_name_the_field() {
    let bad = |c: DynamicGradScalerConfig| DynamicGradScaler::new(c).unwrap_err().to_string();
    let d = DynamicGradScalerConfig::default();
    let e = bad(DynamicGradScalerConfig {
        min_scale: 2f32.powi(40),
        ..d
    });
    assert!(
        e.contains("min_loss_scale") && e.contains("initial_loss_scale"),
        "{e}"
    );
    assert!(
        bad(DynamicGradScalerConfig {
            growth_factor: 1.0,
            ..d
        })
        .contains("growth_factor")
    );
    assert!(
        bad(DynamicGradScalerConfig {
            backoff_factor: 1.0,
            ..d
        })
        .contains("backoff_factor")
    );
    assert!(bad(DynamicGradScalerConfig { hysteresis: 0, ..d }).contains("hysteresis"));
    assert!(
        GradScaler::constant(0.0)
            .unwrap_err()
            .to_string()
            .contains("loss_scale")
    );
}

fn fp16_setup(loss_scale: Option<f32>) -> (ParamAndGradBuffer, Optimizer, ParamId) {
    let mut b = ParamAndGradBufferBuilder::new(BufferConfig::new(Precision::Fp16.param_dtype(), 1));
    let id = b.register_auto("w.weight", &[2, 3]).unwrap();
    let mut buf = b.build().unwrap();
    buf.set_param_from_f32(id, &[0.5, -0.25, 1.0, 2.0, -1.5, 0.125])
        .unwrap();
    let mut cfg = OptimizerConfig::new(Precision::Fp16);
    cfg.loss_scale = loss_scale;
    let opt = Optimizer::new(cfg, &buf).unwrap();
    (buf, opt, id)
}

#[test]
fn fp16_unscales_skips_on_inf_and_counts() {
    let (mut buf, mut opt, id) = fp16_setup(None);
    let grads = [0.1f32, -0.2, 0.3, 0.05, 0.0, -0.4];
    // Reference: the same step in fp32 with unscaled grads.
    let mut b32 =
        ParamAndGradBufferBuilder::new(BufferConfig::new(Precision::Fp32.param_dtype(), 1));
    let id32 = b32.register_auto("w.weight", &[2, 3]).unwrap();
    let mut buf32 = b32.build().unwrap();
    buf32
        .set_param_from_f32(id32, &buf.param_to_f32(id))
        .unwrap();
    let mut opt32 = Optimizer::new(OptimizerConfig::new(Precision::Fp32), &buf32).unwrap();
    buf32.grad_mut(id32).copy_from_slice(&grads);
    opt32.step(&mut buf32, 1e-2, 0.01).unwrap();

    let s = opt.loss_scale();
    assert_eq!(s, 2f32.powi(32));
    for (g, &x) in buf.grad_mut(id).iter_mut().zip(&grads) {
        *g = x * s; // backward of (loss * scale)
    }
    let out = opt.step(&mut buf, 1e-2, 0.01).unwrap();
    assert!(out.update_successful && !out.found_inf);
    assert_eq!(out.loss_scale, s);
    // Unscaling by a power of two is exact, so master weights equal the fp32 run's params.
    assert_eq!(
        opt.adam().master_weights().unwrap().unwrap()[..6],
        *buf32.param_to_f32(id32)
    );
    let want16: Vec<f16> = buf32
        .param_to_f32(id32)
        .iter()
        .map(|&x| f16::from_f32(x))
        .collect();
    assert_eq!(buf.param::<f16>(id).unwrap(), want16.as_slice());

    // An inf grad: skipped, nothing changes but the scaler's hysteresis.
    let before = buf.param_to_f32(id);
    buf.zero_grad();
    buf.grad_mut(id)[2] = f32::INFINITY;
    let out = opt.step(&mut buf, 1e-2, 0.01).unwrap();
    assert!(!out.update_successful && out.found_inf && out.grad_norm.is_none());
    assert_eq!(opt.skipped_iterations(), 1);
    assert_eq!(opt.adam().step_count(), 1);
    assert_eq!(buf.param_to_f32(id), before);
    assert_eq!(opt.loss_scale(), s); // hysteresis 2: first inf keeps the scale
    buf.grad_mut(id)[0] = f32::NAN;
    assert!(!opt.step(&mut buf, 1e-2, 0.01).unwrap().update_successful);
    assert_eq!(opt.loss_scale(), s / 2.0);
    assert_eq!(opt.skipped_iterations(), 2);
}

#[test]
fn fp16_constant_loss_scale() {
    let (mut buf, mut opt, id) = fp16_setup(Some(1024.0));
    assert_eq!(opt.loss_scale(), 1024.0);
    buf.grad_mut(id).fill(f32::INFINITY);
    assert!(!opt.step(&mut buf, 1e-2, 0.0).unwrap().update_successful);
    assert_eq!(opt.loss_scale(), 1024.0);
    buf.grad_mut(id).fill(512.0);
    let out = opt.step(&mut buf, 1e-2, 0.0).unwrap();
    assert!(out.update_successful);
    // Unscaled grads are 0.5 each: norm sqrt(6 * 0.25).
    assert!((out.grad_norm.unwrap() - 1.5f64.sqrt()).abs() < 1e-12);
}

#[test]
fn loss_scale_outside_fp16_is_a_config_error() {
    let mut cfg = OptimizerConfig::new(Precision::Bf16);
    cfg.loss_scale = Some(8.0);
    let mut b = ParamAndGradBufferBuilder::new(BufferConfig::new(Precision::Bf16.param_dtype(), 1));
    b.register_auto("w", &[2]).unwrap();
    let buf = b.build().unwrap();
    let e = Optimizer::new(cfg, &buf).unwrap_err().to_string();
    assert!(e.contains("loss_scale") && e.contains("fp16"), "{e}");
    let e = Optimizer::new(OptimizerConfig::new(Precision::Fp32), &buf)
        .unwrap_err()
        .to_string();
    assert!(e.contains("needs f32 params") && e.contains("bf16"), "{e}");
}
