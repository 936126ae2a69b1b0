//! The experts on one rank: each token through its experts written out (with and without
//! tokens dropped over capacity), and finite differences for every gradient.

use ferrotron_nn::moe::{DropPolicy, ExpertWeights, Routing, experts_backward, experts_forward};
use ferrotron_tensor::gemm::WeightRef;

mod common;
use common::{mixtral_router, values};

const T: usize = 5;
const H: usize = 6;
const F: usize = 4;
const E: usize = 4;

fn routing() -> Routing {
    let cfg = mixtral_router(E);
    cfg.route(&values(T * E, 1, 4.0), None).unwrap()
}

/// One token through one expert, written out: `fc2 · (silu(gate) · up)`.
fn expert(x: &[f32], e: usize, fc1: &[f32], fc2: &[f32]) -> Vec<f32> {
    let dot = |w: &[f32], v: &[f32]| w.iter().zip(v).map(|(a, b)| (a * b) as f64).sum::<f64>();
    let w1 = &fc1[e * 2 * F * H..][..2 * F * H];
    let act: Vec<f32> = (0..F)
        .map(|i| {
            let (g, u) = (dot(&w1[i * H..][..H], x), dot(&w1[(F + i) * H..][..H], x));
            (g / (1.0 + (-g).exp()) * u) as f32
        })
        .collect();
    let w2 = &fc2[e * H * F..][..H * F];
    (0..H)
        .map(|o| dot(&w2[o * F..][..F], &act) as f32)
        .collect()
}

#[test]
fn grouped_experts_equal_each_token_through_its_experts() {
    for capacity in [None, Some(0.5f32)] {
        grouped_experts_case(capacity);
    }
}

fn grouped_experts_case(capacity: Option<f32>) {
    let (x, fc1, fc2) = (
        values(T * H, 2, 2.0),
        values(E * 2 * F * H, 3, 1.0),
        values(E * H * F, 4, 1.0),
    );
    let w = ExpertWeights {
        fc1: WeightRef::F32(&fc1),
        fc2: WeightRef::F32(&fc2),
        hidden: H,
        ffn: F,
    };
    let mut r = routing();
    if let Some(c) = capacity {
        assert!(r.drop_over_capacity(E, c, DropPolicy::Probs).unwrap() > 0);
    }
    let (y, acts) = experts_forward(&x, &r, &w);
    for t in 0..T {
        let mut want = vec![0f32; H];
        for j in (0..2).filter(|&j| !r.dropped[t * 2 + j]) {
            let out = expert(&x[t * H..][..H], r.experts[t * 2 + j] as usize, &fc1, &fc2);
            want.iter_mut()
                .zip(out)
                .for_each(|(a, o)| *a += r.probs[t * 2 + j] * o);
        }
        for (g, w) in y[t * H..][..H].iter().zip(&want) {
            assert!((g - w).abs() <= 1e-5, "token {t}: {g} vs {w}");
        }
    }
    // Every expert's rows are contiguous and in token order.
    let p = &acts.perm;
    assert_eq!(p.offsets[E], r.dropped.iter().filter(|d| !**d).count());
    for e in 0..E {
        let rows = &p.slots[p.offsets[e]..p.offsets[e + 1]];
        assert!(rows.windows(2).all(|s| s[0] < s[1]));
        assert!(rows.iter().all(|&s| r.experts[s] as usize == e));
    }
}

