//! Matrix multiplication: f32 GEMM through the `gemm` crate (its `x86-v4` AVX-512 kernels are
//! selected at run time, so the binary still runs on CPUs without AVX-512), and a linear
//! layer's three products for f32/bf16/f16 weights (bf16 weights compute in bf16 through
//! [`crate::gemm_bf16`]).

use crate::gemm_bf16::{Operand, Operand::Bf16, Operand::F32, bf16_gemm};
use crate::gemv;
use crate::quant::{QuantMatrix, QuantRows, quant_matmul, quant_matmul_t_with};
use half::{bf16, f16};
use rayon::prelude::*;

mod blocks;
mod sgemm;
pub(crate) use blocks::dequantized_blocks_n;
use blocks::{dequantized_blocks_t, widen_rows};
pub use blocks::{matmul_weight_serial, matmul_weight_t_serial};
pub(crate) use sgemm::sgemm_raw;

pub use sgemm::{sgemm, sgemm_serial, sgemm_serial_uninit};

/// How an operand is read: as stored (row-major) or transposed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Use the stored row-major matrix.
    N,
    /// Use the transpose of the stored row-major matrix.
    T,
}

/// Elements borrowed in their storage dtype: a linear layer's weight `[n, k]` (HF
/// `[out, in]`), or any range of a [`Storage`](crate::Storage).
#[derive(Clone, Copy, Debug)]
pub enum WeightRef<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    F16(&'a [f16]),
    /// A whole `[n, k]` matrix in ggml block formats (a weight served from GGUF): multiplied
    /// by [`quant_matmul_t`](crate::quant::quant_matmul_t), never dequantized whole in the products.
    Quant(&'a QuantMatrix),
}

impl<'a> WeightRef<'a> {
    /// Element count.
    pub fn len(&self) -> usize {
        match self {
            WeightRef::F32(v) => v.len(),
            WeightRef::BF16(v) => v.len(),
            WeightRef::F16(v) => v.len(),
            WeightRef::Quant(q) => q.rows() * q.cols(),
        }
    }

    /// True when no elements are borrowed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The storage dtype; quantized blocks report F32, the dtype their values dequantize
    /// to and their products compute in.
    pub fn dtype(&self) -> crate::DType {
        match self {
            WeightRef::F32(_) | WeightRef::Quant(_) => crate::DType::F32,
            WeightRef::BF16(_) => crate::DType::BF16,
            WeightRef::F16(_) => crate::DType::F16,
        }
    }

    /// Elements `range` of these.
    ///
    /// # Panics
    /// When `range` leaves them, or on a quantized matrix unless `range` is all of it
    /// (its blocks are not addressable by element).
    pub fn slice(&self, range: std::ops::Range<usize>) -> WeightRef<'a> {
        match *self {
            WeightRef::F32(v) => WeightRef::F32(&v[range]),
            WeightRef::BF16(v) => WeightRef::BF16(&v[range]),
            WeightRef::F16(v) => WeightRef::F16(&v[range]),
            WeightRef::Quant(q) => {
                assert!(
                    range == (0..self.len()),
                    "a quantized weight is sliced whole"
                );
                WeightRef::Quant(q)
            }
        }
    }

    /// Widens the elements (exactly) into `out` (same length), rayon-parallel.
    ///
    /// # Panics
    /// When `out.len() != self.len()`.
    pub fn copy_to_f32(&self, out: &mut [f32]) {
        fn widen<T: crate::Element>(s: &[T], d: &mut [f32]) {
            assert_eq!(s.len(), d.len());
            let chunk = crate::storage::CHUNK;
            d.par_chunks_mut(chunk)
                .zip(s.par_chunks(chunk))
                .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, s)| *d = s.to_f32()));
        }
        match *self {
            WeightRef::F32(v) => out.copy_from_slice(v),
            WeightRef::BF16(v) => widen(v, out),
            WeightRef::F16(v) => widen(v, out),
            WeightRef::Quant(q) => q.dequantize_rows_par(0..q.rows(), out),
        }
    }

    /// The elements as f32: borrowed when stored in f32, widened (exactly) otherwise (bf16
    /// by the vectorized widening of [`Operand::to_f32`], into memory not zeroed first).
    pub fn to_f32(&self) -> std::borrow::Cow<'a, [f32]> {
        match *self {
            WeightRef::F32(v) => std::borrow::Cow::Borrowed(v),
            WeightRef::BF16(v) => Bf16(v).to_f32(),
            narrow => {
                let mut out = vec![0.0; narrow.len()];
                narrow.copy_to_f32(&mut out);
                std::borrow::Cow::Owned(out)
            }
        }
    }
}

/// Activations with at most this many rows use the memory-bound GEMV kernels (decode, and
/// batched decode of a serving engine: each weight row read once for all rows, every row's
/// result independent of the others) for bf16 and quantized weights; larger products use GEMM.
pub const GEMV_MAX_ROWS: usize = 16;

/// [`GEMV_MAX_ROWS`] for f32 and f16 weights: the f32 GEMM packs the whole weight on every
/// call, which costs more than multiplying up to 64 rows by the GEMV kernels (engine decode
/// of SmolLM2 in f32, 24 and 32 requests: 151 -> 251 and 172 -> 241 output tokens/s), while
/// the bf16 GEMM's half-size packing and double-rate products win from 17 rows on.
pub const GEMV_MAX_ROWS_F32: usize = 64;

