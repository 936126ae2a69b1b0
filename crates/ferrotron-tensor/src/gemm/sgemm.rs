//! The f32 GEMM: the `gemm` crate's kernels (its `x86-v4` AVX-512 ones selected at run time),
//! spread over the current rayon pool as one single-threaded product per thread, each on its
//! own block of the output's longer side.
//!
//! Why not the crate's own `Parallelism::Rayon`: on SmolLM2's shapes at 512 tokens it scales
//! poorly where the output is narrow and the reduction deep (the forward of `linear_fc2`,
//! `[512, 576]` from `k = 1536`: 183-232 GF/s on 2 threads against 137-148 on one), while
//! two independent halves run at the single-thread rate each (265-281 GF/s), and no shape
//! measured slower (`cargo bench -p ferrotron-tensor --bench gemm`, BENCHMARKS.md "GEMM").

use super::Op;
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// `c[m, n] = op(a)[m, k] · op(b)[k, n]`, or `c += ...` when `accumulate`.
///
/// `a` is stored `[m, k]` for `Op::N` or `[k, m]` for `Op::T`; `b` is stored `[k, n]` for
/// `Op::N` or `[n, k]` for `Op::T` (a linear layer's `[out, in]` weight). All row-major.
/// Runs on the current rayon pool.
///
/// # Panics
/// When a slice is shorter than its shape needs (a caller bug, not an input error).
#[allow(clippy::too_many_arguments)]
pub fn sgemm(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    op_a: Op,
    b: &[f32],
    op_b: Op,
    c: &mut [f32],
    accumulate: bool,
) {
    let threads = rayon::current_num_threads();
    on_threads(m, n, k, (a, op_a), (b, op_b), c, accumulate, threads)
}

/// [`sgemm`] on the calling thread alone, for callers that already spread independent
/// products over the pool (the experts of a grouped MoE GEMM, side by side): splitting each
/// of them again would only cut them narrower.
///
/// # Panics
/// As [`sgemm`].
#[allow(clippy::too_many_arguments)]
pub fn sgemm_serial(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    op_a: Op,
    b: &[f32],
    op_b: Op,
    c: &mut [f32],
    accumulate: bool,
) {
    on_threads(m, n, k, (a, op_a), (b, op_b), c, accumulate, 1)
}

/// [`sgemm_serial`] writing `c[m, n] = op(a) · op(b)` into memory not initialized yet (an
/// output buffer not zeroed first): on return its first `m·n` elements are initialized.
///
/// # Panics
/// As [`sgemm`].
#[allow(clippy::too_many_arguments)]
pub fn sgemm_serial_uninit(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    op_a: Op,
    b: &[f32],
    op_b: Op,
    c: &mut [MaybeUninit<f32>],
) {
    let c = (c.as_mut_ptr().cast(), c.len());
    // SAFETY: c is exclusive; not accumulating, the crate writes every element of its first
    // m·n without reading it (zeros when `k == 0`).
    unsafe { checked(m, n, k, (a, op_a), (b, op_b), c, false, 1) }
}

/// [`sgemm`] into the initialized `c` on `threads` threads of the current pool (1: the
/// calling thread).
#[allow(clippy::too_many_arguments)]
fn on_threads(
    m: usize,
    n: usize,
    k: usize,
    a: (&[f32], Op),
    b: (&[f32], Op),
    c: &mut [f32],
    accumulate: bool,
    threads: usize,
) {
    // SAFETY: c is an exclusive, initialized slice of c.len() elements.
    unsafe {
        checked(
            m,
            n,
            k,
            a,
            b,
            (c.as_mut_ptr(), c.len()),
            accumulate,
            threads,
        )
    }
}

/// [`sgemm`] into `c = (ptr, len)` on `threads` threads of the current pool (1: the calling
/// thread), after checking the lengths.
///
/// # Safety
/// `c` addresses `len` elements exclusively; initialized unless not `accumulate`.
///
/// # Panics
/// As [`sgemm`].
#[allow(clippy::too_many_arguments)]
unsafe fn checked(
    m: usize,
    n: usize,
    k: usize,
    (a, op_a): (&[f32], Op),
    (b, op_b): (&[f32], Op),
    (c, c_len): (*mut f32, usize),
    accumulate: bool,
    threads: usize,
) {
    assert!(a.len() >= m * k && b.len() >= k * n && c_len >= m * n);
    let (a, b) = (
        strided(a.as_ptr(), op_a, m, k),
        strided(b.as_ptr(), op_b, k, n),
    );
    let c = Dest { ptr: c, ldc: n };
    // SAFETY: the operands cover the addressed ranges (checked above), c is the caller's.
    unsafe { sgemm_strided(m, n, k, a, b, c, accumulate, threads) }
}

/// A row-major `rows × cols` operand read as stored (`Op::N`) or transposed (stored
/// `[cols, rows]`).
fn strided(ptr: *const f32, op: Op, rows: usize, cols: usize) -> Strided {
    let (cs, rs) = match op {
        Op::N => (1, cols as isize),
        Op::T => (rows as isize, 1),
    };
    Strided { ptr, cs, rs }
}

