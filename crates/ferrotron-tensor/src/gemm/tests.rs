use super::*;
use blocks::CONVERT_ROWS;
use std::mem::MaybeUninit;

fn naive(m: usize, n: usize, k: usize, a: &[f32], op_a: Op, b: &[f32], op_b: Op) -> Vec<f32> {
    let mut c = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut s = 0f64;
            for p in 0..k {
                let av = if op_a == Op::N {
                    a[i * k + p]
                } else {
                    a[p * m + i]
                };
                let bv = if op_b == Op::N {
                    b[p * n + j]
                } else {
                    b[j * k + p]
                };
                s += av as f64 * bv as f64;
            }
            c[i * n + j] = s as f32;
        }
    }
    c
}

fn data(len: usize, seed: u32) -> Vec<f32> {
    (0..len)
        .map(|i| {
            ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0
        })
        .collect()
}

#[test]
fn sgemm_matches_naive_for_all_transposes() {
    let (m, n, k) = (37, 29, 71);
    for op_a in [Op::N, Op::T] {
        for op_b in [Op::N, Op::T] {
            let (a, b) = (data(m * k, 1), data(k * n, 2));
            let want = naive(m, n, k, &a, op_a, &b, op_b);
            let mut c = vec![1.0; m * n];
            sgemm(m, n, k, &a, op_a, &b, op_b, &mut c, true);
            for (got, want) in c.iter().zip(&want) {
                assert!((got - (want + 1.0)).abs() < 1e-4, "{got} vs {want}");
            }
        }
    }
}

/// Products large enough to split over the threads, along the columns (`n >= m`) and along
/// the rows, on 2 and 3 threads (a last block narrower than the others), every transpose,
/// into a column block of a wider `c` (`ldc > n`): the naive product, the rest of `c`
/// untouched.
#[test]
fn split_products_match_naive() {
    for (m, n, k) in [(70, 400, 90), (400, 70, 90)] {
        for threads in [2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for (op_a, op_b) in [
                (Op::N, Op::N),
                (Op::N, Op::T),
                (Op::T, Op::N),
                (Op::T, Op::T),
            ] {
                let (a, b) = (data(m * k, 3), data(k * n, 4));
                let want = naive(m, n, k, &a, op_a, &b, op_b);
                let ldc = n + 5;
                let mut c = vec![1.0; m * ldc];
                // SAFETY: a, b and c hold the shapes; c's rows are ldc long.
                pool.install(|| unsafe {
                    let (a, b) = (a.as_ptr(), b.as_ptr());
                    sgemm_raw(m, n, k, a, op_a, b, op_b, c.as_mut_ptr(), ldc, true)
                });
                for i in 0..m {
                    for j in 0..ldc {
                        let got = c[i * ldc + j];
                        let expected = if j < n { want[i * n + j] + 1.0 } else { 1.0 };
                        assert!(
                            (got - expected).abs() < 1e-4,
                            "{m}x{n}x{k} {op_a:?}{op_b:?} t{threads} ({i}, {j}): {got}"
                        );
                    }
                }
            }
        }
    }
}

/// `v` rounded to bf16 (as the bf16 GEMM reads an f32 operand).
fn rounded(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

/// The three dtypes of one weight: `(weight, its values, whether activations round)`.
fn weights<'a>(
    w: &'a [f32],
    wb: &'a [bf16],
    wh: &'a [f16],
    (wide_b, wide_h): &'a (Vec<f32>, Vec<f32>),
) -> [(WeightRef<'a>, &'a [f32], bool); 3] {
    [
        (WeightRef::F32(w), w, false),
        (WeightRef::BF16(wb), wide_b, true),
        (WeightRef::F16(wh), wide_h, false),
    ]
}

#[test]
fn input_gradient_products_agree_across_dtypes() {
    // n spans several conversion blocks
    let (m, n, k) = (7, 2 * CONVERT_ROWS + 5, 33);
    let w = data(n * k, 5);
    let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
    let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
    let wide = (rounded(&w), wh.iter().map(|v| v.to_f32()).collect());
    let dy = data(m * n, 6);
    for accumulate in [false, true] {
        let base = if accumulate { 1.0 } else { 0.0 };
        for (weight, values, round) in weights(&w, &wb, &wh, &wide) {
            let dy_used = if round { rounded(&dy) } else { dy.clone() };
            let want = naive(m, k, n, &dy_used, Op::N, values, Op::N);
            let mut dx = vec![1.0; m * k];
            matmul_weight(F32(&dy), weight, &mut dx, m, n, k, accumulate);
            for (g, w) in dx.iter().zip(&want) {
                assert!(
                    (g - (w + base)).abs() < 1e-3,
                    "{weight:?}: {g} vs {w} + {base}"
                );
            }
            // dy rounded by the caller: the same product, bit for bit.
            let mut again = vec![1.0; m * k];
            let dy_rounded = crate::gemm_bf16::rounded_to_bf16(&dy);
            let op = if round {
                Operand::Rounded(&dy_rounded)
            } else {
                F32(&dy)
            };
            matmul_weight(op, weight, &mut again, m, n, k, accumulate);
            assert_eq!(again, dx, "{weight:?}: rounded dy");
        }
    }
}

