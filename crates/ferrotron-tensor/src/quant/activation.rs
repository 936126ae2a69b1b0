//! Activations quantized to int8 for the integer dot products of quantized weights.
//!
//! As ggml's `quantize_row_q8_0` (llama.cpp `ggml/src/ggml-quants.c`): each block of 32 values
//! gets the scale `d = max|x| / 127` and `q = round(x / d)`, plus the block's `Σq` (as
//! `block_q8_1` keeps `d·Σq`) for formats with a min or an offset. Two choices differ from
//! ggml, both toward accuracy: `d` stays f32 (ggml rounds it to f16), and every weight format
//! uses these 32-value blocks (ggml quantizes activations for K-quants per 256 values,
//! `block_q8_K`). Rounding is to nearest-even, the same in the scalar and SIMD paths.

/// Values per activation block.
pub const QK8: usize = 32;

/// `m` rows of `k` activations quantized in blocks of [`QK8`].
#[derive(Clone, Debug, Default)]
pub struct Q8Rows {
    k: usize,
    /// `[m, k/32]` scales.
    d: Vec<f32>,
    /// `[m, k/32]` sums of the block's quantized values.
    sum: Vec<i32>,
    /// `[m, k]` quantized values.
    qs: Vec<i8>,
}

/// One quantized activation row: its scales, block sums and values.
#[derive(Clone, Copy, Debug)]
pub struct Q8Row<'a> {
    /// `[k/32]`.
    pub d: &'a [f32],
    /// `[k/32]`.
    pub sum: &'a [i32],
    /// `[k]`.
    pub qs: &'a [i8],
}

impl Q8Rows {
    /// Quantizes `x[m, k]` (`k` a multiple of 32), rows in parallel when there are many.
    ///
    /// # Panics
    /// When `k` is not a multiple of 32 or `x.len() != m·k` (caller bugs).
    pub fn quantize(x: &[f32], m: usize, k: usize) -> Q8Rows {
        use rayon::prelude::*;
        assert!(k.is_multiple_of(QK8) && x.len() == m * k);
        let blocks = k / QK8;
        let mut rows = Q8Rows {
            k,
            d: vec![0.0; m * blocks],
            sum: vec![0; m * blocks],
            qs: vec![0; m * k],
        };
        let work = x
            .par_chunks(QK8)
            .zip(rows.qs.par_chunks_mut(QK8))
            .zip(rows.d.par_iter_mut().zip(rows.sum.par_iter_mut()))
            .with_min_len(256);
        let quantize = block_quantizer();
        work.for_each(|((x, q), (d, sum))| {
            let (x, q) = (
                x.try_into().expect("32 values"),
                q.try_into().expect("32 bytes"),
            );
            (*d, *sum) = quantize(x, q);
        });
        rows
    }

    /// Row `i`.
    ///
    /// # Panics
    /// When `i` is past the last row.
    pub fn row(&self, i: usize) -> Q8Row<'_> {
        let blocks = self.k / QK8;
        Q8Row {
            d: &self.d[i * blocks..][..blocks],
            sum: &self.sum[i * blocks..][..blocks],
            qs: &self.qs[i * self.k..][..self.k],
        }
    }

    /// The dequantized values of row `i` (`d·q`), for tests.
    pub fn dequantized_row(&self, i: usize) -> Vec<f32> {
        let r = self.row(i);
        r.qs.chunks_exact(QK8)
            .zip(r.d)
            .flat_map(|(q, &d)| q.iter().map(move |&q| d * f32::from(q)))
            .collect()
    }
}

/// The fastest block quantizer this CPU runs (all give the same bytes).
fn block_quantizer() -> fn(&[f32; QK8], &mut [i8; QK8]) -> (f32, i32) {
    #[cfg(target_arch = "x86_64")]
    if super::avx512::available() {
        // SAFETY: the CPU has the kernel's features (checked just above).
        return |x, q| unsafe { super::avx512::quantize_block(x, q) };
    }
    quantize_block
}

/// Quantizes one block; returns its scale and `Σq`.
pub(crate) fn quantize_block(x: &[f32; QK8], q: &mut [i8; QK8]) -> (f32, i32) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in q.iter_mut().zip(x) {
        // |v·id| <= 127 up to rounding; the clamp keeps a NaN-free input in range.
        let r = (v * id).round_ties_even().clamp(-127.0, 127.0) as i8;
        *q = r;
        sum += i32::from(r);
    }
    (d, sum)
}
