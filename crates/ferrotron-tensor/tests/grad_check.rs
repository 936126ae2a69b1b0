//! Finite-difference gradient checks of the per-layer backward kernels.
//!
//! For each kernel: an f64 reference forward written here, its numeric gradient of
//! `L = Σ out ⊙ R` (random `R`) by central differences in f64, then the f32 forward is compared
//! with the f64 forward and the f32 analytic backward (fed `dy = R`) with the numeric gradient.

mod common;

use common::{Rng, assert_bitwise, check_close, dot64, numeric_grad, to_f32, with_threads};
use ferrotron_tensor::ops::{
    RopeScaling, RopeTable, add_bias_backward, embedding_backward, rms_norm, rms_norm_backward,
    softmax_rows, softmax_rows_backward, swiglu, swiglu_backward, swiglu_packed,
    swiglu_packed_backward,
};

const EPS: f64 = 1e-6;
const TOL: f64 = 1e-5;

fn rms_norm_ref(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let h = w.len();
    x.chunks(h)
        .flat_map(|row| {
            let r = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / h as f64 + eps).sqrt();
            row.iter().zip(w).map(move |(v, g)| g * v * r)
        })
        .collect()
}

#[test]
fn rms_norm_backward_matches_finite_differences() {
    // 70 rows: several fixed row blocks of the dweight reduction; h = 37 exercises the tails.
    let (rows, h, eps) = (70, 37, 1e-5);
    let mut rng = Rng::new(1);
    let x = rng.vec(rows * h, 2.0);
    let w = rng.vec(h, 1.5);
    let r = rng.vec(rows * h, 1.0);

    let (xf, wf) = (to_f32(&x), to_f32(&w));
    let mut out = vec![0f32; rows * h];
    let mut rstd = vec![0f32; rows];
    rms_norm(&xf, &wf, eps as f32, &mut out, Some(&mut rstd));
    check_close("rms_norm forward", &out, &rms_norm_ref(&x, &w, eps), 1e-6);

    let mut dx = vec![f32::NAN; rows * h];
    let prior: Vec<f32> = (0..h).map(|i| i as f32 * 0.25).collect();
    let mut dw = prior.clone();
    rms_norm_backward(&xf, &wf, &rstd, &to_f32(&r), &mut dx, &mut dw);
    let ndx = numeric_grad(&x, EPS, |x| dot64(&rms_norm_ref(x, &w, eps), &r));
    let ndw = numeric_grad(&w, EPS, |w| dot64(&rms_norm_ref(&x, w, eps), &r));
    check_close("rms_norm dx", &dx, &ndx, TOL);
    let got_dw: Vec<f32> = dw.iter().zip(&prior).map(|(a, b)| a - b).collect();
    check_close("rms_norm dweight (accumulated)", &got_dw, &ndw, TOL);
}

fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

#[test]
fn swiglu_backward_matches_finite_differences() {
    let (rows, f) = (3, 45);
    let mut rng = Rng::new(2);
    let mut fc1 = rng.vec(rows * 2 * f, 4.0);
    fc1[0] = 30.0; // saturated gates on both sides
    fc1[1] = -30.0;
    let r = rng.vec(rows * f, 1.0);
    let fwd = |fc1: &[f64]| -> Vec<f64> {
        fc1.chunks(2 * f)
            .flat_map(|row| (0..f).map(move |i| silu(row[i]) * row[f + i]))
            .collect()
    };
    let fc1f = to_f32(&fc1);
    let mut out = vec![0f32; rows * f];
    swiglu_packed(&fc1f, &mut out, f);
    check_close("swiglu forward", &out, &fwd(&fc1), 1e-6);

    let want = numeric_grad(&fc1, EPS, |x| dot64(&fwd(x), &r));
    let mut dfc1 = vec![f32::NAN; fc1.len()];
    swiglu_packed_backward(&fc1f, &to_f32(&r), &mut dfc1, f);
    check_close("swiglu_packed dfc1", &dfc1, &want, TOL);

    // Unpacked variant on the same numbers.
    let (gate, up): (Vec<f32>, Vec<f32>) = {
        let mut g = Vec::new();
        let mut u = Vec::new();
        for row in fc1f.chunks(2 * f) {
            g.extend_from_slice(&row[..f]);
            u.extend_from_slice(&row[f..]);
        }
        (g, u)
    };
    let mut out2 = vec![0f32; rows * f];
    swiglu(&gate, &up, &mut out2);
    assert_bitwise("swiglu packed vs unpacked", &out, &out2);
    let (mut dg, mut du) = (vec![0f32; rows * f], vec![0f32; rows * f]);
    swiglu_backward(&gate, &up, &to_f32(&r), &mut dg, &mut du);
    for (t, drow) in dfc1.chunks(2 * f).enumerate() {
        assert_bitwise("dgate", &drow[..f], &dg[t * f..][..f]);
        assert_bitwise("dup", &drow[f..], &du[t * f..][..f]);
    }
}

