use super::*;
use crate::moe::losses::{aux_loss, z_loss};

fn logits(t: usize, e: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..t * e)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

fn config(score_function: ScoreFunction, pre_softmax: bool) -> RouterConfig {
    RouterConfig {
        num_experts: 8,
        topk: 2,
        score_function,
        pre_softmax,
        groups: None,
        scaling_factor: None,
    }
}

/// The variants under test: Mixtral, Qwen2-MoE, DeepSeek-V2 (group max, scaled), Megatron's
/// sum-of-top groups, sigmoid with a bias and k = 1.
fn variants() -> Vec<(&'static str, RouterConfig, Option<Vec<f32>>)> {
    let groups = |score| {
        Some(ExpertGroups {
            num_groups: 4,
            group_topk: 2,
            score,
        })
    };
    let mut deepseek = config(ScoreFunction::Softmax, true);
    deepseek.groups = groups(GroupScore::Max);
    deepseek.scaling_factor = Some(16.0);
    let mut megatron_groups = config(ScoreFunction::Softmax, false);
    megatron_groups.groups = groups(GroupScore::SumOfTop);
    let mut top1 = config(ScoreFunction::Sigmoid, false);
    top1.topk = 1;
    let bias: Vec<f32> = (0..8).map(|i| 0.05 * i as f32 - 0.2).collect();
    vec![
        ("softmax", config(ScoreFunction::Softmax, false), None),
        ("pre_softmax", config(ScoreFunction::Softmax, true), None),
        ("deepseek groups", deepseek, None),
        ("megatron groups", megatron_groups, None),
        (
            "sigmoid + bias",
            config(ScoreFunction::Sigmoid, false),
            Some(bias),
        ),
        ("sigmoid top-1", top1, None),
    ]
}

/// Central differences of `f` at `z` against `grad`, keeping the routing fixed (the logits
/// move by 1e-3, far less than the gaps between the chosen and the rest here).
fn check_fd(name: &str, z: &[f32], grad: &[f32], f: impl Fn(&[f32]) -> f64) {
    let h = 1e-3f32;
    for i in 0..z.len() {
        let (mut a, mut b) = (z.to_vec(), z.to_vec());
        a[i] += h;
        b[i] -= h;
        let fd = (f(&a) - f(&b)) / (2.0 * h as f64);
        assert!(
            // f32 rounding of the objective (up to ~30 here) over 2h: ~1e-3 absolute.
            (fd - grad[i] as f64).abs() <= 2e-3 * fd.abs() + 1e-3,
            "{name} [{i}]: fd {fd} vs {}",
            grad[i]
        );
    }
}

#[test]
fn routing_backward_matches_finite_differences() {
    let z = logits(5, 8, 1);
    for (name, cfg, bias) in variants() {
        let r = cfg.route(&z, bias.as_deref()).unwrap();
        let w: Vec<f32> = (0..r.probs.len()).map(|i| 0.3 + 0.1 * i as f32).collect();
        let dz = cfg.backward(&r, &w);
        let objective = |z: &[f32]| {
            let moved = cfg.route(z, bias.as_deref()).unwrap();
            assert_eq!(moved.experts, r.experts, "{name}: the routing moved");
            moved
                .probs
                .iter()
                .zip(&w)
                .map(|(p, w)| (p * w) as f64)
                .sum()
        };
        check_fd(name, &z, &dz, objective);
    }
}

#[test]
fn known_routings() {
    let z = [1.0f32, 3.0, 2.0, 0.0];
    let mut cfg = config(ScoreFunction::Softmax, false);
    cfg.num_experts = 4;
    // Mixtral: top-2 of the logits, softmax over the two = renormalised full softmax.
    let r = cfg.route(&z, None).unwrap();
    assert_eq!(r.experts, [1, 2]);
    let e = (-1f32).exp();
    assert!((r.probs[0] - 1.0 / (1.0 + e)).abs() < 1e-6);
    assert!((r.probs[1] - e / (1.0 + e)).abs() < 1e-6);
    // Qwen2-MoE: the full softmax's values, not renormalised.
    cfg.pre_softmax = true;
    let r = cfg.route(&z, None).unwrap();
    let sum: f32 = z.iter().map(|v| v.exp()).sum();
    assert_eq!(r.experts, [1, 2]);
    assert!((r.probs[0] - 3f32.exp() / sum).abs() < 1e-6);
    // Groups of two (routing on the logits): [1, 3] and [2, 0] score 3 and 2 by their best;
    // keep one group: experts 1 and 0, not 2.
    cfg.pre_softmax = false;
    cfg.groups = Some(ExpertGroups {
        num_groups: 2,
        group_topk: 1,
        score: GroupScore::Max,
    });
    assert_eq!(cfg.route(&z, None).unwrap().experts, [1, 0]);
    // Where the group scores differ: [3, -5 | 2, 2]: the best score keeps group 0, the sum of
    // the best k / group_topk = 2 keeps group 1 (-2 vs 4).
    cfg.groups.as_mut().unwrap().score = GroupScore::SumOfTop;
    let differ = [3.0f32, -5.0, 2.0, 2.0];
    assert_eq!(cfg.route(&differ, None).unwrap().experts, [2, 3]);
    cfg.groups.as_mut().unwrap().score = GroupScore::Max;
    assert_eq!(cfg.route(&differ, None).unwrap().experts, [0, 1]);
    // The aux loss counts the plain top-k of the softmax (experts 0 and 2), whatever the
    // groups chose: coeff·E/(k·T²)·(p_0 + p_2) for one token.
    let p = softmax(&differ);
    let (loss, _) = aux_loss(&cfg, &differ, 0.5);
    assert!(
        (loss - 0.5 * 4.0 / 2.0 * (p[0] + p[2])).abs() < 1e-6,
        "{loss}"
    );
    // Sigmoid with a bias: the bias picks, the unbiased scores weigh (normalised).
    let mut sig = config(ScoreFunction::Sigmoid, false);
    sig.num_experts = 4;
    let r = sig.route(&z, Some(&[0.0, 0.0, 0.0, 10.0])).unwrap();
    assert_eq!(r.experts, [3, 1]);
    let (s3, s1) = (sigmoid(0.0), sigmoid(3.0));
    assert!((r.probs[0] - s3 / (s3 + s1)).abs() < 1e-6);
    // Ties go to the lower id.
    assert_eq!(sig.route(&[0.0; 4], None).unwrap().experts, [0, 1]);
}

