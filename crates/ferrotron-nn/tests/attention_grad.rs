//! Core attention backward: f64 finite differences, an f64 analytic reference for sizes that
//! span several key blocks, GQA, sliding windows, a query offset, batch 2, and determinism.

use ferrotron_nn::attention::AttentionPrecision::{self, F32};
use ferrotron_nn::attention::{
    AttentionDims, AttentionMask, core_attention, core_attention_backward,
    core_attention_forward_train,
};
use ferrotron_tensor::ops::tile_bf16::bf16_tiles_available;

/// xorshift64*: reproducible inputs, rounded to f32 so both paths see the same numbers.
struct Rng(u64);

impl Rng {
    fn vec(&mut self, n: usize, scale: f64) -> Vec<f64> {
        (0..n)
            .map(|_| {
                self.0 ^= self.0 >> 12;
                self.0 ^= self.0 << 25;
                self.0 ^= self.0 >> 27;
                let u = (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64;
                ((2.0 * u / (1u64 << 53) as f64 - 1.0) * scale) as f32 as f64
            })
            .collect()
    }
}

fn f32s(x: &[f64]) -> Vec<f32> {
    x.iter().map(|&v| v as f32).collect()
}

fn visible(dims: &AttentionDims, mask: AttentionMask, t: usize, p: usize) -> bool {
    let pos = dims.q_offset + t;
    p <= pos && mask.sliding_window.is_none_or(|w| pos - p < w)
}

/// Row-major index helpers for q-like `[sq, b, a, d]` and kv-like `[skv, b, g, d]` tensors.
fn qi(dims: &AttentionDims, t: usize, j: usize, h: usize) -> usize {
    ((t * dims.batch + j) * dims.heads + h) * dims.head_dim
}
fn ki(dims: &AttentionDims, p: usize, j: usize, gh: usize) -> usize {
    ((p * dims.batch + j) * dims.groups + gh) * dims.head_dim
}

/// Softmax probabilities of one (t, j, h) row over all keys (0 where masked), in f64.
fn probs(
    q: &[f64],
    k: &[f64],
    dims: &AttentionDims,
    mask: AttentionMask,
    t: usize,
    j: usize,
    h: usize,
) -> Vec<f64> {
    let d = dims.head_dim;
    let gh = h / (dims.heads / dims.groups);
    let qr = &q[qi(dims, t, j, h)..][..d];
    let s: Vec<f64> = (0..dims.skv)
        .map(|p| {
            if !visible(dims, mask, t, p) {
                return f64::NEG_INFINITY;
            }
            let kr = &k[ki(dims, p, j, gh)..][..d];
            qr.iter().zip(kr).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt()
        })
        .collect();
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
    s.iter().map(|x| (x - m).exp() / z).collect()
}

/// Reference forward in f64: `(out, lse)`.
fn forward_ref(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dims: &AttentionDims,
    mask: AttentionMask,
) -> (Vec<f64>, Vec<f64>) {
    let AttentionDims {
        sq,
        batch: b,
        heads: a,
        groups: g,
        head_dim: d,
        ..
    } = *dims;
    let mut out = vec![0f64; q.len()];
    let mut lse = vec![0f64; sq * b * a];
    for t in 0..sq {
        for j in 0..b {
            for h in 0..a {
                let gh = h / (a / g);
                let p = probs(q, k, dims, mask, t, j, h);
                let o = qi(dims, t, j, h);
                for (pos, &w) in p.iter().enumerate() {
                    for c in 0..d {
                        out[o + c] += w * v[ki(dims, pos, j, gh) + c];
                    }
                }
                // lse = s_i − log p_i for any visible key i.
                let pos = dims.q_offset + t;
                let qr = &q[o..][..d];
                let s = qr
                    .iter()
                    .zip(&k[ki(dims, pos, j, gh)..][..d])
                    .map(|(x, y)| x * y)
                    .sum::<f64>()
                    / (d as f64).sqrt();
                lse[(t * b + j) * a + h] = s - p[pos].ln();
            }
        }
    }
    (out, lse)
}

/// Reference backward in f64 with explicit P and dS: `(dq, dk, dv)`.
fn backward_ref(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
    dims: &AttentionDims,
    mask: AttentionMask,
) -> [Vec<f64>; 3] {
    let AttentionDims {
        sq,
        skv,
        batch: b,
        heads: a,
        groups: g,
        head_dim: d,
        ..
    } = *dims;
    let scale = 1.0 / (d as f64).sqrt();
    let (mut dq, mut dk, mut dv) = (
        vec![0f64; q.len()],
        vec![0f64; k.len()],
        vec![0f64; v.len()],
    );
    for t in 0..sq {
        for j in 0..b {
            for h in 0..a {
                let gh = h / (a / g);
                let p = probs(q, k, dims, mask, t, j, h);
                let o = qi(dims, t, j, h);
                let dor = &dout[o..][..d];
                let dp: Vec<f64> = (0..skv)
                    .map(|pos| {
                        dor.iter()
                            .zip(&v[ki(dims, pos, j, gh)..][..d])
                            .map(|(x, y)| x * y)
                            .sum()
                    })
                    .collect();
                let delta: f64 = p.iter().zip(&dp).map(|(x, y)| x * y).sum();
                for pos in 0..skv {
                    let ds = p[pos] * (dp[pos] - delta);
                    let kk = ki(dims, pos, j, gh);
                    for c in 0..d {
                        dv[kk + c] += p[pos] * dor[c];
                        dq[o + c] += ds * k[kk + c] * scale;
                        dk[kk + c] += ds * q[o + c] * scale;
                    }
                }
            }
        }
    }
    [dq, dk, dv]
}

/// `max |got − want| / max |want|`, printed and checked against `tol`.
fn check(name: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    let err = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (&g, &w)| m.max((g as f64 - w).abs()));
    println!(
        "{name}: max abs err {err:.3e}, relative {:.3e} (tol {tol:.0e})",
        err / scale
    );
    assert!(
        err / scale <= tol,
        "{name}: relative error {:e}",
        err / scale
    );
}

