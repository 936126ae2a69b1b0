//! Products with a [`QuantMatrix`] weight `w[n, k]` (a linear layer's `[out, in]`).

use super::activation::{Q8Row, Q8Rows};
use super::dot::dot_scalar;
use super::{QuantMatrix, QuantType};
use crate::gemm::{Op, dequantized_blocks_n};
use crate::gemm_bf16::{Bf16Kernel, Operand::F32, bf16_gemm_with};
use rayon::prelude::*;

/// Weight rows dequantized at a time on the prefill path (a `TILE_ROWS × k` f32 tile).
const TILE_ROWS: usize = 1024;

/// Most activation rows that take the integer path of [`quant_matmul_t`] by their number
/// ([`QuantRows::BySize`]); more (prefill) take the bf16 tiles.
pub const INT8_MAX_ROWS: usize = 16;

/// How [`quant_matmul_t`] multiplies the activation rows: llama.cpp's token generation
/// (integer dot products) or its prompt processing. A server chooses by what the rows are,
/// not by how many a step holds, so that a request's arithmetic never depends on what else
/// its step carries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QuantRows {
    /// Up to [`INT8_MAX_ROWS`] rows as [`QuantRows::Decode`], more as [`QuantRows::Prefill`].
    #[default]
    BySize,
    /// Integer dot products with the rows quantized to int8 per 32 values, however many.
    Decode,
    /// Prompt processing, however few rows: weight rows dequantized in tiles and multiplied
    /// in bf16; where the CPU's bf16 products are slower than its f32 FMAs
    /// ([`crate::gemm_bf16::Bf16Kernel::detect`]) a matrix all of Q4_0 takes the integer
    /// kernel eight weight rows at a time instead (llama.cpp's `ggml_gemm_q4_0_8x8_q8_0`;
    /// SmolLM2 pp512 837 vs 585 tokens/s on such a Xeon).
    Prefill,
}

/// Fewest weight rows per rayon task of the integer path.
const MIN_ROWS_PER_TASK: usize = 16;

/// Weight rows per rayon task for `rows` rows: four equal tasks per thread (even shares for
/// the last ones), at least [`MIN_ROWS_PER_TASK`], a multiple of 8 (the Q4_0 kernel's group).
fn rows_per_task(rows: usize) -> usize {
    rows.div_ceil(4 * rayon::current_num_threads())
        .max(MIN_ROWS_PER_TASK)
        .next_multiple_of(8)
}

/// `y[m, n] = x[m, k] · wᵀ` (`+=` when `accumulate`) for a quantized `w[n, k]`.
///
/// Up to [`INT8_MAX_ROWS`] rows (decode, batched decode) take integer dot products with `x`
/// quantized to int8 per 32 values (llama.cpp's `ggml_vec_dot_*`; Q4_0 weight rows eight at
/// a time where the CPU has AVX512-VNNI, as its `ggml_gemm_q4_0_8x8_q8_0`); each row of `y` is
/// computed by the same sequence of operations whatever `m` is, so a served request's decode
/// does not depend on its batch. More rows (prefill, [`QuantRows::Prefill`]) dequantize 1024
/// weight rows at a time (exactly, to f32) and multiply them with `x` by the bf16 GEMM (both
/// operands rounded to bf16, f32 sums: the weights' values lose less than their quantization
/// already cost, the activations keep more than int8 keeps) or, where the CPU's bf16 products
/// are slow, a Q4_0 matrix by the integer kernel; the weight is never dequantized whole. A
/// row's result never depends on the other rows.
///
/// # Panics
/// When `w` is not `[n, k]` or a slice is shorter than its shape (caller bugs).
pub fn quant_matmul_t(
    x: &[f32],
    w: &QuantMatrix,
    y: &mut [f32],
    dims: (usize, usize, usize),
    accumulate: bool,
) {
    quant_matmul_t_with(x, w, y, dims, accumulate, QuantRows::BySize);
}

