//! Products with a weight stored narrower than f32 (bf16, f16, dequantized blocks) on the f32
//! GEMM without an f32 copy of the whole weight: `CONVERT_ROWS` rows of it are widened into
//! a scratch block (a few hundred KiB to 1 MiB: it stays in L2) and multiplied at a time.
//! Also the one-thread products of one expert of a grouped MoE GEMM
//! ([`matmul_weight_t_serial`], [`matmul_weight_serial`]), which write into memory not
//! zeroed first.

use super::sgemm::{Dest, Strided, sgemm_serial_uninit, sgemm_strided};
use super::{Op, WeightRef};
use crate::Element;
use half::bf16;
use rayon::prelude::*;
use std::mem::MaybeUninit;
use std::ops::Range;

/// Rows of a narrow weight converted to f32 at a time before GEMM (bounded scratch memory).
pub(super) const CONVERT_ROWS: usize = 512;

/// Rows `rows` of the narrow weight `w[n, k]` widened to f32 into `block[rows.len(), k]`,
/// rayon-parallel.
pub(super) fn widen_rows<W: Element>(w: &[W], rows: Range<usize>, k: usize, block: &mut [f32]) {
    block
        .par_chunks_mut(k)
        .zip(w[rows.start * k..rows.end * k].par_chunks(k))
        .for_each(|(dst, src)| {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = s.to_f32();
            }
        });
}

/// `y[m, n] = x[m, k] · wᵀ` (`+=` when `accumulate`) for a weight `w[n, k]` stored narrower
/// than f32 (f16, quantized blocks): `widen(rows, out)` writes rows `rows` of `w` as f32 into
/// `out[rows.len(), k]`, [`CONVERT_ROWS`] rows at a time, each block multiplied by the f32
/// GEMM into its columns of `y` — so no f32 copy of the whole weight is ever made.
pub(super) fn dequantized_blocks_t(
    x: &[f32],
    widen: impl Fn(Range<usize>, &mut [f32]),
    y: &mut [f32],
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
) {
    assert!(x.len() >= m * k && y.len() >= m * n);
    let y = Dest {
        ptr: y.as_mut_ptr(),
        ldc: n,
    };
    let threads = rayon::current_num_threads();
    // SAFETY: x is [m, k] and y [m, n] (checked above), y exclusive.
    unsafe { blocks_t(x, widen, y, (m, n, k), accumulate, threads) }
}

/// [`dequantized_blocks_t`] into `y` with row stride `y.ldc`, on `threads` threads.
///
/// # Safety
/// `y` addresses `[m, n]` elements at its row stride, exclusively; unless `accumulate`
/// they need not be initialized (each is written once, never read).
unsafe fn blocks_t(
    x: &[f32],
    widen: impl Fn(Range<usize>, &mut [f32]),
    y: Dest,
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
    threads: usize,
) {
    let x = Strided {
        ptr: x.as_ptr(),
        cs: 1,
        rs: k as isize,
    };
    for_each_widened_block(n, k, widen, |rows, block| {
        let (j0, rows) = (rows.start, rows.len());
        let block = Strided {
            ptr: block.as_ptr(),
            cs: k as isize,
            rs: 1,
        };
        // SAFETY: block is [rows, k] read transposed; y's column block j0..j0+rows lies
        // inside y (the caller's).
        unsafe { sgemm_strided(m, rows, k, x, block, y.offset(j0), accumulate, threads) }
    });
}

/// Runs `product(rows, block)` for each block of (up to) [`CONVERT_ROWS`] `rows` of the
/// narrow weight `w[n, k]`, widened by `widen` into `block[rows.len(), k]` (one scratch for
/// all blocks).
fn for_each_widened_block(
    n: usize,
    k: usize,
    widen: impl Fn(Range<usize>, &mut [f32]),
    mut product: impl FnMut(Range<usize>, &[f32]),
) {
    let mut scratch = vec![0f32; CONVERT_ROWS.min(n) * k];
    for j0 in (0..n).step_by(CONVERT_ROWS) {
        let rows = j0..j0 + CONVERT_ROWS.min(n - j0);
        let block = &mut scratch[..rows.len() * k];
        widen(rows.clone(), block);
        product(rows, block);
    }
}

/// `dx[m, k] = dy[m, n] · w` (`+=` when `accumulate`) for a narrow weight `w[n, k]` that
/// `widen` writes as f32 a block of rows at a time (see [`dequantized_blocks_t`]): each
/// block adds its part `dy[:, j0..j1] · w[j0..j1, :]`.
pub(crate) fn dequantized_blocks_n(
    dy: &[f32],
    widen: impl Fn(Range<usize>, &mut [f32]),
    dx: &mut [f32],
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
) {
    assert!(dy.len() >= m * n && dx.len() >= m * k);
    let dx = Dest {
        ptr: dx.as_mut_ptr(),
        ldc: k,
    };
    let threads = rayon::current_num_threads();
    // SAFETY: dy is [m, n] and dx [m, k] (checked above), dx exclusive.
    unsafe { blocks_n(dy, widen, dx, (m, n, k), accumulate, threads) }
}

