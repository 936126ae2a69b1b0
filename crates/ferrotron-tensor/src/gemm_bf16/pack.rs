//! Packing GEMM operands into the bf16 panels the dot-product kernels read, rounding f32
//! values to the nearest bf16 on the way (ties to even, as PyTorch autocast's cast).
//!
//! Both kernels (AMX and AVX512-BF16) read the same two layouts, zero-padded so no kernel
//! needs an edge case:
//! - **A panel**: [`MR`] rows × `kc` columns of `op(a)`, row-major (`[MR][kc]`), `kc` a
//!   multiple of [`K_ALIGN`]. An AMX A tile is 16 of its rows × 32 columns; the AVX512
//!   kernel broadcasts one row's `(k, k+1)` pair as a 32-bit lane.
//! - **B panel**: `kc` rows × [`NR`] columns of `op(b)` in "VNNI" pair order
//!   (`[kc/2][NR][2]`): element `(p, j)` at `(p/2)·2·NR + 2j + p%2`. An AMX B tile is
//!   16 pair-rows × 16 columns of it (row stride `2·NR` elements); the AVX512 kernel loads
//!   16 columns' pairs as one vector.

use super::Operand;
use crate::gemm::Op;
use crate::round_to_bf16_bits;
use half::bf16;

/// Rows of an A panel (two AMX tiles high).
pub const MR: usize = 32;
/// Columns of a B panel (two AMX tiles wide).
pub const NR: usize = 32;
/// `kc` is padded to a multiple of this (one AMX tile's depth: 32 bf16 = 64 bytes).
pub const K_ALIGN: usize = 32;

/// One operand element as bf16 bits.
trait ToBits: Copy {
    fn bits(self) -> u16;
}

impl ToBits for f32 {
    #[inline(always)]
    fn bits(self) -> u16 {
        round_to_bf16_bits(self)
    }
}

impl ToBits for bf16 {
    #[inline(always)]
    fn bits(self) -> u16 {
        self.to_bits()
    }
}

/// A row-major stored matrix read as `op(stored)`: element `(r, c)` of the logical matrix is
/// at `r·rs + c·cs`.
#[derive(Clone, Copy)]
struct View<'a, T> {
    data: &'a [T],
    rs: usize,
    cs: usize,
}

impl<T: ToBits> View<'_, T> {
    #[inline(always)]
    fn get(&self, r: usize, c: usize) -> u16 {
        self.data[r * self.rs + c * self.cs].bits()
    }
}

/// The logical `rows × cols` matrix `op(stored)` as a view: `Op::N` reads a row-major
/// `[rows, cols]`, `Op::T` a row-major `[cols, rows]`.
fn view<T>(data: &[T], op: Op, rows: usize, cols: usize) -> View<'_, T> {
    match op {
        Op::N => View {
            data,
            rs: cols,
            cs: 1,
        },
        Op::T => View {
            data,
            rs: 1,
            cs: rows,
        },
    }
}

/// Packs rows `rows` × columns `cols` of the logical `[m, k]` operand `op(a)` into A panels:
/// `dst` holds `ceil(rows.len() / MR)` panels of `MR × kcp` elements (`kcp` = `cols.len()`
/// rounded up to [`K_ALIGN`]), zero where outside the matrix.
///
/// # Panics
/// When `dst` is shorter than the panels need (a caller bug).
pub fn pack_a(
    a: Operand<'_>,
    op: Op,
    (m, k): (usize, usize),
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    kcp: usize,
    dst: &mut [u16],
) {
    #[cfg(target_arch = "x86_64")]
    if super::pack_x86::available() {
        // SAFETY: the AVX-512 packers are available (checked); they assert dst's size.
        unsafe {
            match a {
                Operand::F32(d) | Operand::Rounded(d) => {
                    super::pack_x86::pack_a(d, op, (m, k), rows, cols, kcp, dst)
                }
                Operand::Bf16(d) => super::pack_x86::pack_a(d, op, (m, k), rows, cols, kcp, dst),
            }
        }
        return;
    }
    pack_a_scalar(a, op, (m, k), rows, cols, kcp, dst);
}