/// [`quant_matmul_t`] on the path `path` says.
///
/// # Panics
/// As [`quant_matmul_t`].
pub fn quant_matmul_t_with(
    x: &[f32],
    w: &QuantMatrix,
    y: &mut [f32],
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
    path: QuantRows,
) {
    assert!(w.rows() == n && w.cols() == k && x.len() >= m * k && y.len() >= m * n);
    if m == 0 || n == 0 {
        return;
    }
    let prefill = match path {
        QuantRows::BySize => m > INT8_MAX_ROWS,
        QuantRows::Decode => false,
        QuantRows::Prefill => true,
    };
    if prefill && !integer_prefill(w) {
        bf16_tiles(&x[..m * k], w, y, (m, n, k), accumulate);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    let simd = super::avx512::available();
    #[cfg(not(target_arch = "x86_64"))]
    let simd = false;
    let xq = Q8Rows::quantize(&x[..m * k], m, k);
    let xs: Vec<Q8Row<'_>> = (0..m).map(|i| xq.row(i)).collect();
    // Each task takes a run of weight rows of one segment, and those columns of every row
    // of y (split off in column order, so the tasks' outputs are disjoint): `outs[t·m + r]`.
    let mut tasks: Vec<Task<'_>> = Vec::new();
    for seg in w.segments() {
        let row_bytes = seg.data().len() / seg.rows();
        let per_task = rows_per_task(seg.rows());
        for data in seg.data().chunks(per_task * row_bytes) {
            tasks.push(Task {
                ty: seg.ty(),
                data,
                row_bytes,
            });
        }
    }
    let mut outs: Vec<&mut [f32]> = Vec::new();
    outs.resize_with(tasks.len() * m, Default::default);
    for (r, mut rest) in y[..m * n].chunks_exact_mut(n).enumerate() {
        for (t, task) in tasks.iter().enumerate() {
            let (head, tail) = rest.split_at_mut(task.data.len() / task.row_bytes);
            outs[t * m + r] = head;
            rest = tail;
        }
    }
    tasks
        .par_iter()
        .zip(outs.par_chunks_mut(m))
        .for_each(|(t, out)| t.run(&xs, out, accumulate, simd));
}

/// Whether prompt rows of `w` take the integer kernel: every segment in a format the
/// eight-row kernel takes, on a CPU that has it and whose bf16 products are slow.
pub(super) fn integer_prefill(w: &QuantMatrix) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::avx512::available()
            && Bf16Kernel::detect() == Bf16Kernel::Widened
            && w.segments().iter().all(|s| super::rows8::supports(s.ty()))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = w;
        false
    }
}

/// Weight rows of one format: `data`, `row_bytes` each.
struct Task<'a> {
    ty: QuantType,
    data: &'a [u8],
    row_bytes: usize,
}

impl Task<'_> {
    /// `out[r][j] = w_j · xs[r]` (`+=` when `accumulate`) for the task's rows `w_j`: rows of
    /// formats [`rows8`] takes in groups of eight through it where the CPU has it (the
    /// groups are fixed by the rows' positions, not by the number of activation rows), the
    /// other rows one by one through [`dots`].
    ///
    /// [`rows8`]: super::rows8
    fn run(&self, xs: &[Q8Row<'_>], out: &mut [&mut [f32]], accumulate: bool, simd: bool) {
        let (ty, row_bytes) = (self.ty, self.row_bytes);
        let put = |y: &mut f32, v: f32| *y = if accumulate { *y + v } else { v };
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if simd && super::rows8::supports(ty) {
            for rows in self.data.chunks_exact(8 * row_bytes) {
                rows8_dots(ty, rows, row_bytes, xs, |r, v| {
                    out[r][done..done + 8]
                        .iter_mut()
                        .zip(v)
                        .for_each(|(y, &v)| put(y, v));
                });
                done += 8;
            }
        }
        if done * row_bytes == self.data.len() {
            return;
        }
        let mut col = vec![0f32; xs.len()];
        for row in self.data[done * row_bytes..].chunks_exact(row_bytes) {
            dots(ty, row, xs, &mut col, simd);
            out.iter_mut()
                .zip(&col)
                .for_each(|(y, &v)| put(&mut y[done], v));
            done += 1;
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
        // The first bf16 kernel, not the fastest: its rows never depend on the other rows
        // (the f32 GEMM's small-m paths do).
        let kernel = Bf16Kernel::available()[0];
        bf16_gemm_with(
            kernel,
            m,
            rows,
            k,
            F32(x),
            Op::N,
            F32(tile),
            Op::T,
            block,
            false,
        );
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

/// `put(r, [w_j · xs[r] for j in 0..8])` for eight rows of `ty` (`rows`, `8 · row_bytes`
/// bytes) and every activation row `r`, four activation rows per kernel call.
#[cfg(target_arch = "x86_64")]
fn rows8_dots(
    ty: QuantType,
    rows: &[u8],
    row_bytes: usize,
    xs: &[Q8Row<'_>],
    mut put: impl FnMut(usize, &[f32; 8]),
) {
    let mut quads = xs.chunks_exact(4);
    let mut r0 = 0;
    for x in &mut quads {
        let x: &[Q8Row<'_>; 4] = x.try_into().expect("4 rows");
        // SAFETY: the caller checked the CPU and the format; `rows` holds eight whole rows
        // of the activations' length.
        let res = unsafe { super::rows8::dot_rows8(ty, rows.as_ptr(), row_bytes, x) };
        res.iter().enumerate().for_each(|(i, v)| put(r0 + i, v));
        r0 += 4;
    }
    for x in quads.remainder() {
        // SAFETY: as above.
        let [v] = unsafe { super::rows8::dot_rows8(ty, rows.as_ptr(), row_bytes, &[*x]) };
        put(r0, &v);
        r0 += 1;
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