/// `y[m, n] = x[m, k] · wᵀ` (or `+=` when `accumulate`) for a weight `w[n, k]` in any storage
/// dtype. Few rows use the GEMV kernels ([`GEMV_MAX_ROWS_F32`], [`GEMV_MAX_ROWS`]); otherwise f32 weights go straight to GEMM, bf16
/// weights compute in bf16 ([`bf16_gemm`]: `x` rounded to bf16, f32 sums) and f16 weights are
/// widened to f32 in blocks of rows first; quantized weights take [`quant_matmul_t`](crate::quant::quant_matmul_t)'s path by
/// the number of rows.
pub fn matmul_weight_t(
    x: &[f32],
    w: WeightRef<'_>,
    y: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) {
    matmul_weight_t_with(x, w, y, (m, n, k), accumulate, QuantRows::BySize);
}

/// [`matmul_weight_t`] with a quantized weight's path chosen by `quant` ([`QuantRows`]);
/// other weights ignore it.
///
/// # Panics
/// As [`matmul_weight_t`].
pub fn matmul_weight_t_with(
    x: &[f32],
    w: WeightRef<'_>,
    y: &mut [f32],
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
    quant: QuantRows,
) {
    assert!(x.len() >= m * k && y.len() >= m * n);
    if m == 0 {
        return;
    }
    if m == 1 {
        match w {
            WeightRef::F32(w) => gemv::gemv(w, &x[..k], &mut y[..n], accumulate),
            WeightRef::BF16(w) => gemv::gemv_bf16(w, &x[..k], &mut y[..n], accumulate),
            WeightRef::F16(w) => gemv::gemv(w, &x[..k], &mut y[..n], accumulate),
            WeightRef::Quant(w) => quant_matmul_t_with(x, w, y, (m, n, k), accumulate, quant),
        }
        return;
    }
    match w {
        WeightRef::F32(w) if m <= GEMV_MAX_ROWS_F32 => {
            return gemv::gemv_rows(w, x, y, (m, n, k), accumulate);
        }
        WeightRef::F16(w) if m <= GEMV_MAX_ROWS_F32 => {
            return gemv::gemv_rows(w, x, y, (m, n, k), accumulate);
        }
        WeightRef::BF16(w) if m <= GEMV_MAX_ROWS => {
            return gemv::gemv_rows_bf16(w, x, y, (m, n, k), accumulate);
        }
        _ => {}
    }
    match w {
        WeightRef::F32(w) => sgemm(m, n, k, x, Op::N, w, Op::T, y, accumulate),
        WeightRef::BF16(w) => bf16_gemm(m, n, k, F32(x), Op::N, Bf16(w), Op::T, y, accumulate),
        WeightRef::F16(w) => {
            let widen = |rows, out: &mut [f32]| widen_rows(w, rows, k, out);
            dequantized_blocks_t(x, widen, y, (m, n, k), accumulate)
        }
        // Chooses between its int8 rows and the prefill kernels by `quant`.
        WeightRef::Quant(w) => quant_matmul_t_with(x, w, y, (m, n, k), accumulate, quant),
    }
}

/// `dx[m, k] = dy[m, n] · w` (or `+=` when `accumulate`) for a weight `w[n, k]` in any
/// storage dtype: the input gradient of a linear layer. f32 weights go straight to GEMM;
/// bf16 weights compute in bf16 ([`bf16_gemm`], `dy` rounded to bf16 unless it is
/// [`Operand::Rounded`] already); f16 weights are widened `CONVERT_ROWS` rows at a time,
/// each block adding its part (`dy[:, j0..j1] · w[j0..j1, :]`), so no f32 copy of the whole
/// weight is ever made. `dy` as f32 for the weights that are not bf16 (a bf16 `dy` widened).
pub fn matmul_weight(
    dy: Operand<'_>,
    w: WeightRef<'_>,
    dx: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) {
    assert!(dy.len() >= m * n && dx.len() >= m * k);
    match w {
        WeightRef::BF16(w) => bf16_gemm(m, k, n, dy, Op::N, Bf16(w), Op::N, dx, accumulate),
        WeightRef::F32(w) => sgemm(m, k, n, &dy.to_f32(), Op::N, w, Op::N, dx, accumulate),
        WeightRef::F16(w) => {
            let widen = |rows, out: &mut [f32]| widen_rows(w, rows, k, out);
            dequantized_blocks_n(&dy.to_f32(), widen, dx, (m, n, k), accumulate)
        }
        WeightRef::Quant(w) => quant_matmul(&dy.to_f32(), w, dx, (m, n, k), accumulate),
    }
}

/// `dw[n, k] += dy[m, n]ᵀ · x[m, k]`: the weight gradient of a linear layer whose weight `w`
/// is stored as given, accumulated in f32 (Megatron's `gradient_accumulation_fusion` into the
/// f32 main gradient). A bf16 weight trains in bf16: `dy` and `x` are rounded to bf16 and
/// multiplied by [`bf16_gemm`], as autocast's backward multiplies bf16 tensors (`x` may be
/// the bf16 activation the forward kept, read as it is; either may be
/// [`Operand::Rounded`]); f32 and f16 weights use the f32 GEMM (bf16 operands widened
/// first).
pub fn weight_grad(
    dy: Operand<'_>,
    x: Operand<'_>,
    w: WeightRef<'_>,
    dw: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
) {
    match w {
        WeightRef::BF16(_) => bf16_gemm(n, k, m, dy, Op::T, x, Op::N, dw, true),
        WeightRef::F32(_) | WeightRef::F16(_) => {
            let (dy, x) = (dy.to_f32(), x.to_f32());
            sgemm(n, k, m, &dy, Op::T, &x, Op::N, dw, true)
        }
        WeightRef::Quant(_) => panic!("a quantized weight is frozen: it has no gradient"),
    }
}

#[cfg(test)]
mod tests;