/// [`pack_a`] one element at a time (the reference the vector packers are tested against, and
/// the packer on CPUs without AVX512BW).
pub fn pack_a_scalar(
    a: Operand<'_>,
    op: Op,
    (m, k): (usize, usize),
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    kcp: usize,
    dst: &mut [u16],
) {
    match a {
        Operand::F32(d) | Operand::Rounded(d) => {
            pack_a_view(view(d, op, m, k), rows, cols, kcp, dst)
        }
        Operand::Bf16(d) => pack_a_view(view(d, op, m, k), rows, cols, kcp, dst),
    }
}

fn pack_a_view<T: ToBits>(
    v: View<'_, T>,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    kcp: usize,
    dst: &mut [u16],
) {
    let panels = rows.len().div_ceil(MR);
    let dst = &mut dst[..panels * MR * kcp];
    dst.fill(0);
    for (i, r) in rows.enumerate() {
        let row = &mut dst[i * kcp..i * kcp + cols.len()];
        for (d, c) in row.iter_mut().zip(cols.clone()) {
            *d = v.get(r, c);
        }
    }
}

/// Packs rows `rows` (the reduction dimension) × columns `cols` of the logical `[k, n]`
/// operand `op(b)` into B panels: `dst` holds `ceil(cols.len() / NR)` panels of `kcp × NR`
/// elements in pair order, zero where outside the matrix.
///
/// # Panics
/// When `dst` is shorter than the panels need (a caller bug).
pub fn pack_b(
    b: Operand<'_>,
    op: Op,
    (k, n): (usize, usize),
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    kcp: usize,
    dst: &mut [u16],
) {
    #[cfg(target_arch = "x86_64")]
    if super::pack_x86::available() {
        // SAFETY: the AVX-512 packers are available (checked); they assert dst's size.
        unsafe {
            match b {
                Operand::F32(d) | Operand::Rounded(d) => {
                    super::pack_x86::pack_b(d, op, (k, n), rows, cols, kcp, dst)
                }
                Operand::Bf16(d) => super::pack_x86::pack_b(d, op, (k, n), rows, cols, kcp, dst),
            }
        }
        return;
    }
    pack_b_scalar(b, op, (k, n), rows, cols, kcp, dst);
}

/// [`pack_b`] one element at a time (the reference the vector packers are tested against, and
/// the packer on CPUs without AVX512BW).
pub fn pack_b_scalar(
    b: Operand<'_>,
    op: Op,
    (k, n): (usize, usize),
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    kcp: usize,
    dst: &mut [u16],
) {
    match b {
        Operand::F32(d) | Operand::Rounded(d) => {
            pack_b_view(view(d, op, k, n), rows, cols, kcp, dst)
        }
        Operand::Bf16(d) => pack_b_view(view(d, op, k, n), rows, cols, kcp, dst),
    }
}

fn pack_b_view<T: ToBits>(
    v: View<'_, T>,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    kcp: usize,
    dst: &mut [u16],
) {
    let panels = cols.len().div_ceil(NR);
    let dst = &mut dst[..panels * NR * kcp];
    dst.fill(0);
    // Walk the stored matrix along its contiguous dimension.
    if v.cs == 1 {
        for (p, r) in rows.enumerate() {
            for (j, c) in cols.clone().enumerate() {
                dst[b_index(p, j, kcp)] = v.get(r, c);
            }
        }
    } else {
        for (j, c) in cols.enumerate() {
            for (p, r) in rows.clone().enumerate() {
                dst[b_index(p, j, kcp)] = v.get(r, c);
            }
        }
    }
}