#[test]
fn embedding_backward_is_a_sequential_scatter_add() {
    let (v, h, n) = (11, 13, 40);
    let mut rng = Rng::new(3);
    let ids: Vec<u32> = (0..n).map(|_| rng.below(v - 2) as u32).collect(); // rows v-2.. untouched
    let table = rng.vec(v * h, 1.0);
    let r = rng.vec(n * h, 1.0);
    let fwd = |t: &[f64]| -> Vec<f64> {
        ids.iter()
            .flat_map(|&id| t[id as usize * h..][..h].to_vec())
            .collect()
    };
    let want = numeric_grad(&table, EPS, |t| dot64(&fwd(t), &r));
    let prior = to_f32(&rng.vec(v * h, 1.0));
    let mut dtable = prior.clone();
    let rf = to_f32(&r);
    embedding_backward(&ids, &rf, &mut dtable, h);
    let got: Vec<f32> = dtable.iter().zip(&prior).map(|(a, b)| a - b).collect();
    check_close("embedding dtable (accumulated)", &got, &want, 1e-6);

    // Bitwise equal to the plain loop, for any thread count.
    let mut serial = prior.clone();
    for (t, &id) in ids.iter().enumerate() {
        for c in 0..h {
            serial[id as usize * h + c] += rf[t * h + c];
        }
    }
    for threads in [1, 3] {
        let mut d = prior.clone();
        with_threads(threads, || embedding_backward(&ids, &rf, &mut d, h));
        assert_bitwise("embedding vs serial", &d, &serial);
    }
}

/// HF rotate-half RoPE in f64 (`RopeScaling::None`): `x·cos + rotate_half(x)·sin`.
fn rope_ref(x: &[f64], positions: &[usize], heads: usize, d: usize, base: f64) -> Vec<f64> {
    let half = d / 2;
    let mut out = x.to_vec();
    for (t, &p) in positions.iter().enumerate() {
        for hd in 0..heads {
            let o = (t * heads + hd) * d;
            for i in 0..half {
                let th = p as f64 * base.powf(-((2 * i) as f64) / d as f64);
                let (a, b) = (x[o + i], x[o + half + i]);
                out[o + i] = a * th.cos() - b * th.sin();
                out[o + half + i] = b * th.cos() + a * th.sin();
            }
        }
    }
    out
}

#[test]
fn rope_backward_is_apply_inverse() {
    let (d, heads, positions, base) = (16, 3, [0usize, 3, 7, 20], 10000.0);
    let mut rng = Rng::new(4);
    let x = rng.vec(positions.len() * heads * d, 1.0);
    let r = rng.vec(x.len(), 1.0);

    let table = RopeTable::new(d, base as f32, &RopeScaling::None, 32);
    let mut y = to_f32(&x);
    table.apply(&mut y, &positions, heads);
    check_close(
        "rope forward",
        &y,
        &rope_ref(&x, &positions, heads, d, base),
        1e-5,
    );
    let want = numeric_grad(&x, EPS, |x| {
        dot64(&rope_ref(x, &positions, heads, d, base), &r)
    });
    let mut dx = to_f32(&r);
    table.apply_inverse(&mut dx, &positions, heads);
    check_close("rope dx = apply_inverse(dy)", &dx, &want, 1e-5);

    // With llama3 scaling too, apply_inverse is the adjoint: <R x, y> = <x, Rᵀ y>.
    let scaling = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8,
    };
    let table = RopeTable::new(d, base as f32, &scaling, 32);
    let mut y = to_f32(&x);
    table.apply(&mut y, &positions, heads);
    let mut dx = to_f32(&r);
    table.apply_inverse(&mut dx, &positions, heads);
    let lhs: f64 = y.iter().zip(&r).map(|(&a, b)| a as f64 * b).sum();
    let rhs: f64 = x.iter().zip(&dx).map(|(a, &b)| a * b as f64).sum();
    assert!(
        (lhs - rhs).abs() < 1e-5 * lhs.abs().max(1.0),
        "{lhs} vs {rhs}"
    );
}