struct Run {
    out: Vec<f32>,
    lse: Vec<f32>,
    grads: [Vec<f32>; 3],
}

fn run_f32(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
    dims: AttentionDims,
    mask: AttentionMask,
) -> Run {
    let x = [q, k, v, dout].map(<[f64]>::to_vec);
    run(&x, dims, mask, F32)
}

fn inputs(dims: &AttentionDims, seed: u64) -> [Vec<f64>; 4] {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let nq = dims.sq * dims.batch * dims.heads * dims.head_dim;
    let nk = dims.skv * dims.batch * dims.groups * dims.head_dim;
    [
        rng.vec(nq, 1.5),
        rng.vec(nk, 1.5),
        rng.vec(nk, 1.0),
        rng.vec(nq, 1.0),
    ]
}

#[test]
fn small_case_matches_finite_differences() {
    let dims = AttentionDims {
        sq: 5,
        skv: 9,
        batch: 2,
        heads: 4,
        groups: 2,
        head_dim: 6,
        q_offset: 4,
        kv_offset: 0,
    };
    for window in [None, Some(3)] {
        let mask = AttentionMask {
            sliding_window: window,
            documents: None,
            alibi_slopes: None,
        };
        let [q, k, v, dout] = inputs(&dims, 21);
        let got = run_f32(&q, &k, &v, &dout, dims, mask);
        let (out, lse) = forward_ref(&q, &k, &v, &dims, mask);
        check(&format!("w={window:?} forward out"), &got.out, &out, 1e-6);
        check(&format!("w={window:?} forward lse"), &got.lse, &lse, 1e-6);
        let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
            forward_ref(q, k, v, &dims, mask)
                .0
                .iter()
                .zip(&dout)
                .map(|(a, b)| a * b)
                .sum()
        };
        let eps = 1e-6;
        let fd = |x: &[f64], which: usize| -> Vec<f64> {
            let mut x = x.to_vec();
            (0..x.len())
                .map(|i| {
                    let orig = x[i];
                    let mut eval = |val: f64| {
                        x[i] = val;
                        match which {
                            0 => loss(&x, &k, &v),
                            1 => loss(&q, &x, &v),
                            _ => loss(&q, &k, &x),
                        }
                    };
                    let g = (eval(orig + eps) - eval(orig - eps)) / (2.0 * eps);
                    x[i] = orig;
                    g
                })
                .collect()
        };
        let reference = backward_ref(&q, &k, &v, &dout, &dims, mask);
        for (i, (name, x)) in [("dq", &q), ("dk", &k), ("dv", &v)].into_iter().enumerate() {
            let numeric = fd(x, i);
            check(
                &format!("w={window:?} f64 reference {name} vs finite differences"),
                &f32s(&reference[i]),
                &numeric,
                1e-6,
            );
            check(
                &format!("w={window:?} {name} vs finite differences"),
                &got.grads[i],
                &numeric,
                1e-5,
            );
        }
        if window.is_some() {
            // Keys 0 and 1 are outside every query's window: exactly zero gradient.
            let row = dims.batch * dims.groups * dims.head_dim;
            assert!(got.grads[1][..2 * row].iter().all(|&x| x == 0.0));
            assert!(got.grads[2][..2 * row].iter().all(|&x| x == 0.0));
        }
    }
}

