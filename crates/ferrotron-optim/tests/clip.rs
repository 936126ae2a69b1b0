//! Gradient clipping by global L2 norm (Megatron clip_grads.py) and its use in the step.

use ferrotron_optim::clip::{clip_coeff, clip_grad_norm, grad_sq_sum, unscale_and_check_finite};
use ferrotron_optim::*;

#[test]
fn norm_and_coefficient() {
    assert_eq!(grad_sq_sum(&[3.0, 4.0]), 25.0);
    assert_eq!(clip_coeff(1.0, 5.0), 1.0 / (5.0 + 1e-6));
    // Clipped: 3-4-5 triangle to norm 1.
    let (mut a, mut b) = ([3.0f32], [4.0f32]);
    let norm = clip_grad_norm(&[&a.clone(), &b.clone()], &mut [&mut a, &mut b], 1.0, |s| s);
    assert_eq!(norm, 5.0);
    let coeff = (1.0 / (5.0 + 1e-6)) as f32;
    assert_eq!((a[0], b[0]), (3.0 * coeff, 4.0 * coeff));
    // Not clipped when the coefficient is >= 1.
    let mut c = [3.0f32, 4.0];
    let norm = clip_grad_norm(&[&c.clone()], &mut [&mut c], 10.0, |s| s);
    assert_eq!((norm, c), (5.0, [3.0, 4.0]));
    // The reduction sees the local partial: two identical ranks double the sum of squares.
    let mut d = [3.0f32, 4.0];
    let norm = clip_grad_norm(&[&d.clone()], &mut [&mut d], 0.0, |s| 2.0 * s);
    assert_eq!(norm, 50f64.sqrt());
    assert_eq!(d, [3.0, 4.0]); // max_norm 0: measure only
}

#[test]
fn f64_accumulation_over_many_elements() {
    // 1e6 elements of 1e-3: f32 accumulation would drift; f64 gives 1.0 to ~1e-12.
    let g = vec![1e-3f32; 1_000_000];
    let s = grad_sq_sum(&g);
    let exact = 1e6 * f64::from(1e-3f32) * f64::from(1e-3f32);
    assert!((s - exact).abs() < 1e-12, "{s} vs {exact}");
}

#[test]
fn sq_sum_of_every_length_and_non_finite_values() {
    // Lengths around the lane and chunk sizes; squares of small integers sum exactly in f64.
    for n in [
        0,
        1,
        15,
        16,
        17,
        33,
        63,
        64,
        65,
        129,
        64 * 1024 - 1,
        64 * 1024,
        64 * 1024 + 17,
        200_003,
    ] {
        let g: Vec<f32> = (0..n).map(|i| (i % 7) as f32 - 3.0).collect();
        let exact: f64 = g.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        assert_eq!(grad_sq_sum(&g), exact, "n = {n}");
    }
    let mut g = vec![1.0f32; 100_000];
    g[77_777] = f32::INFINITY;
    assert_eq!(grad_sq_sum(&g), f64::INFINITY);
    g[5] = f32::NAN;
    assert!(grad_sq_sum(&g).is_nan());
}

#[test]
fn unscale_reports_non_finite_before_scaling() {
    let mut g = [2.0f32, 4.0];
    assert!(!unscale_and_check_finite(&mut g, 0.5));
    assert_eq!(g, [1.0, 2.0]);
    let mut g = [1.0f32, f32::NAN, 1.0];
    assert!(unscale_and_check_finite(&mut g, 0.5));
}

fn two_param_buffer() -> (ParamAndGradBuffer, ParamId, ParamId) {
    let mut b = ParamAndGradBufferBuilder::new(BufferConfig::new(Precision::Bf16.param_dtype(), 1));
    let w = b.register_auto("w.weight", &[2, 2]).unwrap();
    let dup = b
        .register(
            "norm.weight",
            &[2],
            ParamFlags {
                is_norm_or_bias: true,
                exclude_from_grad_norm: true, // e.g. a tensor-parallel duplicate on tp rank 1
                ..ParamFlags::default()
            },
        )
        .unwrap();
    (b.build().unwrap(), w, dup)
}

