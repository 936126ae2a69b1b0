//! Quantized weights kept in ggml's block formats and multiplied without dequantizing them
//! whole: llama.cpp's way of serving GGUF files.
//!
//! - [`QuantType`], [`dequantize`] (`blocks.rs`): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K,
//!   bit-identical to gguf-py's `quants.py`.
//! - [`QuantMatrix`]: a `[rows, cols]` weight as row segments, each in one format (llama.cpp's
//!   mixes, e.g. Q4_K_M's Q6_K value projections beside Q4_K queries, fuse into one matrix).
//! - [`quant_matmul_t`] (`matmul.rs`): `y = x·Wᵀ`. Few rows (decode, batched decode)
//!   quantize `x` to int8 per 32 values ([`Q8Rows`]) and take integer dot products (`dot.rs`;
//!   AVX512-VNNI in `avx512.rs`, and for Q4_0 eight weight rows at a time in
//!   `rows8.rs`, chosen at run time); many rows (prefill) dequantize blocks of weight rows and
//!   multiply them in bf16 ([`crate::gemm_bf16`]; f32 where the CPU's bf16 products are slow,
//!   and there Q4_0 takes the eight-row integer kernel as llama.cpp's prompt processing does).
//!   [`QuantRows`] names the path instead of the number of rows choosing it.

mod activation;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod blocks;
mod dot;
mod matmul;
#[cfg(target_arch = "x86_64")]
mod rows8;
#[cfg(test)]
mod tests;

pub use activation::{Q8Row, Q8Rows, QK8};
pub use blocks::{QK_K, QuantType, dequantize};
pub use matmul::{INT8_MAX_ROWS, QuantRows, quant_matmul, quant_matmul_t, quant_matmul_t_with};

use std::ops::Range;

/// Why bytes cannot be a quantized matrix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    /// A row is not a whole number of blocks.
    #[error("{ty} rows of {cols} values are not whole blocks of {block}")]
    Columns {
        ty: QuantType,
        cols: usize,
        block: usize,
    },
    /// The data is not the size of the rows.
    #[error("{rows} rows of {cols} {ty} values take {expected} bytes, got {actual}")]
    Length {
        ty: QuantType,
        rows: usize,
        cols: usize,
        expected: usize,
        actual: usize,
    },
    /// Pieces to stack have different row lengths, or a row range leaves its matrix.
    #[error("cannot stack rows {rows:?} of a [{of_rows}, {cols}] matrix onto rows of {want}")]
    Stack {
        rows: Range<usize>,
        of_rows: usize,
        cols: usize,
        want: usize,
    },
}

/// Consecutive rows of a [`QuantMatrix`] in one format.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantSegment {
    ty: QuantType,
    rows: usize,
    /// `rows · row_bytes` bytes, row-major.
    data: Vec<u8>,
}

impl QuantSegment {
    /// The block format.
    pub fn ty(&self) -> QuantType {
        self.ty
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The rows' bytes, row-major.
    pub fn data(&self) -> &[u8] {
        &self.data
    }
}

/// A `[rows, cols]` row-major weight (a linear layer's `[out, in]`) in ggml block formats.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantMatrix {
    cols: usize,
    segments: Vec<QuantSegment>,
}

impl QuantMatrix {
    /// `rows` rows of `cols` values of `ty` from their bytes (a GGUF tensor's data).
    ///
    /// # Errors
    /// `cols` not whole blocks, or `data` not exactly the rows' bytes.
    pub fn new(
        ty: QuantType,
        rows: usize,
        cols: usize,
        data: Vec<u8>,
    ) -> Result<QuantMatrix, QuantError> {
        let row_bytes = ty.row_bytes(cols).ok_or(QuantError::Columns {
            ty,
            cols,
            block: ty.block_layout().0,
        })?;
        if Some(data.len()) != rows.checked_mul(row_bytes) {
            return Err(QuantError::Length {
                ty,
                rows,
                cols,
                expected: rows.saturating_mul(row_bytes),
                actual: data.len(),
            });
        }
        Ok(QuantMatrix {
            cols,
            segments: vec![QuantSegment { ty, rows, data }],
        })
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.segments.iter().map(|s| s.rows).sum()
    }

