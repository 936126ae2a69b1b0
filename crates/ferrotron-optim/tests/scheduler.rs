//! LR schedule values at key steps, hand-computed from Megatron's `get_lr` formulas.

use ferrotron_optim::*;

fn cfg(style: LrDecayStyle) -> SchedulerConfig {
    SchedulerConfig {
        lr: 1.0,
        min_lr: 0.1,
        lr_warmup_init: 0.0,
        lr_warmup_steps: 10,
        lr_decay_steps: 110,
        lr_decay_style: style,
        weight_decay: 0.1,
        unit: ScheduleUnit::Iterations,
    }
}

fn close(a: f64, b: f64) {
    assert!((a - b).abs() < 1e-12, "{a} vs {b}");
}

#[test]
fn warmup_then_cosine() {
    let c = cfg(LrDecayStyle::Cosine);
    close(lr_at(&c, 0), 0.0); // iteration 1 runs at lr_warmup_init
    close(lr_at(&c, 5), 0.5);
    close(lr_at(&c, 10), 1.0); // warmup includes its last step
    // r = 25/100: 0.1 + 0.9 * 0.5 * (cos(pi/4) + 1)
    close(
        lr_at(&c, 35),
        0.1 + 0.9 * 0.5 * (std::f64::consts::FRAC_1_SQRT_2 + 1.0),
    );
    close(lr_at(&c, 60), 0.55); // r = 1/2
    close(lr_at(&c, 110), 0.1); // r = 1
    close(lr_at(&c, 111), 0.1); // past lr_decay_steps: min_lr
    close(lr_at(&c, 10_000), 0.1);
}

#[test]
fn linear_constant_inverse_sqrt() {
    let lin = cfg(LrDecayStyle::Linear);
    close(lr_at(&lin, 35), 0.1 + 0.9 * 0.75);
    close(lr_at(&lin, 60), 0.55);
    close(lr_at(&lin, 110), 0.1);
    let constant = cfg(LrDecayStyle::Constant);
    close(lr_at(&constant, 5), 0.5);
    close(lr_at(&constant, 60), 1.0);
    close(lr_at(&constant, 10_000), 1.0); // constant ignores lr_decay_steps
    let isr = cfg(LrDecayStyle::InverseSquareRoot);
    close(lr_at(&isr, 40), 0.5); // sqrt(10)/sqrt(40)
    close(lr_at(&isr, 100), (0.1f64).sqrt());
    close(lr_at(&isr, 111), 0.1); // past decay: min_lr
    let mut floor = cfg(LrDecayStyle::InverseSquareRoot);
    floor.min_lr = 0.5;
    close(lr_at(&floor, 90), 0.5); // sqrt(10/90) = 0.33 < min_lr
}

#[test]
fn no_warmup_and_warmup_init() {
    let mut c = cfg(LrDecayStyle::Cosine);
    c.lr_warmup_steps = 0;
    close(lr_at(&c, 0), 1.0);
    close(lr_at(&c, 55), 0.55);
    let mut c = cfg(LrDecayStyle::Linear);
    c.lr_warmup_init = 0.2;
    close(lr_at(&c, 5), 0.6);
}

#[test]
fn scheduler_steps_and_weight_decay_is_constant() {
    let mut s = OptimizerParamScheduler::new(cfg(LrDecayStyle::Cosine)).unwrap();
    assert_eq!((s.lr(), s.num_steps()), (0.0, 0));
    for _ in 0..60 {
        s.step(1);
    }
    close(s.lr(), 0.55);
    assert_eq!(s.weight_decay(), 0.1);
}

