//! AdamW against hand-computed values and against torch.optim.AdamW
//! (fixtures/optim/adamw.json, written by tools/make_optim_fixture.py).

use ferrotron_optim::*;
use half::bf16;
use serde_json::Value;

fn fixture() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../fixtures/optim/adamw.json"
    );
    let text = std::fs::read_to_string(path).expect("fixtures/optim/adamw.json");
    serde_json::from_str(&text).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// Max relative difference, with `|b|` floored at 1e-3 for values near zero.
fn max_rel(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - f64::from(y)).abs() / f64::from(y).abs().max(1e-3))
        .fold(0.0, f64::max)
}

fn no_clip(precision: Precision) -> OptimizerConfig {
    let mut c = OptimizerConfig::new(precision);
    c.clip_grad = 0.0;
    c
}

#[test]
fn hand_computed_two_steps() {
    let mut b = ParamAndGradBufferBuilder::new(BufferConfig::new(Precision::Fp32.param_dtype(), 1));
    let id = b
        .register("p.weight", &[1, 1], ParamFlags::default())
        .unwrap();
    let mut buf = b.build().unwrap();
    buf.set_param_from_f32(id, &[1.0]).unwrap();
    let mut cfg = no_clip(Precision::Fp32);
    cfg.adam.weight_decay = 0.01;
    let mut opt = Optimizer::new(cfg, &buf).unwrap();
    // Step 1: p = 1*(1 - 0.1*0.01) - 0.1 * 0.5 / (sqrt(0.25) + 1e-8) = 0.899000002.
    buf.grad_mut(id)[0] = 0.5;
    assert!(opt.step(&mut buf, 0.1, 0.01).unwrap().update_successful);
    let p1 = buf.param::<f32>(id).unwrap()[0];
    assert!((f64::from(p1) - 0.899000002).abs() < 1e-6, "{p1}");
    assert!((opt.adam().exp_avg().unwrap()[0] - 0.05).abs() < 1e-8);
    assert!((opt.adam().exp_avg_sq().unwrap()[0] - 0.00025).abs() < 1e-10);
    // Step 2 (g = -0.25): m = 0.02, v = 0.00031225, m_hat = 0.02/0.19, v_hat = v/0.001999,
    // p = 0.899000002*0.999 - 0.1*m_hat/(sqrt(v_hat)+1e-8) = 0.8714672987.
    buf.grad_mut(id)[0] = -0.25;
    opt.step(&mut buf, 0.1, 0.01).unwrap();
    let p2 = buf.param::<f32>(id).unwrap()[0];
    assert!((f64::from(p2) - 0.8714672987).abs() < 1e-6, "{p2}");
    assert_eq!(opt.adam().step_count(), 2);
}