/// Where element `(p, j)` of a packed B block (`j` counted over all its panels) lies.
#[inline(always)]
fn b_index(p: usize, j: usize, kcp: usize) -> usize {
    (j / NR) * NR * kcp + (p / 2) * 2 * NR + 2 * (j % NR) + p % 2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_matches_half() {
        let mut x = 0x1234_5678u32;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let v = f32::from_bits(x);
            if v.is_nan() {
                assert!(f32::from(bf16::from_bits(round_to_bf16_bits(v))).is_nan());
            } else {
                assert_eq!(round_to_bf16_bits(v), bf16::from_f32(v).to_bits(), "{v:e}");
            }
        }
        for v in [
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            1.0 + 1.0 / 256.0,
        ] {
            assert_eq!(round_to_bf16_bits(v), bf16::from_f32(v).to_bits(), "{v:e}");
        }
    }

    #[test]
    fn panels_hold_each_element_once_and_zeros_elsewhere() {
        let (k, n) = (37, 45);
        let stored: Vec<f32> = (0..k * n).map(|i| i as f32).collect();
        for op in [Op::N, Op::T] {
            let (rows, cols) = (3..37, 5..45);
            let kcp = 64;
            let mut dst = vec![7u16; 2 * NR * kcp];
            pack_b(
                Operand::F32(&stored),
                op,
                (k, n),
                rows.clone(),
                cols.clone(),
                kcp,
                &mut dst,
            );
            let v = view(&stored, op, k, n);
            for p in 0..kcp {
                for j in 0..2 * NR {
                    let want = if p < rows.len() && j < cols.len() {
                        v.get(rows.start + p, cols.start + j)
                    } else {
                        0
                    };
                    assert_eq!(dst[b_index(p, j, kcp)], want, "{op:?} ({p}, {j})");
                }
            }
            let mut dst = vec![7u16; 2 * MR * kcp];
            let (m, kk) = (k, n);
            pack_a(
                Operand::F32(&stored),
                op,
                (m, kk),
                rows.clone(),
                cols.clone(),
                kcp,
                &mut dst,
            );
            let v = view(&stored, op, m, kk);
            for i in 0..2 * MR {
                for p in 0..kcp {
                    let want = if i < rows.len() && p < cols.len() {
                        v.get(rows.start + i, cols.start + p)
                    } else {
                        0
                    };
                    assert_eq!(dst[i * kcp + p], want, "{op:?} ({i}, {p})");
                }
            }
        }
    }

    /// The packers every GEMM uses (vector ones where the CPU has them) write exactly what the
    /// element-by-element reference writes: every transpose, f32 and bf16, edge panels, special
    /// values (ties, denormals, NaN, infinities); garbage in `dst` beforehand.
    #[test]
    fn packers_match_the_scalar_reference() {
        let (d0, d1) = (45, 70);
        let specials = [
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1.0e-40,
            -3.0e-39,
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            -0.0,
        ];
        let stored: Vec<f32> = (0..d0 * d1)
            .map(|i| match specials.get(i % 37) {
                Some(&v) => v,
                None => ((i as u32).wrapping_mul(2_654_435_761) >> 9) as f32 / 1e6 - 3.0,
            })
            .collect();
        let stored_bf16: Vec<bf16> = stored.iter().map(|&v| bf16::from_f32(v)).collect();
        let operands = [Operand::F32(&stored), Operand::Bf16(&stored_bf16)];
        let cases = [(0..45, 0..70, 96), (3..40, 5..67, 64), (10..11, 33..34, 32)];
        for op in [Op::N, Op::T] {
            for operand in operands {
                for (rows, cols, kcp) in cases.clone() {
                    let (rows, cols) = match op {
                        Op::N => (rows, cols),
                        Op::T => (cols, rows),
                    };
                    let a_len = rows.len().next_multiple_of(MR)
                        * cols.len().next_multiple_of(K_ALIGN).max(kcp);
                    let (mut fast, mut slow) = (vec![0xabcdu16; a_len], vec![0x1234u16; a_len]);
                    let dims = match op {
                        Op::N => (d0, d1),
                        Op::T => (d1, d0),
                    };
                    if cols.len() <= kcp {
                        pack_a(
                            operand,
                            op,
                            dims,
                            rows.clone(),
                            cols.clone(),
                            kcp,
                            &mut fast,
                        );
                        pack_a_scalar(
                            operand,
                            op,
                            dims,
                            rows.clone(),
                            cols.clone(),
                            kcp,
                            &mut slow,
                        );
                        assert_eq!(fast, slow, "A {op:?} {rows:?} {cols:?}");
                    }
                    // B: `rows` is the depth, `cols` the columns.
                    if rows.len() <= kcp {
                        let b_len = cols.len().next_multiple_of(NR) * kcp;
                        let (mut fast, mut slow) = (vec![0xabcdu16; b_len], vec![0x1234u16; b_len]);
                        pack_b(
                            operand,
                            op,
                            dims,
                            rows.clone(),
                            cols.clone(),
                            kcp,
                            &mut fast,
                        );
                        pack_b_scalar(
                            operand,
                            op,
                            dims,
                            rows.clone(),
                            cols.clone(),
                            kcp,
                            &mut slow,
                        );
                        assert_eq!(fast, slow, "B {op:?} {rows:?} {cols:?}");
                    }
                }
            }
        }
    }
}
