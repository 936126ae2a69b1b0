//! bf16 versions of the register-tiled products of [`super::tile`], for attention with bf16
//! inputs and f32 accumulation (as PyTorch's CPU flash attention runs in bf16): AVX512-BF16
//! `vdpbf16ps` multiplies pairs of bf16 and adds both products to f32 lanes, so the reduction
//! dimension is consumed two at a time and operands are laid out in pairs ("VNNI" order, as
//! the B panels of [`crate::gemm_bf16::pack`]).
//!
//! Layouts (all bf16 as `u16` bits):
//! - **pair rows** `[n/2][w][2]`: element `(i, c)` of an `n × w` matrix at
//!   `(i/2)·2w + 2c + i%2` — the pairs `(i, i+1)` of every column side by side. [`pair_rows`]
//!   builds it (odd `n`: the last pair's second half is zero).
//! - a **coefficient pair** is `(x_i, x_{i+1})` as one `u32` (`x_i` in the low half).

use crate::round_to_bf16_bits;

/// Whether this CPU runs the kernels of this module (AVX512F + AVX512-BF16).
pub fn bf16_tiles_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Columns of one tile: four 16-lane vectors.
pub const TILE_W: usize = 64;
/// Rows of one tile.
pub const TILE_R: usize = 4;

/// The pair-row layout of the `n × w` matrix whose row `i` is `row(i)` (f32 values rounded to
/// bf16): `dst` (resized to `n.div_ceil(2)·2w`) as described in the module docs.
pub fn pair_rows<'a>(n: usize, w: usize, row: impl Fn(usize) -> &'a [f32], dst: &mut Vec<u16>) {
    dst.clear();
    dst.resize(n.div_ceil(2) * 2 * w, 0);
    for i in 0..n {
        let base = (i / 2) * 2 * w + i % 2;
        for (c, &x) in row(i)[..w].iter().enumerate() {
            dst[base + 2 * c] = round_to_bf16_bits(x);
        }
    }
}

/// `(x0, x1)` rounded to bf16 as one coefficient pair.
#[inline(always)]
pub fn coef_pair(x0: f32, x1: f32) -> u32 {
    u32::from(round_to_bf16_bits(x0)) | (u32::from(round_to_bf16_bits(x1)) << 16)
}

/// `acc[r][l] = Σ_{c < d} x[r][c] · t(c, l)` for `r <` [`TILE_R`], `l <` [`TILE_W`]: the rows
/// `x[r]` (bf16 bits, at least `d` long, `d` even) against 64 columns of a pair-row matrix
/// `t` whose pair-row `c/2` starts at `t[(c/2)·ld2]` (`ld2 = 2·` its width), products summed in
/// f32.
///
/// # Panics
/// When [`bf16_tiles_available`] is false, `d` is odd, or a slice is too short.
pub fn dots_bf16(x: [&[u16]; TILE_R], t: &[u16], ld2: usize, d: usize) -> [[f32; TILE_W]; TILE_R] {
    assert!(bf16_tiles_available() && d.is_multiple_of(2));
    assert!(x.iter().all(|r| r.len() >= d));
    assert!(d == 0 || t.len() >= (d / 2 - 1) * ld2 + 2 * TILE_W);
    let mut acc = [[0f32; TILE_W]; TILE_R];
    #[cfg(target_arch = "x86_64")]
    // SAFETY: features checked; every read is inside the slices (asserted above).
    unsafe {
        x86::dots(&x, t, ld2, d, &mut acc)
    };
    acc
}

/// Where the coefficient pairs of a [`rows_product_bf16`] lie: pair `p` of tile row `r` is
/// `data[row[r] + p·stride]` (stride 1: each row's pairs contiguous; stride `w`: a
/// `[pairs][w]` matrix whose columns are the tile rows).
#[derive(Clone, Copy, Debug)]
pub struct Coefs<'a> {
    pub data: &'a [u32],
    pub row: [usize; TILE_R],
    pub stride: usize,
}

