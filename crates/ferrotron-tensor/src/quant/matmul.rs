//! Products with a [`QuantMatrix`] weight `w[n, k]` (a linear layer's `[out, in]`).

use super::activation::{Q8Row, Q8Rows};
use super::dot::dot_scalar;
use super::{QuantMatrix, QuantType};
use crate::gemm::{GEMV_MAX_ROWS, Op, dequantized_blocks_n};
use crate::gemm_bf16::{Operand::F32, bf16_gemm};
use rayon::prelude::*;

/// Weight rows dequantized at a time on the prefill path (a `TILE_ROWS × k` f32 tile).
const TILE_ROWS: usize = 1024;

/// Fewest weight rows per rayon task of the integer path.
const MIN_ROWS_PER_TASK: usize = 16;

/// Weight rows per rayon task for `rows` rows: four equal tasks per thread (even shares for
/// the last ones), at least [`MIN_ROWS_PER_TASK`].
fn rows_per_task(rows: usize) -> usize {
    rows.div_ceil(4 * rayon::current_num_threads())
        .max(MIN_ROWS_PER_TASK)
}

/// `y[m, n] = x[m, k] · wᵀ` (`+=` when `accumulate`) for a quantized `w[n, k]`.
///
/// Up to [`GEMV_MAX_ROWS`] rows (decode, batched decode) take integer dot products with `x`
/// quantized to int8 per 32 values (llama.cpp's `ggml_vec_dot_*`); each row of `y` is
/// computed by the same sequence of operations whatever `m` is, so a served request's decode
/// does not depend on its batch. More rows (prefill) dequantize 1024 weight rows at
/// a time (exactly, to f32) and multiply them with `x` by the bf16 GEMM (both operands
/// rounded to bf16, f32 sums: the weights' values lose less than their quantization already
/// cost, the activations keep more than int8 keeps); the weight is never dequantized whole.
///
/// # Panics
/// When `w` is not `[n, k]` or a slice is shorter than its shape (caller bugs).
pub fn quant_matmul_t(
    x: &[f32],
    w: &QuantMatrix,
    y: &mut [f32],
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
) {
    assert!(w.rows() == n && w.cols() == k && x.len() >= m * k && y.len() >= m * n);
    if m == 0 || n == 0 {
        return;
    }
    if m > GEMV_MAX_ROWS {
        bf16_tiles(&x[..m * k], w, y, (m, n, k), accumulate);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    let simd = super::avx512::available();
    #[cfg(not(target_arch = "x86_64"))]
    let simd = false;
    let xq = Q8Rows::quantize(&x[..m * k], m, k);
    let rows: Vec<Q8Row<'_>> = (0..m).map(|i| xq.row(i)).collect();
    // yt[n, m]: each task writes its weight rows' dots with every activation row.
    let mut yt = vec![0f32; n * m];
    let mut start = 0;
    for seg in w.segments() {
        let row_bytes = seg.data().len() / seg.rows();
        let per_task = rows_per_task(seg.rows());
        yt[start * m..(start + seg.rows()) * m]
            .par_chunks_mut(per_task * m)
            .zip(seg.data().par_chunks(per_task * row_bytes))
            .for_each(|(out, data)| {
                for (o, row) in out.chunks_exact_mut(m).zip(data.chunks_exact(row_bytes)) {
                    dots(seg.ty(), row, &rows, o, simd);
                }
            });
        start += seg.rows();
    }
    for (i, y) in y[..m * n].chunks_exact_mut(n).enumerate() {
        for (j, y) in y.iter_mut().enumerate() {
            let v = yt[j * m + i];
            *y = if accumulate { *y + v } else { v };
        }
    }
}

/// `dx[m, k] = dy[m, n] · w` (`+=` when `accumulate`) for a quantized `w[n, k]`: the input
/// gradient of a frozen quantized linear layer (a LoRA base), dequantizing 512 weight rows at
/// a time (never the whole weight) for the f32 GEMM.
///
/// # Panics
/// When `w` is not `[n, k]` or a slice is shorter than its shape (caller bugs).
pub fn quant_matmul(
    dy: &[f32],
    w: &QuantMatrix,
    dx: &mut [f32],
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
) {
    assert!(w.rows() == n && w.cols() == k && dy.len() >= m * n && dx.len() >= m * k);
    let widen = |rows: std::ops::Range<usize>, out: &mut [f32]| w.dequantize_rows_par(rows, out);
    dequantized_blocks_n(dy, widen, dx, (m, n, k), accumulate);
}

/// The prefill path of [`quant_matmul_t`]: tiles of weight rows dequantized to f32 and
/// multiplied by the bf16 GEMM into a `[m, rows]` block, then added to their columns of `y`.
fn bf16_tiles(
    x: &[f32],
    w: &QuantMatrix,
    y: &mut [f32],
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
) {
    let mut tile = vec![0f32; TILE_ROWS.min(n) * k];
    let mut block = vec![0f32; m * TILE_ROWS.min(n)];
    for j0 in (0..n).step_by(TILE_ROWS) {
        let rows = TILE_ROWS.min(n - j0);
        let (tile, block) = (&mut tile[..rows * k], &mut block[..m * rows]);
        w.dequantize_rows_par(j0..j0 + rows, tile);
        bf16_gemm(m, rows, k, F32(x), Op::N, F32(tile), Op::T, block, false);
        for (y, b) in y.chunks_exact_mut(n).zip(block.chunks_exact(rows)) {
            let y = &mut y[j0..j0 + rows];
            if accumulate {
                y.iter_mut().zip(b).for_each(|(y, b)| *y += b);
            } else {
                y.copy_from_slice(b);
            }
        }
    }
}

/// `out[r] = row · xs[r]` for every activation row: four at a time through the SIMD kernel
/// where the CPU has it (`simd`: [`super::avx512::available`]; the weight block unpacked
/// once for four rows), the rest one by one.
fn dots(ty: QuantType, row: &[u8], xs: &[Q8Row<'_>], out: &mut [f32], simd: bool) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        let mut quads = xs.chunks_exact(4);
        let mut outs = out.chunks_exact_mut(4);
        for (x, o) in (&mut quads).zip(&mut outs) {
            let x: &[Q8Row<'_>; 4] = x.try_into().expect("4 rows");
            // SAFETY: the CPU has the kernels' features; `row` is one whole row for `x`.
            o.copy_from_slice(&unsafe { super::avx512::dot_rows(ty, row, x) });
        }
        for (x, o) in quads.remainder().iter().zip(outs.into_remainder()) {
            // SAFETY: as above.
            *o = unsafe { super::avx512::dot_rows(ty, row, &[*x]) }[0];
        }
        return;
    }
    for (x, o) in xs.iter().zip(out) {
        *o = dot_scalar(ty, row, *x);
    }
}
