use super::activation::Q8Rows;
use super::dot::{block_at, dot_scalar};
use super::*;
use half::f16;

/// A deterministic pseudo-random byte stream.
fn bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 56) as u8
        })
        .collect()
}

/// `rows` random rows of `cols` values of `ty` with finite, realistic f16 scales.
fn random_matrix(ty: QuantType, rows: usize, cols: usize, seed: u64) -> QuantMatrix {
    let (_, size) = ty.block_layout();
    let mut data = bytes(ty.row_bytes(cols).expect("whole blocks") * rows, seed);
    let fields: &[usize] = match ty {
        QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q5_0 => &[0],
        QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q4_K => &[0, 2],
        QuantType::Q6_K => &[208],
    };
    for (i, blk) in data.chunks_exact_mut(size).enumerate() {
        for &f in fields {
            let v = 1e-3 + (i % 7) as f32 * 2e-3;
            let v = if f == 2 && ty != QuantType::Q4_K {
                -v
            } else {
                v
            };
            blk[f..f + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
        }
    }
    QuantMatrix::new(ty, rows, cols, data).expect("sizes")
}

fn activations(len: usize, seed: u64) -> Vec<f32> {
    bytes(len, seed)
        .iter()
        .map(|&b| (b as f32 - 127.5) / 64.0)
        .collect()
}

fn dequantized(w: &QuantMatrix) -> Vec<f32> {
    let mut out = vec![0f32; w.rows() * w.cols()];
    w.dequantize_rows(0..w.rows(), &mut out);
    out
}

#[test]
fn decoded_blocks_describe_the_dequantized_values() {
    for ty in QuantType::ALL {
        let w = random_matrix(ty, 1, 512, 1);
        let values = dequantized(&w);
        let (_, row) = w.row(0);
        for b in 0..512 / QK8 {
            let blk = block_at(ty, row, b);
            for l in 0..QK8 {
                let v = blk.c * (blk.s[l / 16] * i32::from(blk.w[l])) as f32 + blk.mn;
                let want = values[b * QK8 + l];
                assert!(
                    (v - want).abs() <= 1e-6 * want.abs().max(1.0),
                    "{ty} {b}/{l}: {v} vs {want}"
                );
            }
        }
    }
}

#[test]
fn int8_dots_match_the_dequantized_product() {
    let (n, k) = (9, 512);
    for ty in QuantType::ALL {
        let w = random_matrix(ty, n, k, 2);
        let x = activations(3 * k, 3);
        let xq = Q8Rows::quantize(&x, 3, k);
        let wf = dequantized(&w);
        for i in 0..3 {
            let xd = xq.dequantized_row(i);
            for j in 0..n {
                let exact: f64 = wf[j * k..][..k]
                    .iter()
                    .zip(&xd)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum();
                let scale: f64 = wf[j * k..][..k]
                    .iter()
                    .zip(&xd)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum();
                let got = dot_scalar(ty, w.row(j).1, xq.row(i)) as f64;
                assert!(
                    (got - exact).abs() <= 1e-5 * scale,
                    "{ty} scalar {j}: {got} vs {exact}"
                );
                #[cfg(target_arch = "x86_64")]
                if avx512::available() {
                    // SAFETY: checked just above; the row is whole.
                    let simd = unsafe { avx512::dot_rows(ty, w.row(j).1, &[xq.row(i)]) }[0] as f64;
                    assert!(
                        (simd - exact).abs() <= 1e-5 * scale,
                        "{ty} simd {j}: {simd} vs {exact}"
                    );
                }
            }
        }
    }
}

/// The eight-row kernel (Q4_0): each of its dots within 1e-5 (relative to the sum of the
/// products' magnitudes) of the exact product with the int8 activations, and a row's bits
/// the same with one activation row or four.
#[cfg(target_arch = "x86_64")]
#[test]
fn rows_eight_at_a_time_match_the_exact_product() {
    if !avx512::available() {
        return;
    }
    for ty in QuantType::ALL.into_iter().filter(|&t| rows8::supports(t)) {
        rows_eight_at_a_time(ty);
    }
}

#[cfg(target_arch = "x86_64")]
fn rows_eight_at_a_time(ty: QuantType) {
    let (n, k) = (8, 512);
    let w = random_matrix(ty, n, k, 8);
    let x = activations(4 * k, 9);
    let xq = Q8Rows::quantize(&x, 4, k);
    let wf = dequantized(&w);
    let xs = [xq.row(0), xq.row(1), xq.row(2), xq.row(3)];
    let row_bytes = w.segments()[0].data().len() / n;
    let data = w.segments()[0].data().as_ptr();
    // SAFETY: checked just above; the data is eight whole rows.
    let four = unsafe { rows8::dot_rows8(ty, data, row_bytes, &xs) };
    for (i, x) in xs.iter().enumerate() {
        // SAFETY: as above.
        let one = unsafe { rows8::dot_rows8(ty, data, row_bytes, &[*x]) };
        assert_eq!(one[0], four[i], "{ty} activation row {i}");
        let xd = xq.dequantized_row(i);
        for j in 0..n {
            let products = wf[j * k..][..k]
                .iter()
                .zip(&xd)
                .map(|(a, b)| *a as f64 * *b as f64);
            let exact: f64 = products.clone().sum();
            let scale: f64 = products.map(f64::abs).sum();
            let got = four[i][j] as f64;
            assert!(
                (got - exact).abs() <= 1e-5 * scale,
                "{ty} {i}/{j}: {got} vs {exact}"
            );
        }
    }
}

#[test]
fn matmul_matches_the_dequantized_weight_on_both_paths() {
    let (n, k) = (70, 256);
    for ty in QuantType::ALL {
        let w = random_matrix(ty, n, k, 4);
        let wf = dequantized(&w);
        for m in [1, 3, 16, 32, 40] {
            let x = activations(m * k, 5 + m as u64);
            // Few rows multiply the activations quantized to int8 (so do many of Q4_0 where
            // bf16 products are slow); many rows multiply the activations and the dequantized
            // weights rounded to bf16.
            let bf16 = |v: &[f32]| -> Vec<f32> {
                v.iter()
                    .map(|&x| half::bf16::from_f32(x).to_f32())
                    .collect()
            };
            let integer = m <= INT8_MAX_ROWS || super::matmul::integer_prefill(&w);
            let (x_used, wf) = if integer {
                let xq = Q8Rows::quantize(&x, m, k);
                (
                    (0..m).flat_map(|i| xq.dequantized_row(i)).collect(),
                    wf.clone(),
                )
            } else {
                (bf16(&x), bf16(&wf))
            };
            let mut want = vec![0f32; m * n];
            let abs = |v: &[f32]| v.iter().map(|a| a.abs()).collect::<Vec<_>>();
            let mut scale = vec![0f32; m * n];
            let (op_n, op_t) = (crate::gemm::Op::N, crate::gemm::Op::T);
            crate::gemm::sgemm(m, n, k, &x_used, op_n, &wf, op_t, &mut want, false);
            crate::gemm::sgemm(
                m,
                n,
                k,
                &abs(&x_used),
                op_n,
                &abs(&wf),
                op_t,
                &mut scale,
                false,
            );
            let mut got = vec![1f32; m * n];
            quant_matmul_t(&x, &w, &mut got, (m, n, k), true);
            for ((g, w), s) in got.iter().zip(&want).zip(&scale) {
                assert!(
                    (g - 1.0 - w).abs() <= 1e-5 * s.max(1.0),
                    "{ty} m={m}: {g} vs {w}+1"
                );
            }
        }
    }
}

#[test]
fn a_row_computes_the_same_bits_in_any_batch() {
    let (n, k) = (33, 512);
    for ty in QuantType::ALL {
        let w = random_matrix(ty, n, k, 6);
        let m = 7;
        let x = activations(m * k, 7);
        let mut batch = vec![0f32; m * n];
        quant_matmul_t(&x, &w, &mut batch, (m, n, k), false);
        for i in 0..m {
            let mut one = vec![0f32; n];
            quant_matmul_t(&x[i * k..][..k], &w, &mut one, (1, n, k), false);
            assert_eq!(one, batch[i * n..][..n], "{ty} row {i}");
        }
    }
}

/// Each path chosen by name computes a row the same in any batch: integer dot products for
/// more rows than the by-size rule sends there, the prefill kernels for a single row; and the
/// by-size rule is one of the two.
#[test]
fn a_named_path_computes_a_row_the_same_in_any_batch() {
    let (n, k) = (40, 256);
    let m = INT8_MAX_ROWS + 5;
    for ty in [QuantType::Q4_0, QuantType::Q8_0, QuantType::Q4_K] {
        let w = random_matrix(ty, n, k, 11);
        let x = activations(m * k, 12);
        for path in [QuantRows::Decode, QuantRows::Prefill] {
            let mut batch = vec![0f32; m * n];
            quant_matmul_t_with(&x, &w, &mut batch, (m, n, k), false, path);
            for i in [0, 3, m - 1] {
                let mut one = vec![0f32; n];
                let row = &x[i * k..][..k];
                quant_matmul_t_with(row, &w, &mut one, (1, n, k), false, path);
                assert_eq!(one, batch[i * n..][..n], "{ty} {path:?} row {i}");
            }
            let by_size = match path {
                QuantRows::Decode => 1,
                _ => m,
            };
            let mut auto = vec![0f32; by_size * n];
            quant_matmul_t(&x[..by_size * k], &w, &mut auto, (by_size, n, k), false);
            assert_eq!(auto, batch[..by_size * n], "{ty} {path:?} by size");
        }
    }
}

#[test]
fn stacked_rows_keep_their_formats() {
    let k = 256;
    let a = random_matrix(QuantType::Q4_K, 4, k, 8);
    let b = random_matrix(QuantType::Q6_K, 3, k, 9);
    let fused = QuantMatrix::cat_rows(&[(&a, 0..4), (&b, 0..3), (&a, 1..2)]).unwrap();
    let kinds: Vec<(QuantType, usize)> = fused
        .segments()
        .iter()
        .map(|s| (s.ty(), s.rows()))
        .collect();
    assert_eq!(
        kinds,
        [
            (QuantType::Q4_K, 4),
            (QuantType::Q6_K, 3),
            (QuantType::Q4_K, 1)
        ]
    );
    let (fa, fb, f) = (dequantized(&a), dequantized(&b), dequantized(&fused));
    assert_eq!(f[..4 * k], fa[..]);
    assert_eq!(f[4 * k..7 * k], fb[..]);
    assert_eq!(f[7 * k..], fa[k..2 * k]);
    // Products over a mixed matrix equal the products of its parts.
    let x = activations(2 * k, 10);
    let mut y = vec![0f32; 2 * 8];
    quant_matmul_t(&x, &fused, &mut y, (2, 8, k), false);
    let mut yb = vec![0f32; 2 * 3];
    quant_matmul_t(&x, &b, &mut yb, (2, 3, k), false);
    assert_eq!(y[4..7], yb[..3]);
    assert_eq!(y[8 + 4..8 + 7], yb[3..]);
    let bad = random_matrix(QuantType::Q8_0, 1, 64, 1);
    assert!(QuantMatrix::cat_rows(&[(&a, 0..1), (&bad, 0..1)]).is_err());
    assert!(QuantMatrix::cat_rows(&[(&a, 3..5)]).is_err());
}

#[test]
fn sizes_are_checked() {
    assert!(matches!(
        QuantMatrix::new(QuantType::Q4_K, 1, 576, vec![0; 324]),
        Err(QuantError::Columns { .. })
    ));
    assert!(matches!(
        QuantMatrix::new(QuantType::Q8_0, 2, 64, vec![0; 135]),
        Err(QuantError::Length { expected: 136, .. })
    ));
}

#[test]
fn input_gradient_multiplies_the_dequantized_weight() {
    let (m, n, k) = (5, 40, 64);
    let w = random_matrix(QuantType::Q5_1, n, k, 11);
    let wf = dequantized(&w);
    let dy = activations(m * n, 12);
    let mut want = vec![0f32; m * k];
    crate::gemm::sgemm(
        m,
        k,
        n,
        &dy,
        crate::gemm::Op::N,
        &wf,
        crate::gemm::Op::N,
        &mut want,
        false,
    );
    let mut got = vec![0f32; m * k];
    quant_matmul(&dy, &w, &mut got, (m, n, k), false);
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= 1e-4 * w.abs().max(1.0));
    }
}