/// [`dequantized_blocks_n`] into `dx [m, k]` (row stride `k`), on `threads` threads.
///
/// # Safety
/// `dx` addresses `[m, k]` elements, exclusively; unless `accumulate` they need not be
/// initialized (the first block writes them without reading).
unsafe fn blocks_n(
    dy: &[f32],
    widen: impl Fn(Range<usize>, &mut [f32]),
    dx: Dest,
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
    threads: usize,
) {
    if m == 0 || k == 0 {
        return;
    }
    if n == 0 {
        if !accumulate {
            // SAFETY: dx is [m, k] contiguous (row stride k), exclusive.
            unsafe { std::ptr::write_bytes(dx.ptr, 0, m * k) };
        }
        return;
    }
    for_each_widened_block(n, k, widen, |rows, block| {
        let (j0, rows) = (rows.start, rows.len());
        let read_dst = accumulate || j0 > 0;
        let dy = Strided {
            // SAFETY: column j0 of dy [m, n] (row stride n).
            ptr: unsafe { dy.as_ptr().add(j0) },
            cs: 1,
            rs: n as isize,
        };
        let block = Strided {
            ptr: block.as_ptr(),
            cs: 1,
            rs: k as isize,
        };
        // SAFETY: dy[:, j0..j0+rows] lies inside dy, block is [rows, k], dx the caller's.
        unsafe { sgemm_strided(m, k, rows, dy, block, dx, read_dst, threads) }
    });
}

/// `y[m, n] = x[m, k] · wᵀ` for a weight `w[n, k]` stored in f32, bf16 or f16, on the
/// calling thread, into `y` not initialized yet (every element written): one expert's
/// product in a grouped MoE GEMM whose experts run side by side. Narrow weights are widened
/// exactly to f32 a block of rows at a time (f32 products of the f32 `x`; unlike
/// [`super::matmul_weight_t`], which multiplies bf16 weights in bf16).
///
/// # Panics
/// When a slice is shorter than its shape needs, or `w` is quantized (experts train in f32,
/// bf16 or f16).
pub fn matmul_weight_t_serial(
    x: &[f32],
    w: WeightRef<'_>,
    y: &mut [MaybeUninit<f32>],
    (m, n, k): (usize, usize, usize),
) {
    assert!(x.len() >= m * k && y.len() >= m * n && w.len() >= n * k);
    let dest = Dest {
        ptr: y.as_mut_ptr().cast(),
        ldc: n,
    };
    match w {
        WeightRef::F32(w) => sgemm_serial_uninit(m, n, k, x, Op::N, w, Op::T, y),
        // SAFETY: y is [m, n] (checked above), exclusive; written, not read.
        WeightRef::BF16(w) => unsafe { blocks_t(x, bf16_widener(w, k), dest, (m, n, k), false, 1) },
        // SAFETY: as above.
        WeightRef::F16(w) => unsafe { blocks_t(x, widener(w, k), dest, (m, n, k), false, 1) },
        WeightRef::Quant(_) => panic!("an expert's weight is f32, bf16 or f16, not quantized"),
    }
}

/// `dx[m, k] = dy[m, n] · w` for a weight `w[n, k]` stored in f32, bf16 or f16, on the
/// calling thread, into `dx` not initialized yet (every element written): the input gradient
/// of one expert's [`matmul_weight_t_serial`].
///
/// # Panics
/// As [`matmul_weight_t_serial`].
pub fn matmul_weight_serial(
    dy: &[f32],
    w: WeightRef<'_>,
    dx: &mut [MaybeUninit<f32>],
    (m, n, k): (usize, usize, usize),
) {
    assert!(dy.len() >= m * n && dx.len() >= m * k && w.len() >= n * k);
    let dest = Dest {
        ptr: dx.as_mut_ptr().cast(),
        ldc: k,
    };
    match w {
        WeightRef::F32(w) => sgemm_serial_uninit(m, k, n, dy, Op::N, w, Op::N, dx),
        // SAFETY: dx is [m, k] (checked above), exclusive; written, not read.
        WeightRef::BF16(w) => unsafe {
            blocks_n(dy, bf16_widener(w, k), dest, (m, n, k), false, 1)
        },
        // SAFETY: as above.
        WeightRef::F16(w) => unsafe { blocks_n(dy, widener(w, k), dest, (m, n, k), false, 1) },
        WeightRef::Quant(_) => panic!("an expert's weight is f32, bf16 or f16, not quantized"),
    }
}

/// The one-thread `widen(rows, block)` of the bf16 weight `w[n, k]` (vectorized).
fn bf16_widener(w: &[bf16], k: usize) -> impl Fn(Range<usize>, &mut [f32]) + '_ {
    move |rows, block| crate::gemm_bf16::widen_bf16(&w[rows.start * k..rows.end * k], block)
}

/// The one-thread `widen(rows, block)` of the narrow weight `w[n, k]`.
fn widener<W: Element>(w: &[W], k: usize) -> impl Fn(Range<usize>, &mut [f32]) + '_ {
    move |rows, block| {
        let src = &w[rows.start * k..rows.end * k];
        block.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32());
    }
}