#[test]
fn warmup_by_tokens_and_samples() {
    let (gbs, seq) = (8u64, 512u64);
    // Megatron's iteration schedule converted to samples (what training.py does) gives the
    // same lr as counting iterations at every iteration.
    let iters = cfg(LrDecayStyle::Cosine);
    let samples = SchedulerConfig {
        lr_warmup_steps: 10 * gbs,
        lr_decay_steps: 110 * gbs,
        unit: ScheduleUnit::Samples,
        ..iters.clone()
    };
    let inc = ScheduleUnit::Samples.increment(gbs, seq);
    assert_eq!(inc, 8);
    for i in 0..130 {
        close(lr_at(&samples, i * inc), lr_at(&iters, i));
    }
    // By tokens: one iteration = 4096 tokens; warmup over 10_000 tokens, decay to 450_560.
    let tokens = SchedulerConfig {
        lr_warmup_steps: 10_000,
        lr_decay_steps: 450_560,
        unit: ScheduleUnit::Tokens,
        ..iters
    };
    let mut s = OptimizerParamScheduler::new(tokens).unwrap();
    let inc = ScheduleUnit::Tokens.increment(gbs, seq);
    assert_eq!(inc, 4096);
    s.step(inc);
    close(s.lr(), 0.4096);
    s.step(inc);
    close(s.lr(), 0.8192);
    s.step(inc); // 12_288 tokens: past warmup, r = 2288 / 440_560
    let r = 2288.0 / 440_560.0;
    close(
        s.lr(),
        0.1 + 0.9 * 0.5 * ((std::f64::consts::PI * r).cos() + 1.0),
    );
    // Pai's scripts turn token budgets into iterations by integer division.
    assert_eq!(pai_tokens_to_iters(1_000_000_000, gbs, seq), 244_140);
    assert_eq!(ScheduleUnit::Iterations.increment(gbs, seq), 1);
}

#[test]
fn config_errors_name_the_fields() {
    let err = |c: SchedulerConfig| OptimizerParamScheduler::new(c).unwrap_err().to_string();
    let e = err(SchedulerConfig {
        min_lr: 2.0,
        ..cfg(LrDecayStyle::Cosine)
    });
    assert!(e.contains("min_lr (2) must be <= lr (1)"), "{e}");
    let e = err(SchedulerConfig {
        lr_warmup_steps: 110,
        ..cfg(LrDecayStyle::Cosine)
    });
    assert!(
        e.contains("lr_warmup_iters (110) must be < lr_decay_iters (110)"),
        "{e}"
    );
    let e = err(SchedulerConfig {
        lr_decay_steps: 0,
        ..cfg(LrDecayStyle::Cosine)
    });
    assert!(e.contains("lr_decay_iters"), "{e}");
    let e = err(SchedulerConfig {
        lr_warmup_init: 3.0,
        ..cfg(LrDecayStyle::Cosine)
    });
    assert!(e.contains("lr_warmup_init"), "{e}");
    let e = LrDecayStyle::parse("WSD").unwrap_err().to_string();
    assert!(e.contains("lr_decay_style `WSD`"), "{e}");
    assert_eq!(
        LrDecayStyle::parse("inverse-square-root").unwrap(),
        LrDecayStyle::InverseSquareRoot
    );
}

#[test]
fn state_round_trip_and_load_policies() {
    let mut s = OptimizerParamScheduler::new(cfg(LrDecayStyle::Cosine)).unwrap();
    s.step(37);
    let state = s.export_state().unwrap();
    let json = serde_json::to_string(&state.meta).unwrap();
    let meta: SchedulerState = serde_json::from_str(&json).unwrap();
    assert_eq!(meta.wd_incr_style, "constant");

    let mut same = OptimizerParamScheduler::new(cfg(LrDecayStyle::Cosine)).unwrap();
    same.import_state(StateDict::meta_only(meta.clone()))
        .unwrap();
    assert_eq!((same.num_steps(), same.lr()), (37, s.lr()));

    let other = SchedulerConfig {
        lr: 2.0,
        ..cfg(LrDecayStyle::Linear)
    };
    let mut changed = OptimizerParamScheduler::new(other.clone()).unwrap();
    let e = changed
        .import_state(StateDict::meta_only(meta.clone()))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("lr: run 2, checkpoint 1") && e.contains("lr_decay_style"),
        "{e}"
    );
    changed
        .import_with(meta.clone(), SchedulerLoadPolicy::Override)
        .unwrap();
    assert_eq!((changed.num_steps(), changed.config().lr), (37, 2.0));
    let mut from_ckpt = OptimizerParamScheduler::new(other).unwrap();
    from_ckpt
        .import_with(meta, SchedulerLoadPolicy::UseCheckpoint)
        .unwrap();
    assert_eq!(from_ckpt.lr(), s.lr());
}