/// Builds w [3,4], norm [4], emb [5,2] (emb lr_mult 0.5) from the fixture and runs its steps.
fn run_fixture(precision: Precision, reverse: bool) -> (ParamAndGradBuffer, Optimizer, Value) {
    let fx = fixture();
    let mut cfg = BufferConfig::new(precision.param_dtype(), 1);
    cfg.reverse_order = reverse;
    let mut b = ParamAndGradBufferBuilder::new(cfg);
    let params = fx["params"].as_array().unwrap();
    let ids: Vec<ParamId> = params
        .iter()
        .map(|p| {
            let shape: Vec<usize> = p["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as usize)
                .collect();
            b.register_auto(p["name"].as_str().unwrap(), &shape)
                .unwrap()
        })
        .collect();
    let mut buf = b.build().unwrap();
    for (id, p) in ids.iter().zip(params) {
        buf.set_param_from_f32(*id, &floats(&p["init"])).unwrap();
    }
    let mut cfg = no_clip(precision);
    cfg.adam.beta1 = fx["betas"][0].as_f64().unwrap();
    cfg.adam.beta2 = fx["betas"][1].as_f64().unwrap();
    cfg.adam.eps = fx["eps"].as_f64().unwrap();
    let mut opt = Optimizer::new(cfg, &buf).unwrap();
    for (id, p) in ids.iter().zip(params) {
        let wd_mult = if p["weight_decay"].as_f64().unwrap() == 0.0 {
            0.0
        } else {
            1.0
        };
        // The norm's zero decay must come from its flags (1-D), not from this override.
        assert_eq!(
            opt.adam().param_hyper(*id).wd_mult,
            wd_mult,
            "{}",
            p["name"]
        );
        let lr_mult = p["lr_mult"].as_f64().unwrap();
        opt.adam_mut()
            .set_param_hyper(*id, ParamHyper { lr_mult, wd_mult });
    }
    let wd = params[0]["weight_decay"].as_f64().unwrap();
    for (step, lr) in fx["lrs"].as_array().unwrap().iter().enumerate() {
        buf.zero_grad();
        for (id, p) in ids.iter().zip(params) {
            buf.grad_mut(*id)
                .copy_from_slice(&floats(&p["grads"][step]));
        }
        let out = opt.step(&mut buf, lr.as_f64().unwrap(), wd).unwrap();
        assert!(out.update_successful);
        for (id, p) in ids.iter().zip(params) {
            let name = p["name"].as_str().unwrap();
            let want = floats(&p["after_step"][step]);
            let got = match opt.adam().master_weights().unwrap() {
                Some(master) => {
                    let off = buf.info(*id).offset;
                    master[off..off + want.len()].to_vec()
                }
                None => buf.param_to_f32(*id),
            };
            let rel = max_rel(&got, &want);
            assert!(
                rel <= 1e-6,
                "{precision:?} step {step} `{name}`: rel {rel:e}"
            );
        }
    }
    (buf, opt, fx)
}

#[test]
fn matches_torch_adamw_fp32() {
    for reverse in [true, false] {
        let (buf, opt, fx) = run_fixture(Precision::Fp32, reverse);
        for p in fx["params"].as_array().unwrap() {
            let id = buf.id(p["name"].as_str().unwrap()).unwrap();
            let r = buf.info(id).range();
            let m = &opt.adam().exp_avg().unwrap()[r.clone()];
            let v = &opt.adam().exp_avg_sq().unwrap()[r];
            assert!(max_rel(m, &floats(&p["exp_avg"])) <= 1e-6);
            assert!(max_rel(v, &floats(&p["exp_avg_sq"])) <= 1e-6);
            assert_eq!(opt.adam().step_count(), p["step"].as_u64().unwrap());
            // Stronger than the 1e-6 requirement: the same fused multiply-adds as torch's
            // vectorized CPU kernels give the same bits.
            let last = p["after_step"].as_array().unwrap().last().unwrap();
            assert_eq!(buf.param_to_f32(id), floats(last), "params bit-exact");
            assert_eq!(m, floats(&p["exp_avg"]).as_slice(), "exp_avg bit-exact");
            assert_eq!(
                v,
                floats(&p["exp_avg_sq"]).as_slice(),
                "exp_avg_sq bit-exact"
            );
        }
    }
}

#[test]
fn matches_torch_adamw_bf16_master_and_rounded_params() {
    let (buf, _opt, fx) = run_fixture(Precision::Bf16, true);
    let steps = fx["lrs"].as_array().unwrap().len();
    for p in fx["params"].as_array().unwrap() {
        let id = buf.id(p["name"].as_str().unwrap()).unwrap();
        let want = floats(&p["after_step_bf16"][steps - 1]);
        let got = buf.param::<bf16>(id).unwrap();
        // The master weights match torch bit for bit, so rounding them gives the same bf16.
        let want: Vec<bf16> = want.iter().map(|&w| bf16::from_f32(w)).collect();
        assert_eq!(got, want.as_slice(), "bf16 params of `{}`", p["name"]);
    }
}

#[test]
fn step_range_pieces_equal_whole_step() {
    // 40_000 + 30_000 elements: several 16K chunks, params split across ranges.
    let build = || {
        let mut b =
            ParamAndGradBufferBuilder::new(BufferConfig::new(Precision::Bf16.param_dtype(), 1));
        let a = b.register_auto("a.weight", &[200, 200]).unwrap();
        let c = b.register_auto("c.bias", &[30_000]).unwrap();
        let mut buf = b.build().unwrap();
        let va: Vec<f32> = (0..40_000)
            .map(|i| ((i % 97) as f32 - 48.0) * 0.01)
            .collect();
        let vc: Vec<f32> = (0..30_000).map(|i| ((i % 13) as f32) * 0.1).collect();
        buf.set_param_from_f32(a, &va).unwrap();
        buf.set_param_from_f32(c, &vc).unwrap();
        for (i, g) in buf.grads_mut().iter_mut().enumerate() {
            *g = ((i % 31) as f32 - 15.0) * 1e-3;
        }
        buf
    };
    let cfg = AdamWConfig {
        weight_decay: 0.1,
        ..AdamWConfig::default()
    };
    let mut whole = build();
    let mut adam_whole = AdamW::new(cfg, &whole).unwrap();
    adam_whole.step(&mut whole, 1e-3, 0.1, 1.0).unwrap();

    let mut pieces = build();
    let mut adam_pieces = AdamW::new(cfg, &pieces).unwrap();
    adam_pieces.begin_step();
    let n = pieces.numel();
    for r in [0..12_345, 12_345..50_001, 50_001..n] {
        adam_pieces
            .step_range(&mut pieces, r, 1e-3, 0.1, 1.0)
            .unwrap();
    }
    assert_eq!(
        adam_whole.master_weights().unwrap(),
        adam_pieces.master_weights().unwrap()
    );
    assert_eq!(
        adam_whole.exp_avg_sq().unwrap(),
        adam_pieces.exp_avg_sq().unwrap()
    );
    assert_eq!(
        whole.params_flat::<bf16>().unwrap(),
        pieces.params_flat::<bf16>().unwrap()
    );
    // Padding elements are never written.
    let used: usize = pieces.params().iter().map(|p| p.numel).sum();
    let nonzero_m = adam_pieces
        .exp_avg()
        .unwrap()
        .iter()
        .filter(|&&m| m != 0.0)
        .count();
    assert!(nonzero_m <= used);
}

#[test]
fn sharded_adamw_matches_full_on_its_ranges() {
    let mut cfg = BufferConfig::new(Precision::Fp32.param_dtype(), 2);
    cfg.bucket_size = Some(300);
    let mut b = ParamAndGradBufferBuilder::new(cfg);
    for i in 0..4 {
        b.register_auto(&format!("l{i}.weight"), &[10, 17]).unwrap();
    }
    let mut full = b.build().unwrap();
    for (i, p) in full
        .params_flat_mut::<f32>()
        .unwrap()
        .iter_mut()
        .enumerate()
    {
        *p = (i as f32 * 0.37).sin();
    }
    for (i, g) in full.grads_mut().iter_mut().enumerate() {
        *g = (i as f32 * 0.11).cos();
    }
    let mut shard_buf = full.clone();
    let owned = OwnedRanges::distributed_shard(&shard_buf, 1, 2).unwrap();
    let mut adam_full = AdamW::new(AdamWConfig::default(), &full).unwrap();
    let mut adam_shard =
        AdamW::new_sharded(AdamWConfig::default(), &shard_buf, owned.ranges().to_vec()).unwrap();
    adam_full.step(&mut full, 1e-2, 0.01, 1.0).unwrap();
    adam_shard.step(&mut shard_buf, 1e-2, 0.01, 1.0).unwrap();
    let pf = full.params_flat::<f32>().unwrap();
    let ps = shard_buf.params_flat::<f32>().unwrap();
    for (r, local) in adam_shard.owned().iter() {
        assert_eq!(&pf[r.clone()], &ps[r.clone()]);
        assert_eq!(
            &adam_full.exp_avg().unwrap()[r.clone()],
            &adam_shard.exp_avg().unwrap()[local..local + r.len()]
        );
    }
    // Outside the owned shard nothing changed.
    let before = (0..ps.len()).map(|i| (i as f32 * 0.37).sin());
    let owned_any = |i: usize| adam_shard.owned().ranges().iter().any(|r| r.contains(&i));
    for (i, want) in before.enumerate() {
        if !owned_any(i) && full.params().iter().any(|p| p.range().contains(&i)) {
            assert_eq!(ps[i], want);
        }
    }
    assert!(
        adam_shard
            .step_range(&mut shard_buf, 0..1, 1e-2, 0.0, 1.0)
            .is_err()
    );
}