/// `out[r·d + c] = Σ_{p < pairs} coef(r, p) · (rows pair-row p)(c)` for `r <` [`TILE_R`],
/// `c < d`: coefficient pairs (see the module docs, laid out as [`Coefs`] says) times a
/// pair-row matrix `rows` (`[pairs][d][2]`), summed in f32; `d` a multiple of 16. `out` is
/// `[TILE_R, d]`, overwritten.
///
/// # Panics
/// When [`bf16_tiles_available`] is false, `d` is not a multiple of 16, or a slice is too
/// short.
pub fn rows_product_bf16(coef: Coefs<'_>, pairs: usize, rows: &[u16], d: usize, out: &mut [f32]) {
    assert!(bf16_tiles_available() && d.is_multiple_of(16));
    let last = pairs.saturating_sub(1) * coef.stride;
    assert!(pairs == 0 || coef.row.iter().all(|&r| r + last < coef.data.len()));
    assert!(rows.len() >= pairs * 2 * d && out.len() >= TILE_R * d);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: features checked; every access is inside the slices (asserted above).
    unsafe {
        x86::rows_product(coef, pairs, rows, d, out)
    };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Coefs, TILE_R, TILE_W};
    use std::arch::x86_64::*;

    #[inline(always)]
    fn bh(v: __m512i) -> __m512bh {
        // SAFETY: same size; bf16 vectors are plain bits.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
    }

    /// See [`super::dots_bf16`].
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn dots(
        x: &[&[u16]; TILE_R],
        t: &[u16],
        ld2: usize,
        d: usize,
        out: &mut [[f32; TILE_W]; TILE_R],
    ) {
        let mut acc = [[_mm512_setzero_ps(); 4]; TILE_R];
        for cp in 0..d / 2 {
            // SAFETY: pair-row cp holds 2·TILE_W values; x rows hold d (caller).
            unsafe {
                let tp = t.as_ptr().add(cp * ld2);
                let b: [__m512bh; 4] =
                    std::array::from_fn(|v| bh(_mm512_loadu_si512(tp.add(32 * v).cast())));
                for (r, row) in acc.iter_mut().enumerate() {
                    let pair = x[r].as_ptr().add(2 * cp).cast::<i32>().read_unaligned();
                    let a = bh(_mm512_set1_epi32(pair));
                    for (v, acc) in row.iter_mut().enumerate() {
                        *acc = _mm512_dpbf16_ps(*acc, a, b[v]);
                    }
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (v, acc) in row.iter().enumerate() {
                // SAFETY: 16 lanes inside the 64-wide output row.
                unsafe { _mm512_storeu_ps(out[r].as_mut_ptr().add(16 * v), *acc) };
            }
        }
    }

    /// See [`super::rows_product_bf16`].
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn rows_product(
        coef: Coefs<'_>,
        pairs: usize,
        rows: &[u16],
        d: usize,
        out: &mut [f32],
    ) {
        let mut c0 = 0;
        while c0 < d {
            // SAFETY: forwarded (caller); columns c0.. lie inside d.
            unsafe {
                match (d - c0) / 16 {
                    1 => columns::<1>(coef, pairs, rows, d, c0, out),
                    2 => columns::<2>(coef, pairs, rows, d, c0, out),
                    3 => columns::<3>(coef, pairs, rows, d, c0, out),
                    _ => columns::<4>(coef, pairs, rows, d, c0, out),
                }
            }
            c0 += 16 * ((d - c0) / 16).min(4);
        }
    }

    /// Columns `c0 .. c0 + 16·V` of [`rows_product`].
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn columns<const V: usize>(
        coef: Coefs<'_>,
        pairs: usize,
        rows: &[u16],
        d: usize,
        c0: usize,
        out: &mut [f32],
    ) {
        let mut acc = [[_mm512_setzero_ps(); V]; TILE_R];
        for p in 0..pairs {
            // SAFETY: pair-row p holds 2·d values; c0 + 16·V <= d (caller).
            unsafe {
                let rp = rows.as_ptr().add(p * 2 * d + 2 * c0);
                let b: [__m512bh; V] =
                    std::array::from_fn(|v| bh(_mm512_loadu_si512(rp.add(32 * v).cast())));
                for (r, row) in acc.iter_mut().enumerate() {
                    let at = coef.row[r] + p * coef.stride;
                    let a = bh(_mm512_set1_epi32(*coef.data.get_unchecked(at) as i32));
                    for (v, acc) in row.iter_mut().enumerate() {
                        *acc = _mm512_dpbf16_ps(*acc, a, b[v]);
                    }
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (v, acc) in row.iter().enumerate() {
                // SAFETY: inside row r of out (caller).
                unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(r * d + c0 + 16 * v), *acc) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wide(bits: u16) -> f64 {
        f64::from(f32::from_bits(u32::from(bits) << 16))
    }

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919 + seed * 104_729) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    #[test]
    fn dots_are_the_rounded_products() {
        if !bf16_tiles_available() {
            eprintln!("no AVX512-BF16 on this CPU: nothing to check");
            return;
        }
        let (d, width) = (40, 96); // t is [d, 96]: the tile reads its columns 32..96
        let xs: Vec<Vec<u16>> = (0..TILE_R)
            .map(|r| {
                values(d, r)
                    .iter()
                    .map(|&v| round_to_bf16_bits(v))
                    .collect()
            })
            .collect();
        let t = values(d * width, 9);
        let mut packed = Vec::new();
        pair_rows(d, width, |c| &t[c * width..], &mut packed);
        let got = dots_bf16(
            std::array::from_fn(|r| &xs[r][..]),
            &packed[2 * 32..],
            2 * width,
            d,
        );
        for r in 0..TILE_R {
            for l in 0..TILE_W {
                let want: f64 = (0..d)
                    .map(|c| wide(xs[r][c]) * wide(round_to_bf16_bits(t[c * width + 32 + l])))
                    .sum();
                assert!((f64::from(got[r][l]) - want).abs() < 1e-5, "({r}, {l})");
            }
        }
    }

    #[test]
    fn rows_products_are_the_rounded_products() {
        if !bf16_tiles_available() {
            eprintln!("no AVX512-BF16 on this CPU: nothing to check");
            return;
        }
        for (n, d) in [(7, 16), (10, 48), (5, 80), (9, 128)] {
            let rows = values(n * d, 3);
            let coefs: Vec<Vec<f32>> = (0..TILE_R).map(|r| values(n, 20 + r)).collect();
            let mut packed = Vec::new();
            pair_rows(n, d, |i| &rows[i * d..], &mut packed);
            let pairs: Vec<Vec<u32>> = coefs
                .iter()
                .map(|c| {
                    (0..n.div_ceil(2))
                        .map(|p| coef_pair(c[2 * p], c.get(2 * p + 1).copied().unwrap_or(0.0)))
                        .collect()
                })
                .collect();
            let mut out = vec![f32::NAN; TILE_R * d];
            let count = n.div_ceil(2);
            let flat: Vec<u32> = pairs.concat();
            // Row-major (stride 1) and the same pairs as a [count][TILE_R] matrix (stride 4).
            let by_row = Coefs {
                data: &flat,
                row: std::array::from_fn(|r| r * count),
                stride: 1,
            };
            let by_col: Vec<u32> = (0..count * TILE_R)
                .map(|i| pairs[i % TILE_R][i / TILE_R])
                .collect();
            let by_col = Coefs {
                data: &by_col,
                row: std::array::from_fn(|r| r),
                stride: TILE_R,
            };
            let mut again = vec![f32::NAN; TILE_R * d];
            rows_product_bf16(by_row, count, &packed, d, &mut out);
            rows_product_bf16(by_col, count, &packed, d, &mut again);
            assert_eq!(out, again);
            for r in 0..TILE_R {
                for c in 0..d {
                    let want: f64 = (0..n)
                        .map(|i| {
                            wide(round_to_bf16_bits(coefs[r][i]))
                                * wide(round_to_bf16_bits(rows[i * d + c]))
                        })
                        .sum();
                    let got = f64::from(out[r * d + c]);
                    assert!((got - want).abs() < 1e-5, "n {n} d {d} ({r}, {c})");
                }
            }
        }
    }
}