#[test]
fn multi_block_case_matches_f64_reference() {
    // 150 keys: three 64-key blocks; windows that cross block edges; GQA a=4, g=2; batch 2.
    let dims = AttentionDims {
        sq: 137,
        skv: 150,
        batch: 2,
        heads: 4,
        groups: 2,
        head_dim: 20,
        q_offset: 13,
        kv_offset: 0,
    };
    check_against_reference(dims, &[None, Some(70), Some(5)], 22);
}

#[test]
fn multi_head_wide_case_matches_f64_reference() {
    // Plain multi-head attention (a = g, one head per group) with d = 80: a 64-wide and a
    // 16-wide column tile.
    let dims = AttentionDims {
        sq: 70,
        skv: 70,
        batch: 1,
        heads: 3,
        groups: 3,
        head_dim: 80,
        q_offset: 0,
        kv_offset: 0,
    };
    check_against_reference(dims, &[None, Some(33)], 24);
}

fn check_against_reference(dims: AttentionDims, windows: &[Option<usize>], seed: u64) {
    for &window in windows {
        let mask = AttentionMask {
            sliding_window: window,
            documents: None,
            alibi_slopes: None,
        };
        let [q, k, v, dout] = inputs(&dims, seed);
        let got = run_f32(&q, &k, &v, &dout, dims, mask);
        let (out, lse) = forward_ref(&q, &k, &v, &dims, mask);
        check(&format!("w={window:?} forward out"), &got.out, &out, 1e-5);
        check(&format!("w={window:?} forward lse"), &got.lse, &lse, 1e-5);
        // The inference kernel agrees with the training forward.
        let mut inf = vec![0f32; got.out.len()];
        core_attention(&f32s(&q), &f32s(&k), &f32s(&v), &mut inf, dims, mask);
        check(
            &format!("w={window:?} core_attention vs forward_train"),
            &inf,
            &out,
            1e-5,
        );
        let reference = backward_ref(&q, &k, &v, &dout, &dims, mask);
        for (i, name) in ["dq", "dk", "dv"].into_iter().enumerate() {
            check(
                &format!("w={window:?} {name} vs f64 reference"),
                &got.grads[i],
                &reference[i],
                1e-5,
            );
        }
    }
}

#[test]
fn backward_is_bitwise_deterministic_across_thread_counts() {
    let dims = AttentionDims {
        sq: 100,
        skv: 100,
        batch: 2,
        heads: 6,
        groups: 3,
        head_dim: 32,
        q_offset: 0,
        kv_offset: 0,
    };
    let mask = AttentionMask {
        sliding_window: Some(40),
        documents: None,
        alibi_slopes: None,
    };
    let [q, k, v, dout] = inputs(&dims, 23);
    let first = run_f32(&q, &k, &v, &dout, dims, mask);
    for threads in [1, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let again = pool.install(|| run_f32(&q, &k, &v, &dout, dims, mask));
        let pairs = [(&first.out, &again.out), (&first.lse, &again.lse)];
        for (a, b) in pairs
            .into_iter()
            .chain(first.grads.iter().zip(&again.grads))
        {
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{threads} threads"
            );
        }
    }
}

/// `x` rounded to the nearest bf16 (ties to even), as f64.
fn bf16_round(x: &[f64]) -> Vec<f64> {
    x.iter()
        .map(|&v| half::bf16::from_f32(v as f32).to_f32() as f64)
        .collect()
}

