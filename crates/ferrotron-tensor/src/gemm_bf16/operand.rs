//! [`Operand`]: a bf16 GEMM's operand as stored, and the vectorized conversions between f32
//! and bf16 values the GEMM's widened path and the training pass run (round to nearest even,
//! NaN kept and quieted: bit for bit [`crate::round_to_bf16_bits`]).

use half::bf16;
use rayon::prelude::*;
use std::borrow::Cow;
use std::mem::MaybeUninit;

/// One GEMM operand as stored (row-major): f32 values, rounded to bf16 when packed, or bf16.
#[derive(Clone, Copy, Debug)]
pub enum Operand<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    /// f32 values that are bf16 values already (rounded by the caller, e.g. by
    /// [`round_to_bf16_in_place`] once for two products): read as they are — the widened path
    /// multiplies them without a copy, the packers' rounding leaves them unchanged.
    Rounded(&'a [f32]),
}

impl<'a> Operand<'a> {
    /// The values as f32: borrowed when stored in f32, widened (exactly) from bf16.
    pub fn to_f32(&self) -> Cow<'a, [f32]> {
        match *self {
            Operand::F32(v) | Operand::Rounded(v) => Cow::Borrowed(v),
            Operand::Bf16(v) => Cow::Owned(self.rounded_f32(0, 1, v.len(), 0)),
        }
    }

    /// Element count.
    pub fn len(&self) -> usize {
        match self {
            Operand::F32(v) | Operand::Rounded(v) => v.len(),
            Operand::Bf16(v) => v.len(),
        }
    }

    /// No elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// As [`Operand::rounded_f32`], borrowed where the values are [`Operand::Rounded`] and
    /// contiguous.
    pub(super) fn widened(
        &self,
        start: usize,
        rows: usize,
        width: usize,
        stride: usize,
    ) -> Cow<'a, [f32]> {
        match *self {
            Operand::Rounded(v) if rows == 1 || stride == width => {
                Cow::Borrowed(&v[start..start + rows * width])
            }
            _ => Cow::Owned(self.rounded_f32(start, rows, width, stride)),
        }
    }

    /// `rows` runs of `width` stored values, the `r`-th starting at `start + r·stride`, rounded
    /// to bf16 and widened back to f32 (a block of columns of a row-major matrix). Vectorized
    /// and spread over the current rayon pool (it sits beside a GEMM on the widened path).
    pub(super) fn rounded_f32(
        &self,
        start: usize,
        rows: usize,
        width: usize,
        stride: usize,
    ) -> Vec<f32> {
        let mut out = Vec::with_capacity(rows * width);
        let dst = &mut out.spare_capacity_mut()[..rows * width];
        let src = |r: usize, len: usize| start + r * stride..start + r * stride + len;
        if rows == 1 || stride == width {
            // One contiguous run: chunks of it.
            let run = src(0, rows * width);
            dst.par_chunks_mut(WIDEN_CHUNK)
                .enumerate()
                .for_each(|(i, d)| self.widen_into(run.start + i * WIDEN_CHUNK, d));
        } else {
            dst.par_chunks_mut(width)
                .enumerate()
                .with_min_len(WIDEN_CHUNK.div_ceil(width))
                .for_each(|(r, d)| self.widen_into(src(r, 0).start, d));
        }
        // SAFETY: every element of the first `rows·width` was written above.
        unsafe { out.set_len(rows * width) };
        out
    }

    /// `dst[i]` = stored value `at + i` rounded to bf16 and widened to f32.
    fn widen_into(&self, at: usize, dst: &mut [MaybeUninit<f32>]) {
        match self {
            Operand::F32(v) | Operand::Rounded(v) => round_span(&v[at..at + dst.len()], dst),
            Operand::Bf16(v) => widen_span(&v[at..at + dst.len()], dst),
        }
    }
}

/// Rounds `x` to bf16 values in place (nearest, ties to even; NaN stays NaN), vectorized
/// over the current rayon pool: a product's operand rounded once, then passed as
/// [`Operand::Rounded`] to several bf16 GEMMs.
pub fn round_to_bf16_in_place(x: &mut [f32]) {
    x.par_chunks_mut(WIDEN_CHUNK).for_each(round_in_place_span);
}

/// A rounded copy of `x` (see [`round_to_bf16_in_place`]), for [`Operand::Rounded`].
pub fn rounded_to_bf16(x: &[f32]) -> Vec<f32> {
    Operand::F32(x).rounded_f32(0, 1, x.len(), 0)
}

crate::multiversion! {
    fn round_in_place_span(x: &mut [f32]) {
        for v in x.iter_mut() {
            *v = round_bf16_f32(*v);
        }
    }
}

/// Elements one task of [`Operand::rounded_f32`] converts at least (64 KiB of f32).
const WIDEN_CHUNK: usize = 1 << 14;

/// `x` rounded to the nearest bf16 (ties to even; NaN stays NaN, quieted) as an f32: the bits
/// of [`crate::round_to_bf16_bits`] in the upper half, branch-free so that loops vectorize.
#[inline(always)]
fn round_bf16_f32(x: f32) -> f32 {
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1));
    let quiet = bits | 0x0040_0000;
    let nan = (bits & 0x7fff_ffff) > 0x7f80_0000;
    f32::from_bits(if nan { quiet } else { rounded } & 0xffff_0000)
}

