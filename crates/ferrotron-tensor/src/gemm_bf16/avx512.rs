//! The AVX512-BF16 block kernel (Zen 4, Zen 5, Cooper Lake, Sapphire Rapids without AMX):
//! `vdpbf16ps` multiplies 16 pairs of bf16 and adds both products to 16 f32 lanes (Intel SDM
//! vol. 2, "VDPBF16PS"). A `32 × 32` block of C is computed as four `8 × 32` register blocks:
//! 16 accumulators, two B vectors (16 columns' `(k, k+1)` pairs each) and one broadcast A
//! pair per row and pair-step.

use super::pack::{MR, NR};
use std::arch::x86_64::*;

/// Whether this CPU has AVX512F and AVX512-BF16.
pub fn available() -> bool {
    is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")
}

/// Rows of one register block.
const ROWS: usize = 8;

/// `c[32 × 32]` (row stride `ldc` f32) `= (load_c ? c : 0) + A · B` over `kcp` (a multiple of
/// 2) from one A panel (`[MR][kcp]`) and one B panel (`[kcp/2][NR][2]`).
///
/// # Safety
/// [`available`] is true; `a`, `b` address whole panels of depth `kcp`; `c` addresses 32 rows
/// of 32 f32 with row stride `ldc`.
#[target_feature(enable = "avx512f,avx512bf16")]
pub unsafe fn block(
    a: *const u16,
    b: *const u16,
    kcp: usize,
    c: *mut f32,
    ldc: usize,
    load_c: bool,
) {
    debug_assert!(MR.is_multiple_of(ROWS) && NR == 32);
    for r0 in (0..MR).step_by(ROWS) {
        // SAFETY: rows r0..r0+ROWS lie inside the panel and the C block (caller).
        unsafe { rows_block(a.add(r0 * kcp), b, kcp, c.add(r0 * ldc), ldc, load_c) };
    }
}

#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn rows_block(
    a: *const u16,
    b: *const u16,
    kcp: usize,
    c: *mut f32,
    ldc: usize,
    load_c: bool,
) {
    let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
    if load_c {
        for (i, row) in acc.iter_mut().enumerate() {
            // SAFETY: inside the C block (caller).
            unsafe {
                row[0] = _mm512_loadu_ps(c.add(i * ldc));
                row[1] = _mm512_loadu_ps(c.add(i * ldc + 16));
            }
        }
    }
    for p in 0..kcp / 2 {
        // SAFETY: pair-row p of the B panel and pair p of each A row lie inside the panels.
        unsafe {
            let bp = b.add(p * 2 * NR);
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp.cast()));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp.add(32).cast()));
            for (i, row) in acc.iter_mut().enumerate() {
                let pair = a.add(i * kcp + 2 * p).cast::<i32>().read_unaligned();
                let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
                row[0] = _mm512_dpbf16_ps(row[0], av, b0);
                row[1] = _mm512_dpbf16_ps(row[1], av, b1);
            }
        }
    }
    for (i, row) in acc.iter().enumerate() {
        // SAFETY: inside the C block (caller).
        unsafe {
            _mm512_storeu_ps(c.add(i * ldc), row[0]);
            _mm512_storeu_ps(c.add(i * ldc + 16), row[1]);
        }
    }
}