fn run(x: &[Vec<f64>; 4], dims: AttentionDims, mask: AttentionMask, p: AttentionPrecision) -> Run {
    let [q, k, v, dout] = x.clone().map(|t| f32s(&t));
    let mut out = vec![0f32; q.len()];
    let mut lse = vec![0f32; q.len() / dims.head_dim];
    core_attention_forward_train(&q, &k, &v, &mut out, &mut lse, dims, mask, p);
    let mut dq = vec![f32::NAN; q.len()];
    let (mut dk, mut dv) = (vec![f32::NAN; k.len()], vec![f32::NAN; v.len()]);
    core_attention_backward(
        &q, &k, &v, &out, &dout, &lse, &mut dq, &mut dk, &mut dv, dims, mask, p,
    );
    Run {
        out,
        lse,
        grads: [dq, dk, dv],
    }
}

/// bf16 products (q, k, v, dO, P and dS rounded to bf16, f32 accumulation) against the f64
/// reference on the bf16-rounded inputs: the softmax statistic is as exact as in f32 (the
/// products of bf16 values are exact), outputs and gradients within bf16's rounding of `P`
/// and `dS`; on CPUs with AVX512-BF16 the bf16 kernels really ran (results differ from the
/// f32 kernels' on the same inputs) and are bitwise deterministic across thread counts.
#[test]
fn bf16_products_match_the_rounded_f64_reference() {
    let cases = [
        // Three key blocks, a query offset, windows across block edges, GQA, batch 2.
        (
            AttentionDims {
                sq: 137,
                skv: 150,
                batch: 2,
                heads: 4,
                groups: 2,
                head_dim: 32,
                q_offset: 13,
                kv_offset: 0,
            },
            Some(70),
        ),
        (
            AttentionDims {
                sq: 150,
                skv: 150,
                batch: 1,
                heads: 4,
                groups: 2,
                head_dim: 64,
                q_offset: 0,
                kv_offset: 0,
            },
            None,
        ),
        // d = 80: a 64-wide and a 16-wide column tile; odd key counts; 3 heads per group and
        // an odd offset, so a key block's first query row has an odd index in its group's
        // row list (the bf16 key-block pass starts one row early).
        (
            AttentionDims {
                sq: 71,
                skv: 84,
                batch: 1,
                heads: 3,
                groups: 1,
                head_dim: 80,
                q_offset: 13,
                kv_offset: 0,
            },
            Some(33),
        ),
    ];
    let kernels = bf16_tiles_available();
    if !kernels {
        eprintln!("no AVX512-BF16 on this CPU: the bf16 precision runs the f32 kernels");
    }
    for (seed, (dims, window)) in cases.into_iter().enumerate() {
        let mask = AttentionMask {
            sliding_window: window,
            documents: None,
            alibi_slopes: None,
        };
        let x = inputs(&dims, 40 + seed as u64).map(|t| bf16_round(&t));
        let [q, k, v, dout] = &x;
        let got = run(&x, dims, mask, AttentionPrecision::Bf16Tiles);
        let (out, lse) = forward_ref(q, k, v, &dims, mask);
        let name = format!("bf16 d={} w={window:?}", dims.head_dim);
        check(&format!("{name} out"), &got.out, &out, 6e-3);
        check(&format!("{name} lse"), &got.lse, &lse, 1e-5);
        let reference = backward_ref(q, k, v, dout, &dims, mask);
        for (i, grad) in ["dq", "dk", "dv"].into_iter().enumerate() {
            check(
                &format!("{name} {grad}"),
                &got.grads[i],
                &reference[i],
                6e-3,
            );
        }
        if kernels {
            let f32_run = run(&x, dims, mask, F32);
            assert_ne!(got.out, f32_run.out, "{name}: bf16 kernels did not run");
            // The default bf16 precision takes the tiles only where their dot is fast.
            let auto = run(&x, dims, mask, AttentionPrecision::Bf16);
            let want = match ferrotron_tensor::gemm_bf16::fast_bf16_dot() {
                true => &got,
                false => &f32_run,
            };
            assert!(
                auto.out == want.out && auto.grads == want.grads,
                "{name}: the default bf16 attention ran the other kernels"
            );
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(3)
                .build()
                .unwrap();
            let again = pool.install(|| run(&x, dims, mask, AttentionPrecision::Bf16Tiles));
            assert!(
                got.out == again.out && got.grads == again.grads,
                "{name}: not deterministic"
            );
        }
    }
}