#[test]
fn activation_quantization_is_the_same_in_simd() {
    #[cfg(target_arch = "x86_64")]
    if avx512::available() {
        let mut x = activations(32 * 64, 13);
        x[5] = 1e-30;
        x[64..96].fill(0.0);
        x[96..128].iter_mut().for_each(|v| *v *= 1e4);
        for block in x.chunks_exact(32) {
            let block: &[f32; 32] = block.try_into().unwrap();
            let (mut q1, mut q2) = ([0i8; 32], [0i8; 32]);
            let scalar = super::activation::quantize_block(block, &mut q1);
            // SAFETY: checked above.
            let simd = unsafe { avx512::quantize_block(block, &mut q2) };
            assert_eq!((scalar, q1), (simd, q2));
        }
    }
}

#[test]
fn simd_dequantization_is_bit_identical() {
    #[cfg(target_arch = "x86_64")]
    if avx512::available() {
        for ty in QuantType::ALL {
            let w = random_matrix(ty, 3, 512, 14);
            let want = dequantized(&w);
            let mut got = vec![0f32; want.len()];
            for (r, out) in got.chunks_exact_mut(512).enumerate() {
                // SAFETY: checked above; the row is whole.
                unsafe { avx512::dequantize_row(ty, w.row(r).1, out) };
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{ty}");
        }
    }
}