/// Products smaller than this many multiply-adds run on one thread.
const MIN_PARALLEL_MNK: usize = 64 * 64 * 64;
/// The narrowest block of the output's longer side one thread takes alone; below it the
/// product runs on the crate's own parallel loop.
const MIN_SPLIT: usize = 128;

/// One operand as the `gemm` crate reads it: a pointer and its (column, row) strides.
#[derive(Clone, Copy)]
pub(super) struct Strided {
    pub ptr: *const f32,
    pub cs: isize,
    pub rs: isize,
}

// SAFETY: the operands are read-only for the duration of one GEMM call, by every thread.
unsafe impl Send for Strided {}
unsafe impl Sync for Strided {}

/// The destination: a pointer and its row stride.
#[derive(Clone, Copy)]
pub(super) struct Dest {
    pub ptr: *mut f32,
    pub ldc: usize,
}

// SAFETY: the threads of one call write disjoint blocks of it.
unsafe impl Send for Dest {}
unsafe impl Sync for Dest {}

/// Raw-pointer GEMM with a destination row stride `ldc` (to write a column block of `c`).
///
/// # Safety
/// The pointers must address the ranges implied by `m, n, k, op_a, op_b, ldc`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn sgemm_raw(
    m: usize,
    n: usize,
    k: usize,
    a: *const f32,
    op_a: Op,
    b: *const f32,
    op_b: Op,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    let (a, b) = (strided(a, op_a, m, k), strided(b, op_b, k, n));
    let threads = rayon::current_num_threads();
    // SAFETY: forwarded from the caller.
    unsafe { sgemm_strided(m, n, k, a, b, Dest { ptr: c, ldc }, accumulate, threads) }
}

/// [`sgemm_raw`] on operands given by their strides (`a`'s row stride the stored row length
/// of a wider matrix: a block of its columns), on `threads` threads of the current pool.
///
/// # Safety
/// The pointers address `m × k`, `k × n` and `m × n` elements at their strides.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn sgemm_strided(
    m: usize,
    n: usize,
    k: usize,
    a: Strided,
    b: Strided,
    c: Dest,
    accumulate: bool,
    threads: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    if threads == 1 || m * n * k < MIN_PARALLEL_MNK {
        // SAFETY: forwarded from the caller.
        return unsafe { product(m, n, k, a, b, c, accumulate, gemm::Parallelism::None) };
    }
    let by_cols = n >= m;
    let long = if by_cols { n } else { m };
    // Whole register blocks of the crate's AVX-512 kernel (64 x 6), so no block but the
    // last runs the narrower edge kernels. The crate multiplies our row-major output as its
    // column-major transpose: the kernel's 64 runs along our columns, its 6 along our rows
    // (columns in blocks of 48 left 32-wide remainders on the half-width kernel: SmolLM2's
    // `dx` at 2048 x 576 x 1536 went 257 -> 306 GF/s with blocks of 64).
    let width = long
        .div_ceil(threads)
        .next_multiple_of(if by_cols { 64 } else { 48 });
    if width < MIN_SPLIT {
        let par = gemm::Parallelism::Rayon(threads);
        // SAFETY: forwarded from the caller.
        return unsafe { product(m, n, k, a, b, c, accumulate, par) };
    }
    (0..long.div_ceil(width)).into_par_iter().for_each(|i| {
        let start = i * width;
        let len = width.min(long - start);
        // SAFETY: the block's rows (or columns) of `op(a)` (or `op(b)`) and of `c` lie inside
        // the caller's ranges; the blocks of `c` are disjoint.
        unsafe {
            let (mm, nn, a, b, c) = match by_cols {
                true => (m, len, a, b.offset(start, b.cs), c.offset(start)),
                false => (len, n, a.offset(start, a.rs), b, c.offset(start * c.ldc)),
            };
            product(mm, nn, k, a, b, c, accumulate, gemm::Parallelism::None)
        }
    });
}

impl Strided {
    /// The operand from its `index`-th row or column on (`stride` apart).
    ///
    /// # Safety
    /// The result stays inside the operand.
    unsafe fn offset(self, index: usize, stride: isize) -> Strided {
        Strided {
            // SAFETY: the caller's.
            ptr: unsafe { self.ptr.offset(index as isize * stride) },
            ..self
        }
    }
}

impl Dest {
    /// The destination from element `at` on.
    ///
    /// # Safety
    /// The result stays inside the destination.
    pub(super) unsafe fn offset(self, at: usize) -> Dest {
        Dest {
            // SAFETY: the caller's.
            ptr: unsafe { self.ptr.add(at) },
            ..self
        }
    }
}

/// One `gemm::gemm` call: `c = a·b` (`+=` when `accumulate`) on `par`.
///
/// # Safety
/// As [`sgemm_raw`], for this block.
#[allow(clippy::too_many_arguments)]
unsafe fn product(
    m: usize,
    n: usize,
    k: usize,
    a: Strided,
    b: Strided,
    c: Dest,
    accumulate: bool,
    par: gemm::Parallelism,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.ptr,
            1,
            c.ldc as isize,
            accumulate,
            a.ptr,
            a.cs,
            a.rs,
            b.ptr,
            b.cs,
            b.rs,
            if accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            par,
        )
    }
}