#[test]
fn softmax_backward_matches_finite_differences() {
    let (rows, n) = (4, 50);
    let mut rng = Rng::new(5);
    let x = rng.vec(rows * n, 5.0);
    let r = rng.vec(rows * n, 1.0);
    let fwd = |x: &[f64]| -> Vec<f64> {
        x.chunks(n)
            .flat_map(|row| {
                let m = row.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = row.iter().map(|v| (v - m).exp()).sum();
                row.iter().map(move |v| (v - m).exp() / z)
            })
            .collect()
    };
    let mut y = to_f32(&x);
    softmax_rows(&mut y, n);
    check_close("softmax forward", &y, &fwd(&x), 1e-6);
    let want = numeric_grad(&x, EPS, |x| dot64(&fwd(x), &r));
    let mut dx = vec![f32::NAN; x.len()];
    softmax_rows_backward(&y, &to_f32(&r), &mut dx, n);
    check_close("softmax dx", &dx, &want, TOL);
}

#[test]
fn add_bias_backward_sums_rows() {
    let (rows, n) = (5, 130);
    let mut rng = Rng::new(6);
    let dy = rng.vec(rows * n, 1.0);
    let want: Vec<f64> = (0..n)
        .map(|c| (0..rows).map(|r| dy[r * n + c]).sum::<f64>() + 1.0)
        .collect();
    let mut db = vec![1f32; n];
    add_bias_backward(&to_f32(&dy), &mut db);
    check_close("add_bias dbias (accumulated)", &db, &want, 1e-6);
}

#[test]
fn backward_kernels_are_bitwise_deterministic_across_thread_counts() {
    let (rows, h, f, v) = (300, 96, 80, 50);
    let mut rng = Rng::new(7);
    let x = to_f32(&rng.vec(rows * h, 2.0));
    let w = to_f32(&rng.vec(h, 1.0));
    let dy = to_f32(&rng.vec(rows * h, 1.0));
    let fc1 = to_f32(&rng.vec(rows * 2 * f, 3.0));
    let dact = to_f32(&rng.vec(rows * f, 1.0));
    let ids: Vec<u32> = (0..rows).map(|_| rng.below(v) as u32).collect();
    let run = || {
        let mut out = vec![0f32; rows * h];
        let mut rstd = vec![0f32; rows];
        rms_norm(&x, &w, 1e-6, &mut out, Some(&mut rstd));
        let mut dx = vec![0f32; rows * h];
        let mut dw = vec![0f32; h];
        rms_norm_backward(&x, &w, &rstd, &dy, &mut dx, &mut dw);
        let mut dfc1 = vec![0f32; rows * 2 * f];
        swiglu_packed_backward(&fc1, &dact, &mut dfc1, f);
        let mut dt = vec![0f32; v * h];
        embedding_backward(&ids, &dy, &mut dt, h);
        let mut db = vec![0f32; h];
        add_bias_backward(&dy, &mut db);
        [dx, dw, dfc1, dt, db]
    };
    let first = run();
    for threads in [1, 2, 5] {
        let again = with_threads(threads, run);
        for (i, (a, b)) in first.iter().zip(&again).enumerate() {
            assert_bitwise(&format!("output {i} with {threads} threads"), a, b);
        }
    }
}