crate::multiversion! {
    fn round_span(src: &[f32], dst: &mut [MaybeUninit<f32>]) {
        for (d, &x) in dst.iter_mut().zip(src) {
            d.write(round_bf16_f32(x));
        }
    }
}

/// `dst[i] = src[i]` widened to f32 (exactly), vectorized, on the calling thread.
///
/// # Panics
/// When the lengths differ.
pub(crate) fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    // SAFETY: `MaybeUninit<f32>` has f32's layout, and `widen_span` only writes initialized
    // values through the view.
    let dst = unsafe { &mut *(dst as *mut [f32] as *mut [MaybeUninit<f32>]) };
    widen_span(src, dst);
}

crate::multiversion! {
    fn widen_span(src: &[bf16], dst: &mut [MaybeUninit<f32>]) {
        for (d, x) in dst.iter_mut().zip(src) {
            d.write(f32::from_bits(u32::from(x.to_bits()) << 16));
        }
    }
}

/// Rounds `x` to bf16 values in place and returns them as bf16 as well, in one vectorized
/// pass over the current rayon pool (an activation the forward goes on computing with and
/// keeps in bf16 for the backward).
pub fn narrow_to_bf16_in_place(x: &mut [f32]) -> Vec<bf16> {
    let mut out = Vec::with_capacity(x.len());
    out.spare_capacity_mut()[..x.len()]
        .par_chunks_mut(WIDEN_CHUNK)
        .zip(x.par_chunks_mut(WIDEN_CHUNK))
        .for_each(|(o, v)| narrow_span(v, o));
    // SAFETY: every element of the first `x.len()` was written above.
    unsafe { out.set_len(x.len()) };
    out
}

crate::multiversion! {
    fn narrow_span(x: &mut [f32], out: &mut [MaybeUninit<bf16>]) {
        for (o, v) in out.iter_mut().zip(x.iter_mut()) {
            let r = round_bf16_f32(*v);
            *v = r;
            o.write(bf16::from_bits((r.to_bits() >> 16) as u16));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The widened path's conversion equals the scalar rounding bit for bit (ties, NaN, infinities,
    /// denormals, the largest finite values), contiguous over several tasks and as a strided block
    /// of columns, from f32 and from bf16.
    #[test]
    fn widening_rounds_as_the_scalar_conversion() {
        let special = [
            0.0,
            -0.0,
            1.0 + 1.0 / 256.0, // a tie: rounds to even (1.0)
            1.0 + 3.0 / 256.0, // a tie: rounds to even (up)
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x7f80_0001), // signalling NaN: quieted, stays NaN
            f32::MAX,                    // rounds to infinity
            f32::MIN_POSITIVE / 3.0,     // denormal
        ];
        let mut values: Vec<f32> = (0..3 * WIDEN_CHUNK + 77)
            .map(|i| {
                ((i as u32).wrapping_mul(2_654_435_761) >> 8) as f32 / (1u32 << 20) as f32 - 8.0
            })
            .collect();
        values[..special.len()].copy_from_slice(&special);
        let want = |x: f32| (crate::round_to_bf16_bits(x) as u32) << 16;
        let got = Operand::F32(&values).rounded_f32(0, 1, values.len(), 0);
        for (g, &x) in got.iter().zip(&values) {
            assert_eq!(g.to_bits(), want(x), "{x:e}");
        }
        // Columns 5..5+70 of a [rows, 300] matrix.
        let (rows, cols, width, start) = (values.len() / 300, 300, 70, 5);
        let block = Operand::F32(&values).rounded_f32(start, rows, width, cols);
        let as_bf16: Vec<bf16> = values.iter().map(|&x| bf16::from_f32(x)).collect();
        let block_bf16 = Operand::Bf16(&as_bf16).rounded_f32(start, rows, width, cols);
        for r in 0..rows {
            for c in 0..width {
                let x = values[start + r * cols + c];
                assert_eq!(
                    block[r * width + c].to_bits(),
                    want(x),
                    "row {r} col {c}: {x:e}"
                );
                let b = block_bf16[r * width + c];
                assert!(
                    b.to_bits() == want(x) || (b.is_nan() && x.is_nan()),
                    "{x:e}"
                );
            }
        }
    }

    /// Narrowing rounds in place and keeps the same values as bf16.
    #[test]
    fn narrowing_rounds_in_place_and_keeps_bf16() {
        let mut x: Vec<f32> = (0..WIDEN_CHUNK + 5)
            .map(|i| i as f32 * 1.001e-3 - 3.0)
            .collect();
        x[0] = f32::NAN;
        let before = x.clone();
        let narrow = narrow_to_bf16_in_place(&mut x);
        for ((v, b), orig) in x.iter().zip(&narrow).zip(&before) {
            let want = crate::round_to_bf16_bits(*orig);
            assert_eq!(b.to_bits(), want, "{orig:e}");
            assert_eq!(v.to_bits(), u32::from(want) << 16, "{orig:e}");
        }
    }
}