#[test]
fn weight_products_agree_across_dtypes_and_paths() {
    let (n, k) = (1030, 80);
    let w = data(n * k, 3);
    let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
    let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
    let wide = (rounded(&w), wh.iter().map(|v| v.to_f32()).collect());
    for m in [1, 2, 5] {
        let x = data(m * k, 4);
        for (weight, values, round) in weights(&w, &wb, &wh, &wide) {
            // bf16 weights round the activations on every path, decode's GEMV included.
            let x_used = if round { rounded(&x) } else { x.clone() };
            let want = naive(m, n, k, &x_used, Op::N, values, Op::T);
            let mut y = vec![0f32; m * n];
            matmul_weight_t(&x, weight, &mut y, m, n, k, false);
            for (g, w) in y.iter().zip(&want) {
                let dtype = weight.dtype();
                assert!((g - w).abs() < 1e-4, "m={m} {dtype:?}: {g} vs {w}");
            }
        }
    }
}

#[test]
fn weight_gradients_compute_in_the_weights_precision() {
    let (m, n, k) = (37, 70, 45);
    let (dy, x) = (data(m * n, 7), data(m * k, 8));
    let w = data(n * k, 9);
    let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
    let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
    let wide = (rounded(&w), wh.iter().map(|v| v.to_f32()).collect());
    for (weight, _, round) in weights(&w, &wb, &wh, &wide) {
        let (dy_used, x_used) = if round {
            (rounded(&dy), rounded(&x))
        } else {
            (dy.clone(), x.clone())
        };
        let want = naive(n, k, m, &dy_used, Op::T, &x_used, Op::N);
        let mut dw = vec![0.5f32; n * k];
        weight_grad(F32(&dy), F32(&x), weight, &mut dw, m, n, k);
        for (g, w) in dw.iter().zip(&want) {
            assert!((g - (w + 0.5)).abs() < 1e-4, "{weight:?}: {g} vs {w} + 0.5");
        }
        if round {
            let mut again = vec![0.5f32; n * k];
            let dy_rounded = crate::gemm_bf16::rounded_to_bf16(&dy);
            weight_grad(
                Operand::Rounded(&dy_rounded),
                F32(&x),
                weight,
                &mut again,
                m,
                n,
                k,
            );
            assert_eq!(again, dw, "{weight:?}: rounded dy");
        }
    }
}

/// A buffer of `len` "uninitialized" elements holding NaN, so a product that leaves one
/// unwritten shows it.
fn garbage(len: usize) -> Vec<MaybeUninit<f32>> {
    vec![MaybeUninit::new(f32::NAN); len]
}

/// The values of a buffer every element of which was written.
fn written(v: &[MaybeUninit<f32>]) -> Vec<f32> {
    // SAFETY: the NaN fill initialized every element.
    v.iter().map(|x| unsafe { x.assume_init() }).collect()
}

#[test]
fn uninit_gemm_writes_every_element() {
    for (m, n, k) in [(37, 29, 71), (5, 3, 0), (64, 130, 9)] {
        for op_b in [Op::N, Op::T] {
            let (a, b) = (data(m * k, 1), data(k * n, 2));
            let mut c = garbage(m * n);
            sgemm_serial_uninit(m, n, k, &a, Op::N, &b, op_b, &mut c);
            let want = naive(m, n, k, &a, Op::N, &b, op_b);
            for (g, w) in written(&c).iter().zip(&want) {
                assert!((g - w).abs() < 1e-4, "{m}x{n}x{k} {op_b:?}: {g} vs {w}");
            }
        }
    }
}

#[test]
fn serial_expert_products_widen_narrow_weights_exactly() {
    // n spans several conversion blocks; the activations stay f32 (no bf16 rounding).
    let (m, n, k) = (9, 2 * CONVERT_ROWS + 7, 24);
    let w = data(n * k, 11);
    let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
    let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
    let wide = (rounded(&w), wh.iter().map(|v| v.to_f32()).collect());
    let (x, dy) = (data(m * k, 12), data(m * n, 13));
    for (weight, values, _) in weights(&w, &wb, &wh, &wide) {
        let mut y = garbage(m * n);
        matmul_weight_t_serial(&x, weight, &mut y, (m, n, k));
        let want = naive(m, n, k, &x, Op::N, values, Op::T);
        for (g, w) in written(&y).iter().zip(&want) {
            assert!((g - w).abs() < 1e-4, "{weight:?} forward: {g} vs {w}");
        }
        let mut dx = garbage(m * k);
        matmul_weight_serial(&dy, weight, &mut dx, (m, n, k));
        let want = naive(m, k, n, &dy, Op::N, values, Op::N);
        for (g, w) in written(&dx).iter().zip(&want) {
            assert!(
                (g - w).abs() < 1e-3,
                "{weight:?} input gradient: {g} vs {w}"
            );
        }
    }
    // No rows of the weight: the input gradient is zero.
    let mut dx = garbage(m * k);
    matmul_weight_serial(&[], WeightRef::BF16(&[]), &mut dx, (m, 0, k));
    assert!(written(&dx).iter().all(|&v| v == 0.0));
}