    /// Values per row.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The row segments, top to bottom.
    pub fn segments(&self) -> &[QuantSegment] {
        &self.segments
    }

    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        self.segments.iter().map(|s| s.data.len()).sum()
    }

    /// Row `r`'s format and bytes.
    ///
    /// # Panics
    /// When `r >= rows()`.
    pub fn row(&self, mut r: usize) -> (QuantType, &[u8]) {
        for s in &self.segments {
            if r < s.rows {
                let bytes = s.data.len() / s.rows;
                return (s.ty, &s.data[r * bytes..][..bytes]);
            }
            r -= s.rows;
        }
        panic!("row past the end of a quantized matrix");
    }

    /// The rows `pieces` name, stacked in order (as `Tensor::cat_rows`): Megatron's fused
    /// `linear_qkv` and `linear_fc1` from HF's separate projections, or rows reordered.
    /// Adjacent rows of one format share a segment.
    ///
    /// # Errors
    /// [`QuantError::Stack`] when the pieces' row lengths differ or a range leaves its matrix.
    pub fn cat_rows(pieces: &[(&QuantMatrix, Range<usize>)]) -> Result<QuantMatrix, QuantError> {
        let cols = pieces.first().map_or(0, |(m, _)| m.cols);
        let mut out = QuantMatrix {
            cols,
            segments: Vec::new(),
        };
        for (m, rows) in pieces {
            if m.cols != cols || rows.end > m.rows() || rows.start > rows.end {
                return Err(QuantError::Stack {
                    rows: rows.clone(),
                    of_rows: m.rows(),
                    cols: m.cols,
                    want: cols,
                });
            }
            for r in rows.clone() {
                let (ty, bytes) = m.row(r);
                match out.segments.last_mut() {
                    Some(s) if s.ty == ty => {
                        s.rows += 1;
                        s.data.extend_from_slice(bytes);
                    }
                    _ => out.segments.push(QuantSegment {
                        ty,
                        rows: 1,
                        data: bytes.to_vec(),
                    }),
                }
            }
        }
        Ok(out)
    }

    /// [`QuantMatrix::dequantize_rows`] with blocks of 16 rows in parallel on the rayon pool.
    ///
    /// # Panics
    /// As [`QuantMatrix::dequantize_rows`].
    pub fn dequantize_rows_par(&self, rows: Range<usize>, out: &mut [f32]) {
        use rayon::prelude::*;
        const ROWS: usize = 16;
        assert_eq!(out.len(), rows.len() * self.cols);
        out.par_chunks_mut(ROWS * self.cols.max(1))
            .enumerate()
            .for_each(|(i, o)| {
                let start = rows.start + i * ROWS;
                self.dequantize_rows(start..start + o.len() / self.cols.max(1), o);
            });
    }

    /// Dequantizes rows `rows` into `out[rows.len(), cols]` (exactly, as [`dequantize`]).
    ///
    /// # Panics
    /// When `rows` leaves the matrix or `out` is not `rows.len() · cols` long.
    pub fn dequantize_rows(&self, rows: Range<usize>, out: &mut [f32]) {
        assert_eq!(out.len(), rows.len() * self.cols);
        #[cfg(target_arch = "x86_64")]
        let simd = avx512::available();
        for (r, o) in rows.zip(out.chunks_exact_mut(self.cols.max(1))) {
            let (ty, bytes) = self.row(r);
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: the CPU has the kernels' features; `bytes` is one whole row.
                unsafe { avx512::dequantize_row(ty, bytes, o) };
                continue;
            }
            dequantize(ty, bytes, o);
        }
    }
}