#[test]
fn aux_and_z_losses_match_finite_differences_and_megatrons_formula() {
    let z = logits(6, 8, 2);
    for (name, cfg, bias) in variants() {
        let r = cfg.route(&z, bias.as_deref()).unwrap();
        let (loss, dz) = aux_loss(&cfg, &z, 0.01);
        check_fd(name, &z, &dz, |z| aux_loss(&cfg, z, 0.01).0 as f64);
        if cfg.score_function == ScoreFunction::Softmax && cfg.groups.is_none() {
            // Without groups (or bias) the aux loss counts the routed experts themselves.
            // coeff·E/(k·T²)·Σ_e (Σ_t p_te)·c_e, written out.
            let (e, k, t) = (8usize, cfg.topk, 6usize);
            let mut p_sum = vec![0f64; e];
            for row in z.chunks_exact(e) {
                softmax(row)
                    .iter()
                    .enumerate()
                    .for_each(|(i, p)| p_sum[i] += *p as f64);
            }
            let mut c = vec![0f64; e];
            r.experts.iter().for_each(|&x| c[x as usize] += 1.0);
            let want: f64 = p_sum.iter().zip(&c).map(|(p, c)| p * c).sum::<f64>() * 0.01 * e as f64
                / (k * t * t) as f64;
            assert!(
                (loss as f64 - want).abs() < 1e-7,
                "{name}: {loss} vs {want}"
            );
        }
    }
    let (zl, dz) = z_loss(&z, 8, 1e-3);
    check_fd("z-loss", &z, &dz, |z| z_loss(z, 8, 1e-3).0 as f64);
    let lse = |row: &[f32]| row.iter().map(|v| (*v as f64).exp()).sum::<f64>().ln();
    let want = z.chunks_exact(8).map(|r| lse(r).powi(2)).sum::<f64>() / 6.0 * 1e-3;
    assert!((zl as f64 - want).abs() < 1e-7, "{zl} vs {want}");
}

#[test]
fn bad_options_name_themselves() {
    let err = |cfg: RouterConfig| cfg.route(&[0.0; 8], None).unwrap_err().to_string();
    let mut c = config(ScoreFunction::Softmax, false);
    c.topk = 9;
    assert!(err(c).contains("moe_router_topk: 9 must be in 1..=8"));
    assert!(err(config(ScoreFunction::Sigmoid, true)).contains("moe_router_pre_softmax"));
    let mut c = config(ScoreFunction::Softmax, false);
    c.groups = Some(ExpertGroups {
        num_groups: 3,
        group_topk: 1,
        score: GroupScore::Max,
    });
    assert!(err(c).contains("moe_router_num_groups: 3 must divide num_experts 8"));
    let c = config(ScoreFunction::Softmax, false);
    let e = c.route(&[0.0; 8], Some(&[0.0; 8])).unwrap_err().to_string();
    assert!(
        e.contains("expert_bias: needs the sigmoid score function"),
        "{e}"
    );
    let e = c.route(&[0.0; 7], None).unwrap_err().to_string();
    assert!(e.contains("router logits: 7 values"), "{e}");
}

#[test]
fn capacity_drops_by_weight_or_position() {
    let mut cfg = config(ScoreFunction::Softmax, true);
    cfg.num_experts = 2;
    cfg.topk = 1;
    // Four tokens, all to expert 0, weights ordered 1 < 3 < 4 < 2 (by their logit gaps).
    let logits = [0.4f32, 0.0, 2.2, 0.0, 0.8, 0.0, 1.5, 0.0];
    let routed = cfg.route(&logits, None).unwrap();
    assert_eq!(routed.experts, [0, 0, 0, 0]);
    // capacity ceil(4 / 2 · 1.0) = 2: by weight tokens 2 and 3 stay, by position 0 and 1.
    let mut by_probs = routed.clone();
    assert_eq!(
        by_probs
            .drop_over_capacity(2, 1.0, DropPolicy::Probs)
            .unwrap(),
        2
    );
    assert_eq!(by_probs.dropped, [true, false, true, false]);
    assert_eq!(by_probs.probs[0], 0.0);
    let mut by_position = routed.clone();
    assert_eq!(
        by_position
            .drop_over_capacity(2, 1.0, DropPolicy::Position)
            .unwrap(),
        2
    );
    assert_eq!(by_position.dropped, [false, false, true, true]);
    // A generous factor drops nothing; a dropped slot gets no gradient.
    let mut all = routed.clone();
    assert_eq!(
        all.drop_over_capacity(2, 2.0, DropPolicy::Probs).unwrap(),
        0
    );
    let dz = cfg.backward(&by_position, &[1.0; 4]);
    assert!(dz[4..].iter().all(|&d| d == 0.0), "{dz:?}");
    assert!(dz[..4].iter().any(|&d| d != 0.0));
    let e = all
        .drop_over_capacity(2, 0.0, DropPolicy::Probs)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("moe_expert_capacity_factor: 0 must be > 0"),
        "{e}"
    );
}