#[test]
fn optimizer_clips_owned_grads_with_global_norm() {
    let (mut buf, w, dup) = two_param_buffer();
    let mut opt = Optimizer::new(OptimizerConfig::new(Precision::Bf16), &buf).unwrap();
    assert_eq!(opt.config().clip_grad, 1.0);
    buf.grad_mut(w).copy_from_slice(&[1.0, 2.0, 2.0, 4.0]); // norm 5
    buf.grad_mut(dup).copy_from_slice(&[100.0, 100.0]); // excluded from the norm
    assert_eq!(opt.local_grad_sq_sum(&buf), 25.0);
    let norm = opt.clip_grad_norm(&mut buf, &mut NoReduce).unwrap();
    assert_eq!(norm, 5.0);
    let coeff = (1.0 / (5.0 + 1e-6)) as f32;
    assert_eq!(buf.grad(w), &[coeff, 2.0 * coeff, 2.0 * coeff, 4.0 * coeff]);
    assert_eq!(buf.grad(dup), &[100.0 * coeff, 100.0 * coeff]); // but still clipped

    // A reducer standing in for 4 ranks with equal partials: global norm 10.
    struct FourRanks;
    impl GradStatsReduce for FourRanks {
        fn all_reduce_sum(&mut self, local: f64) -> ferrotron_optim::Result<f64> {
            Ok(4.0 * local)
        }
        fn all_reduce_max(&mut self, local: f64) -> ferrotron_optim::Result<f64> {
            Ok(local)
        }
    }
    buf.grad_mut(w).copy_from_slice(&[1.0, 2.0, 2.0, 4.0]);
    let out = opt.step_with(&mut buf, 1e-3, 0.0, &mut FourRanks).unwrap();
    assert_eq!(out.grad_norm, Some(10.0));
    assert!(out.update_successful);
}

#[test]
fn bf16_non_finite_grad_skips_the_update() {
    let (mut buf, w, _) = two_param_buffer();
    let mut opt = Optimizer::new(OptimizerConfig::new(Precision::Bf16), &buf).unwrap();
    let before = buf.param_to_f32(w);
    buf.grad_mut(w)[1] = f32::INFINITY;
    let out = opt.step(&mut buf, 1e-3, 0.1).unwrap();
    assert!(!out.update_successful && out.found_inf);
    assert_eq!(out.loss_scale, 1.0);
    assert!(!out.grad_norm.unwrap().is_finite());
    assert_eq!((opt.skipped_iterations(), opt.adam().step_count()), (1, 0));
    assert_eq!(buf.param_to_f32(w), before);
}

#[test]
fn clipping_inside_adamw_updates_as_clipping_the_grads_first() {
    // step_with multiplies each gradient by the clip coefficient inside AdamW's pass; the
    // masters and moments must be those of scaling the gradients first (Megatron's order).
    let run = |fold: bool| {
        let (mut buf, w, dup) = two_param_buffer();
        let mut opt = Optimizer::new(OptimizerConfig::new(Precision::Bf16), &buf).unwrap();
        for step in 1..=3 {
            let s = step as f32;
            buf.grad_mut(w)
                .copy_from_slice(&[1.0 * s, -2.0, 2.5, 4.0 / s]); // clipped
            buf.grad_mut(dup).copy_from_slice(&[0.3, -0.1 * s]);
            if fold {
                let out = opt.step_with(&mut buf, 1e-2, 0.1, &mut NoReduce).unwrap();
                assert!(out.update_successful && out.grad_norm.unwrap() > 1.0);
            } else {
                opt.clip_grad_norm(&mut buf, &mut NoReduce).unwrap();
                opt.adam_mut().step(&mut buf, 1e-2, 0.1, 1.0).unwrap();
            }
        }
        let adam = opt.adam();
        (
            adam.master_weights().unwrap(),
            adam.exp_avg().unwrap(),
            adam.exp_avg_sq().unwrap(),
        )
    };
    assert_eq!(run(true), run(false));
}
