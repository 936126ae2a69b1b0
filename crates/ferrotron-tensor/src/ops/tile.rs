//! Register-tiled small products for fused kernels (attention forward and backward), the inner
//! loop of a GEMM written so that it inlines into a [`multiversion!`](crate::multiversion)
//! kernel and vectorizes there.

/// `acc[r][l] += Σ_{k < n} a(r, k) · b(k)[l]` for `r < R`, `l < W`: a rank-`n` update of an
/// `R × W` tile held in registers (with `R·W/16` AVX-512 accumulators; `R = 4, W = 64` uses 16
/// of the 32 registers). Each `b(k)` row (at least `W` long) is loaded once and reused for the
/// `R` rows, so the loop is bound by FMAs rather than by loads.
///
/// Every element is accumulated over `k` in increasing order with exactly rounded
/// `mul_add`, so results do not depend on how callers tile the rows and columns.
#[inline(always)]
pub fn tile_update<'a, const R: usize, const W: usize>(
    acc: &mut [[f32; W]; R],
    n: usize,
    a: impl Fn(usize, usize) -> f32,
    b: impl Fn(usize) -> &'a [f32],
) {
    let mut t = *acc;
    for k in 0..n {
        // Loaded once into registers for the R rows (else the FMAs each reload it).
        let bk: [f32; W] = b(k)[..W].try_into().unwrap();
        for (r, tr) in t.iter_mut().enumerate() {
            let ar = a(r, k);
            for l in 0..W {
                tr[l] = ar.mul_add(bk[l], tr[l]);
            }
        }
    }
    *acc = t;
}

/// `R × d` product `Σ_{i<n} coef(r, i) · row(i)[..d]` in column tiles of 64, 16 and 1 (each a
/// [`tile_update`] from zero), handed to `emit(r, c0, values)` for columns `c0..c0 + values.len()`.
/// The `row(i)` slices must be at least `d` long.
#[inline(always)]
pub fn tile_rows_product<'a, const R: usize>(
    d: usize,
    n: usize,
    coef: impl Fn(usize, usize) -> f32,
    row: impl Fn(usize) -> &'a [f32],
    mut emit: impl FnMut(usize, usize, &[f32]),
) {
    #[inline(always)]
    fn cols<'a, const R: usize, const W: usize>(
        c0: &mut usize,
        (d, n): (usize, usize),
        coef: &impl Fn(usize, usize) -> f32,
        row: &impl Fn(usize) -> &'a [f32],
        emit: &mut impl FnMut(usize, usize, &[f32]),
    ) {
        while *c0 + W <= d {
            let mut acc = [[0f32; W]; R];
            let c = *c0;
            tile_update(&mut acc, n, coef, |i| &row(i)[c..]);
            for (r, a) in acc.iter().enumerate() {
                emit(r, c, a);
            }
            *c0 += W;
        }
    }
    let mut c0 = 0;
    cols::<R, 64>(&mut c0, (d, n), &coef, &row, &mut emit);
    cols::<R, 16>(&mut c0, (d, n), &coef, &row, &mut emit);
    cols::<R, 1>(&mut c0, (d, n), &coef, &row, &mut emit);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tile_update_is_a_small_gemm() {
        let (n, r, w) = (5, 3, 16);
        let a: Vec<f32> = (0..r * n).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b: Vec<f32> = (0..n * w).map(|i| (i % 7) as f32 - 2.0).collect();
        let mut acc = [[1f32; 16]; 3];
        tile_update(&mut acc, n, |i, k| a[i * n + k], |k| &b[k * w..]);
        for i in 0..r {
            for l in 0..w {
                let want: f32 = 1.0 + (0..n).map(|k| a[i * n + k] * b[k * w + l]).sum::<f32>();
                assert_eq!(acc[i][l], want);
            }
        }
    }

    #[test]
    fn rows_product_covers_every_column_tile() {
        let (d, n) = (85, 3); // 64 + 16 + 5 columns
        let rows: Vec<f32> = (0..n * d).map(|i| (i % 11) as f32 - 5.0).collect();
        let mut out = vec![f32::NAN; 2 * d];
        let coef = |r: usize, i: usize| (r * n + i) as f32 + 1.0;
        tile_rows_product::<2>(
            d,
            n,
            coef,
            |i| &rows[i * d..],
            |r, c0, v| out[r * d + c0..][..v.len()].copy_from_slice(v),
        );
        for r in 0..2 {
            for c in 0..d {
                let want: f32 = (0..n).map(|i| coef(r, i) * rows[i * d + c]).sum();
                assert_eq!(out[r * d + c], want);
            }
        }
    }
}