#[test]
fn experts_backward_matches_finite_differences() {
    let (x, fc1, fc2) = (
        values(T * H, 5, 2.0),
        values(E * 2 * F * H, 6, 1.0),
        values(E * H * F, 7, 1.0),
    );
    let c = values(T * H, 8, 2.0);
    // Capacity 0.75 drops some slots: no rows, no weight gradient.
    let mut r = routing();
    assert!(r.drop_over_capacity(E, 0.75, DropPolicy::Position).unwrap() > 0);
    let loss = |x: &[f32], fc1: &[f32], fc2: &[f32], r: &Routing| {
        let w = ExpertWeights {
            fc1: WeightRef::F32(fc1),
            fc2: WeightRef::F32(fc2),
            hidden: H,
            ffn: F,
        };
        let (y, _) = experts_forward(x, r, &w);
        y.iter().zip(&c).map(|(y, c)| (y * c) as f64).sum::<f64>()
    };
    let w = ExpertWeights {
        fc1: WeightRef::F32(&fc1),
        fc2: WeightRef::F32(&fc2),
        hidden: H,
        ffn: F,
    };
    let (_, acts) = experts_forward(&x, &r, &w);
    let g = experts_backward(&r, &w, &acts, &c);
    let h = 1e-2f32;
    let check = |name: &str, i: usize, plus: f64, minus: f64, got: f32| {
        let fd = (plus - minus) / (2.0 * h as f64);
        assert!(
            (fd - got as f64).abs() <= 2e-3 * fd.abs() + 2e-3,
            "{name}[{i}]: fd {fd} vs {got}"
        );
    };
    for i in 0..x.len() {
        let (mut a, mut b) = (x.clone(), x.clone());
        a[i] += h;
        b[i] -= h;
        check(
            "dx",
            i,
            loss(&a, &fc1, &fc2, &r),
            loss(&b, &fc1, &fc2, &r),
            g.dx[i],
        );
    }
    for i in 0..fc1.len() {
        let (mut a, mut b) = (fc1.clone(), fc1.clone());
        a[i] += h;
        b[i] -= h;
        check(
            "dfc1",
            i,
            loss(&x, &a, &fc2, &r),
            loss(&x, &b, &fc2, &r),
            g.dfc1[i],
        );
    }
    for i in 0..fc2.len() {
        let (mut a, mut b) = (fc2.clone(), fc2.clone());
        a[i] += h;
        b[i] -= h;
        check(
            "dfc2",
            i,
            loss(&x, &fc1, &a, &r),
            loss(&x, &fc1, &b, &r),
            g.dfc2[i],
        );
    }
    for i in 0..r.probs.len() {
        let (mut a, mut b) = (r.clone(), r.clone());
        a.probs[i] += h;
        b.probs[i] -= h;
        check(
            "dprobs",
            i,
            loss(&x, &fc1, &fc2, &a),
            loss(&x, &fc1, &fc2, &b),
            g.dprobs[i],
        );
    }
}

/// Megatron's `moe_pad_expert_input_to_capacity`: every expert computes `min(capacity, T)`
/// rows (its kept tokens, then other tokens at weight 0), and the output and every gradient
/// are the unpadded routing's.
#[test]
fn padding_to_capacity_changes_no_value() {
    let (x, fc1, fc2) = (
        values(T * H, 9, 2.0),
        values(E * 2 * F * H, 10, 1.0),
        values(E * H * F, 11, 1.0),
    );
    let dy = values(T * H, 12, 2.0);
    let w = ExpertWeights {
        fc1: WeightRef::F32(&fc1),
        fc2: WeightRef::F32(&fc2),
        hidden: H,
        ffn: F,
    };
    // Capacity ceil(5·2/4 · 1.0) = 3 rows per expert; at 4.0 (10 > T) every token.
    for (factor, rows) in [(1.0f32, 3), (4.0, T)] {
        let mut plain = routing();
        plain
            .drop_over_capacity(E, factor, DropPolicy::Probs)
            .unwrap();
        let mut padded = plain.clone();
        padded.pad_to_capacity(E, factor).unwrap();
        assert_eq!(padded.pad_rows(), Some(rows));
        let (y0, a0) = experts_forward(&x, &plain, &w);
        let (y1, a1) = experts_forward(&x, &padded, &w);
        let p = &a1.perm;
        for e in 0..E {
            assert_eq!(
                p.offsets[e + 1] - p.offsets[e],
                rows,
                "factor {factor} expert {e}"
            );
        }
        assert!(p.offsets[E] > a0.perm.offsets[E], "padding adds rows");
        let close = |what: &str, a: &[f32], b: &[f32]| {
            for (i, (u, v)) in a.iter().zip(b).enumerate() {
                assert!(
                    (u - v).abs() <= 1e-6 * v.abs().max(1.0),
                    "{what}[{i}]: {u} vs {v}"
                );
            }
        };
        close("y", &y1, &y0);
        let (g0, g1) = (
            experts_backward(&plain, &w, &a0, &dy),
            experts_backward(&padded, &w, &a1, &dy),
        );
        close("dx", &g1.dx, &g0.dx);
        close("dprobs", &g1.dprobs, &g0.dprobs);
        close("dfc1", &g1.dfc1, &g0.dfc1);
        close("dfc2", &g1.dfc2, &g0.dfc2);
    }
}
