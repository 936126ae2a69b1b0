//! Every kernel this machine runs against an f64 product of the bf16-rounded operands: all
//! four transposes, f32 and bf16 operands, shapes off every block edge (m, n not multiples of
//! 32, k not a multiple of 32 and deeper than one packed slice), overwrite and accumulate.

use super::*;
use half::bf16;

fn data(len: usize, seed: u32) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let h = (i as u32)
                .wrapping_mul(2654435761)
                .wrapping_add(seed.wrapping_mul(40503));
            ((h >> 7) % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

fn round(v: f32) -> f64 {
    f32::from_bits((crate::round_to_bf16_bits(v) as u32) << 16) as f64
}

/// `(op(a)·op(b))[i, j]` in f64 over the bf16-rounded values, and `Σ|a·b|` (the scale of the
/// f32 summation error).
#[allow(clippy::too_many_arguments)]
fn reference(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    op_a: Op,
    b: &[f32],
    op_b: Op,
) -> Vec<(f64, f64)> {
    let mut c = vec![(0.0, 0.0); m * n];
    for i in 0..m {
        for j in 0..n {
            let (mut s, mut abs) = (0f64, 0f64);
            for p in 0..k {
                let av = round(if op_a == Op::N {
                    a[i * k + p]
                } else {
                    a[p * m + i]
                });
                let bv = round(if op_b == Op::N {
                    b[p * n + j]
                } else {
                    b[j * k + p]
                });
                s += av * bv;
                abs += (av * bv).abs();
            }
            c[i * n + j] = (s, abs);
        }
    }
    c
}

fn check(kernel: Bf16Kernel, (m, n, k): (usize, usize, usize), bf16_b: bool) {
    for op_a in [Op::N, Op::T] {
        for op_b in [Op::N, Op::T] {
            let (a, b) = (data(m * k, 1), data(k * n, 2));
            let b16: Vec<bf16> = b.iter().map(|&v| bf16::from_f32(v)).collect();
            let want = reference(m, n, k, &a, op_a, &b, op_b);
            let b_op = if bf16_b {
                Operand::Bf16(&b16)
            } else {
                Operand::F32(&b)
            };
            for accumulate in [false, true] {
                let base = if accumulate { 0.5 } else { 0.0 };
                let mut c = vec![if accumulate { 0.5 } else { f32::NAN }; m * n];
                bf16_gemm_with(
                    kernel,
                    m,
                    n,
                    k,
                    Operand::F32(&a),
                    op_a,
                    b_op,
                    op_b,
                    &mut c,
                    accumulate,
                );
                for (idx, (got, (w, abs))) in c.iter().zip(&want).enumerate() {
                    let err = (*got as f64 - (w + base)).abs();
                    assert!(
                        err <= 1e-5 * abs + 1e-6,
                        "{kernel:?} {m}x{n}x{k} {op_a:?}{op_b:?} acc={accumulate} [{idx}]: {got} vs {}",
                        w + base
                    );
                }
            }
        }
    }
}

#[test]
fn every_kernel_matches_the_rounded_f64_product() {
    let kernels = Bf16Kernel::available();
    assert_eq!(kernels.last(), Some(&Bf16Kernel::Widened));
    eprintln!("bf16 kernels on this machine: {kernels:?}");
    for &kernel in kernels {
        for shape in [
            (1, 1, 1),
            (3, 5, 7),
            (32, 32, 32),
            (33, 65, 47),
            (70, 40, 2 * KC + 33),
        ] {
            check(kernel, shape, false);
        }
        check(kernel, (45, 70, 600), true);
    }
}

#[test]
fn many_column_blocks_split_over_threads() {
    // n spans several NC blocks and a partial panel; m several MC blocks.
    let (m, n, k) = (2 * MC + 5, 2 * NC + 40, 64);
    for &kernel in Bf16Kernel::available() {
        let (a, b) = (data(m * k, 3), data(n * k, 4));
        let want = reference(m, n, k, &a, Op::N, &b, Op::T);
        let mut c = vec![0f32; m * n];
        bf16_gemm_with(
            kernel,
            m,
            n,
            k,
            Operand::F32(&a),
            Op::N,
            Operand::F32(&b),
            Op::T,
            &mut c,
            false,
        );
        for (got, (w, abs)) in c.iter().zip(&want) {
            assert!(
                (*got as f64 - w).abs() <= 1e-5 * abs + 1e-6,
                "{kernel:?}: {got} vs {w}"
            );
        }
    }
}

#[test]
fn empty_reduction_overwrites_or_keeps() {
    let mut c = vec![3.0f32; 6];
    bf16_gemm(
        2,
        3,
        0,
        Operand::F32(&[]),
        Op::N,
        Operand::F32(&[]),
        Op::N,
        &mut c,
        true,
    );
    assert_eq!(c, vec![3.0; 6]);
    bf16_gemm(
        2,
        3,
        0,
        Operand::F32(&[]),
        Op::N,
        Operand::F32(&[]),
        Op::N,
        &mut c,
        false,
    );
    assert_eq!(c, vec![0.0; 6]);
}

#[test]
fn column_blocks_are_whole_panels_and_balanced() {
    for (n, threads) in [(576, 2), (960, 2), (49152, 2), (31, 2), (1536, 4), (100, 1)] {
        let blocks = column_blocks(n, threads);
        assert_eq!(blocks.first().unwrap().start, 0);
        assert_eq!(blocks.last().unwrap().end, n);
        for w in blocks.windows(2) {
            assert_eq!(w[0].end, w[1].start);
            assert!(w[0].len().is_multiple_of(NR) && w[0].len() <= NC.next_multiple_of(NR));
        }
    }
    assert_eq!(column_blocks(576, 2), vec![0..288, 288..576]);
}
