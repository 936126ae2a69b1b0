//! Cross entropy: f32 forward against an f64 reference, the analytic backward (plain, in-place
//! and fused) against central differences of that reference, ignored labels, loss mask, label
//! errors and determinism.

mod common;

use common::{Rng, assert_bitwise, check_close, dot64, numeric_grad, to_f32, with_threads};
use ferrotron_tensor::ops::{
    IGNORE_INDEX, cross_entropy_backward, cross_entropy_backward_inplace, cross_entropy_forward,
    cross_entropy_fused_inplace,
};

/// `losses[t] = m_t · (logsumexp(x_t) − x_t[y_t])`, 0 for ignored labels.
fn ce_ref(x: &[f64], labels: &[i64], mask: &[f64], v: usize) -> Vec<f64> {
    x.chunks(v)
        .zip(labels)
        .zip(mask)
        .map(|((row, &y), &m)| {
            if y == IGNORE_INDEX {
                return 0.0;
            }
            let mx = row.iter().cloned().fold(f64::MIN, f64::max);
            let lse = mx + row.iter().map(|v| (v - mx).exp()).sum::<f64>().ln();
            m * (lse - row[y as usize])
        })
        .collect()
}

struct Case {
    v: usize,
    logits: Vec<f64>,
    labels: Vec<i64>,
    mask: Vec<f64>,
    dloss: Vec<f64>,
}

fn case() -> Case {
    let (n, v) = (9, 67);
    let mut rng = Rng::new(11);
    let mut logits = rng.vec(n * v, 8.0);
    logits[5] = 40.0; // a dominant logit
    let mut labels: Vec<i64> = (0..n).map(|_| rng.below(v) as i64).collect();
    labels[0] = 5;
    labels[3] = IGNORE_INDEX;
    labels[7] = IGNORE_INDEX;
    let mut mask: Vec<f64> = (0..n).map(|i| if i % 4 == 1 { 0.5 } else { 1.0 }).collect();
    mask[4] = 0.0;
    let dloss = rng.vec(n, 1.0);
    Case {
        v,
        logits,
        labels,
        mask,
        dloss,
    }
}

#[test]
fn forward_and_backward_match_f64_reference() {
    let Case {
        v,
        logits,
        labels,
        mask,
        dloss,
    } = case();
    let n = labels.len();
    let (xf, mf, df) = (to_f32(&logits), to_f32(&mask), to_f32(&dloss));
    let mut losses = vec![f32::NAN; n];
    let mut lse = vec![f32::NAN; n];
    cross_entropy_forward(&xf, &labels, Some(&mf), &mut losses, &mut lse, v).unwrap();
    let want = ce_ref(&logits, &labels, &mask, v);
    check_close("cross entropy losses", &losses, &want, 1e-6);
    for t in [3, 4, 7] {
        assert_eq!((losses[t], lse[t]), (0.0, 0.0), "skipped token {t}");
    }

    let grad = numeric_grad(&logits, 1e-6, |x| {
        dot64(&ce_ref(x, &labels, &mask, v), &dloss)
    });
    let mut dlogits = vec![f32::NAN; n * v];
    cross_entropy_backward(&xf, &lse, &labels, Some(&mf), &df, &mut dlogits, v);
    check_close("cross entropy dlogits", &dlogits, &grad, 1e-5);
    for t in [3, 4, 7] {
        assert!(dlogits[t * v..][..v].iter().all(|&g| g == 0.0));
    }

    let mut inplace = xf.clone();
    cross_entropy_backward_inplace(&mut inplace, &lse, &labels, Some(&mf), &df, v);
    assert_bitwise("in-place backward", &inplace, &dlogits);

    let mut fused = xf.clone();
    let mut fused_losses = vec![f32::NAN; n];
    cross_entropy_fused_inplace(&mut fused, &labels, Some(&mf), &df, &mut fused_losses, v).unwrap();
    assert_bitwise("fused losses", &fused_losses, &losses);
    assert_bitwise("fused dlogits", &fused, &dlogits);

    // No mask == all-ones mask; torch semantics: mean over non-ignored tokens.
    let mut l2 = vec![0f32; n];
    cross_entropy_forward(&xf, &labels, None, &mut l2, &mut lse, v).unwrap();
    let ones = vec![1.0; n];
    check_close(
        "unmasked losses",
        &l2,
        &ce_ref(&logits, &labels, &ones, v),
        1e-6,
    );
}

#[test]
fn skipped_rows_do_not_read_logits_and_bad_labels_are_errors() {
    let v = 4;
    let mut x = vec![0.5f32; 3 * v];
    x[4..8].fill(f32::NAN); // row 1 is ignored
    let labels = [1, IGNORE_INDEX, 3];
    let (mut losses, mut lse) = (vec![0f32; 3], vec![0f32; 3]);
    cross_entropy_forward(&x, &labels, None, &mut losses, &mut lse, v).unwrap();
    assert!(losses.iter().all(|l| l.is_finite()));
    assert!((losses[0] - 4f32.ln()).abs() < 1e-6);
    let mut d = vec![0f32; 3 * v];
    cross_entropy_backward(&x, &lse, &labels, None, &[1.0; 3], &mut d, v);
    assert!(d.iter().all(|g| g.is_finite()));
    assert!(
        (d.iter().sum::<f32>()).abs() < 1e-6,
        "each gradient row sums to 0"
    );

    // NaN in a counted row reaches the loss (loss scaling must see it).
    x[0] = f32::NAN;
    cross_entropy_forward(&x, &labels, None, &mut losses, &mut lse, v).unwrap();
    assert!(losses[0].is_nan());

    for bad in [4i64, -1, -101] {
        let err = cross_entropy_forward(&x, &[bad, 0, 0], None, &mut losses, &mut lse, v);
        let msg = err.unwrap_err().to_string();
        assert!(msg.contains("label") && msg.contains("size 4"), "{msg}");
    }
}

#[test]
fn cross_entropy_is_bitwise_deterministic() {
    let (n, v) = (64, 1000);
    let mut rng = Rng::new(12);
    let x = to_f32(&rng.vec(n * v, 10.0));
    let labels: Vec<i64> = (0..n).map(|_| rng.below(v) as i64).collect();
    let dloss = vec![1.0 / n as f32; n];
    let run = || {
        let mut logits = x.clone();
        let mut losses = vec![0f32; n];
        cross_entropy_fused_inplace(&mut logits, &labels, None, &dloss, &mut losses, v).unwrap();
        (logits, losses)
    };
    let (d0, l0) = run();
    for threads in [1, 3] {
        let (d, l) = with_threads(threads, run);
        assert_bitwise("dlogits", &d, &d0);
        assert_bitwise("losses", &l, &l0);
    }
}
