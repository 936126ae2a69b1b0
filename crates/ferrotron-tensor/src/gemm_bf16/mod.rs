//! bf16 × bf16 → f32 GEMM: `c[m, n] (+)= op(a)[m, k] · op(b)[k, n]` with both operands rounded
//! to bf16 (f32 inputs are rounded to the nearest bf16 as they are packed, as PyTorch
//! autocast casts a matmul's inputs) and the products summed in f32.
//!
//! The kernel is chosen at run time ([`Bf16Kernel::detect`]): AMX tiles where the CPU and OS
//! allow them, else AVX512-BF16 `vdpbf16ps`, else the operands are widened back to f32 and the
//! f32 GEMM runs (same values, f32 speed). Blocking follows Goto & van de Geijn ("Anatomy of
//! High-Performance Matrix Multiplication", 2008): for each `KC`-deep slice of the reduction,
//! A is packed once into 32-row panels, and each thread packs a block of B's columns into
//! 32-column panels and runs the `32 × 32` block kernel over them (see [`pack`] for the
//! layouts).

pub(crate) mod amx;
mod avx512;
mod operand;
pub mod pack;
#[cfg(target_arch = "x86_64")]
mod pack_x86;

use crate::gemm::Op;
pub(crate) use operand::widen_bf16;
pub use operand::{Operand, narrow_to_bf16_in_place, round_to_bf16_in_place, rounded_to_bf16};
use pack::{K_ALIGN, MR, NR, pack_a, pack_b};
use rayon::prelude::*;
use std::ops::Range;
use std::sync::OnceLock;

/// The instructions a bf16 GEMM runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Kernel {
    /// AMX tiles (`tdpbf16ps`): Sapphire Rapids and later Xeons, where Linux grants AMX.
    Amx,
    /// AVX512-BF16 `vdpbf16ps`: Zen 4, Zen 5, Cooper Lake, Sapphire Rapids.
    Avx512Bf16,
    /// No bf16 dot-product instruction: the bf16-rounded operands widened to f32 and the f32
    /// GEMM ([`crate::gemm::sgemm`]); same values, f32 speed.
    Widened,
}

impl Bf16Kernel {
    /// The kernel [`bf16_gemm`] runs: AMX where the CPU and OS allow it; else AVX512-BF16
    /// where one core's measured `vdpbf16ps` rate is at least [`BF16_DOT_MIN_RATIO`] of its
    /// f32 FMA rate (Zen 4 measures ~1.8x, some Xeons issue `vdpbf16ps` at half the FMA rate,
    /// 0.5x, where the widened f32 GEMM is ~1.6x faster); else [`Bf16Kernel::Widened`].
    /// Chosen once per process ([`crate::peak::core_bf16_dot_ratio`], a few milliseconds).
    pub fn detect() -> Bf16Kernel {
        static CHOSEN: OnceLock<Bf16Kernel> = OnceLock::new();
        *CHOSEN.get_or_init(|| {
            Self::available()
                .iter()
                .copied()
                .find(|&k| k != Bf16Kernel::Avx512Bf16 || fast_bf16_dot())
                .unwrap_or(Bf16Kernel::Widened)
        })
    }

    /// Every kernel this machine can run, AMX, then AVX512-BF16, then
    /// [`Bf16Kernel::Widened`] (always). Detected once per process (CPUID, and Linux's AMX
    /// permission request), then cached: every GEMM checks its kernel against it.
    pub fn available() -> &'static [Bf16Kernel] {
        static AVAILABLE: OnceLock<Vec<Bf16Kernel>> = OnceLock::new();
        AVAILABLE.get_or_init(Self::detect_all)
    }

    fn detect_all() -> Vec<Bf16Kernel> {
        let mut kernels = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if amx::available() {
                kernels.push(Bf16Kernel::Amx);
            }
            if avx512::available() {
                kernels.push(Bf16Kernel::Avx512Bf16);
            }
        }
        kernels.push(Bf16Kernel::Widened);
        kernels
    }

    /// A short name for logs and benchmark tables (`amx-bf16`, `avx512-bf16`, `f32-widened`).
    pub fn name(self) -> &'static str {
        match self {
            Bf16Kernel::Amx => "amx-bf16",
            Bf16Kernel::Avx512Bf16 => "avx512-bf16",
            Bf16Kernel::Widened => "f32-widened",
        }
    }
}

/// Whether this CPU has AVX512-BF16 and one core's measured `vdpbf16ps` FLOP rate is at least
/// [`BF16_DOT_MIN_RATIO`] of its f32 FMA rate ([`crate::peak::core_bf16_dot_ratio`]): where
/// the bf16 dot kernels (this GEMM's, the bf16 attention tiles of
/// [`crate::ops::tile_bf16`]) beat f32 ones on bf16-rounded operands. Measured once per
/// process (a few milliseconds).
pub fn fast_bf16_dot() -> bool {
    static FAST: OnceLock<bool> = OnceLock::new();
    *FAST
        .get_or_init(|| crate::peak::core_bf16_dot_ratio().is_some_and(|r| r >= BF16_DOT_MIN_RATIO))
}

/// The least `vdpbf16ps` FLOP rate, as a fraction of the f32 FMA rate of one core, at which
/// [`Bf16Kernel::detect`] takes AVX512-BF16 over the widened f32 GEMM. Well away from the
/// rates seen (0.5 and ~1.8; a core issuing both at one per cycle measures ~1.0), so the
/// choice does not flip with measurement noise between the processes of one job.
pub const BF16_DOT_MIN_RATIO: f64 = 0.75;

/// Depth of one packed slice of the reduction dimension.
const KC: usize = 1024;
/// Widest column block one task packs (`KC × NC` bf16 = 512 KiB, resident in L2).
const NC: usize = 512;
/// Rows of A run against one B panel before moving to the next panel (A block in L2).
const MC: usize = 256;

/// `c[m, n] = op(a)[m, k] · op(b)[k, n]` (`+=` when `accumulate`) on the fastest
/// [`Bf16Kernel`]. Layouts as [`crate::gemm::sgemm`]: `a` is stored `[m, k]` (`Op::N`) or
/// `[k, m]` (`Op::T`), `b` `[k, n]` or `[n, k]`; `c` is `[m, n]`. Runs on the current rayon
/// pool.
///
/// # Panics
/// When a slice is shorter than its shape needs (a caller bug, not an input error).
#[allow(clippy::too_many_arguments)]
pub fn bf16_gemm(
    m: usize,
    n: usize,
    k: usize,
    a: Operand<'_>,
    op_a: Op,
    b: Operand<'_>,
    op_b: Op,
    c: &mut [f32],
    accumulate: bool,
) {
    bf16_gemm_with(
        Bf16Kernel::detect(),
        m,
        n,
        k,
        a,
        op_a,
        b,
        op_b,
        c,
        accumulate,
    );
}

/// [`bf16_gemm`] on a chosen kernel (tests and benchmarks compare them).
///
/// # Panics
/// As [`bf16_gemm`], and when `kernel` is not in [`Bf16Kernel::available`].
#[allow(clippy::too_many_arguments)]
pub fn bf16_gemm_with(
    kernel: Bf16Kernel,
    m: usize,
    n: usize,
    k: usize,
    a: Operand<'_>,
    op_a: Op,
    b: Operand<'_>,
    op_b: Op,
    c: &mut [f32],
    accumulate: bool,
) {
    assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
    assert!(
        Bf16Kernel::available().contains(&kernel),
        "{kernel:?} does not run on this machine"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c[..m * n].fill(0.0);
        }
        return;
    }
    if kernel == Bf16Kernel::Widened {
        widened_gemm(m, n, k, a, op_a, b, op_b, c, accumulate);
        return;
    }
    let mut a_pack = vec![0u16; m.next_multiple_of(MR) * KC.min(k.next_multiple_of(K_ALIGN))];
    let blocks = column_blocks(n, rayon::current_num_threads());
    let c_ptr = SendPtr(c.as_mut_ptr());
    for pc in (0..k).step_by(KC) {
        let depth = pc..(pc + KC).min(k);
        let kcp = depth.len().next_multiple_of(K_ALIGN);
        let a_pack = &mut a_pack[..m.next_multiple_of(MR) * kcp];
        a_pack
            .par_chunks_mut(MR * kcp)
            .enumerate()
            .for_each(|(i, panel)| {
                let rows = i * MR..((i + 1) * MR).min(m);
                pack_a(a, op_a, (m, k), rows, depth.clone(), kcp, panel);
            });
        let load_c = accumulate || pc > 0;
        let a_pack = &*a_pack;
        blocks.par_iter().for_each(|cols| {
            let mut b_pack = vec![0u16; cols.len().next_multiple_of(NR) * kcp];
            pack_b(
                b,
                op_b,
                (k, n),
                depth.clone(),
                cols.clone(),
                kcp,
                &mut b_pack,
            );
            let c = c_ptr;
            // SAFETY: each task writes only its own columns `cols` of c[m, n].
            unsafe {
                run_block(
                    kernel,
                    a_pack,
                    &b_pack,
                    m,
                    kcp,
                    c.0,
                    n,
                    cols.clone(),
                    load_c,
                )
            };
        });
    }
}

/// A raw pointer that tasks writing disjoint parts of one buffer may share.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: only used by tasks that write disjoint column ranges.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// Columns `0..n` cut into a multiple of `threads` blocks of whole panels, each at most
/// about [`NC`] wide, so the threads get equal work.
fn column_blocks(n: usize, threads: usize) -> Vec<Range<usize>> {
    let threads = threads.max(1);
    let count = threads * n.div_ceil(threads * NC);
    let width = n.div_ceil(count).next_multiple_of(NR);
    (0..n)
        .step_by(width)
        .map(|j| j..(j + width).min(n))
        .collect()
}

/// Runs the block kernel over rows `0..m` × columns `cols` of `c` (row stride `ldc`) for one
/// packed slice of depth `kcp`; blocks on the matrix edge go through a scratch block.
///
/// # Safety
/// `c` addresses `[m, ldc]`; no other thread writes columns `cols`.
#[allow(clippy::too_many_arguments)]
unsafe fn run_block(
    kernel: Bf16Kernel,
    a_pack: &[u16],
    b_pack: &[u16],
    m: usize,
    kcp: usize,
    c: *mut f32,
    ldc: usize,
    cols: Range<usize>,
    load_c: bool,
) {
    let block = BlockKernel::new(kernel);
    let mut edge = [0f32; MR * NR];
    for ic in (0..m).step_by(MC) {
        for (jp, j0) in cols.clone().step_by(NR).enumerate() {
            let b_panel = &b_pack[jp * NR * kcp..(jp + 1) * NR * kcp];
            let width = NR.min(cols.end - j0);
            for i0 in (ic..(ic + MC).min(m)).step_by(MR) {
                let a_panel = &a_pack[(i0 / MR) * MR * kcp..(i0 / MR + 1) * MR * kcp];
                let height = MR.min(m - i0);
                // SAFETY: the block lies inside c (caller); panels hold `kcp` of depth.
                unsafe {
                    let at = c.add(i0 * ldc + j0);
                    if height == MR && width == NR {
                        block.run(a_panel, b_panel, kcp, at, ldc, load_c);
                    } else {
                        copy_block(at, ldc, edge.as_mut_ptr(), NR, height, width, load_c);
                        block.run(a_panel, b_panel, kcp, edge.as_mut_ptr(), NR, load_c);
                        copy_block(edge.as_ptr(), NR, at, ldc, height, width, true);
                    }
                }
            }
        }
    }
}

/// Copies `rows × cols` f32 from `src` (row stride `lds`) to `dst` (row stride `ldd`) when
/// `copy`; otherwise leaves `dst` as it is (the kernel will not read it).
///
/// # Safety
/// Both ranges are valid; they do not overlap.
unsafe fn copy_block(
    src: *const f32,
    lds: usize,
    dst: *mut f32,
    ldd: usize,
    rows: usize,
    cols: usize,
    copy: bool,
) {
    if !copy {
        return;
    }
    for r in 0..rows {
        // SAFETY: forwarded from the caller.
        unsafe { std::ptr::copy_nonoverlapping(src.add(r * lds), dst.add(r * ldd), cols) };
    }
}

/// The block kernel of one task, with its per-thread state (AMX tile configuration).
enum BlockKernel {
    Amx(amx::Tiles),
    Avx512,
}

impl BlockKernel {
    fn new(kernel: Bf16Kernel) -> BlockKernel {
        match kernel {
            // SAFETY: `Amx` is only chosen when `amx::available()` (checked by the caller).
            Bf16Kernel::Amx => BlockKernel::Amx(unsafe { amx::Tiles::configure() }),
            Bf16Kernel::Avx512Bf16 => BlockKernel::Avx512,
            Bf16Kernel::Widened => unreachable!("the widened GEMM has no block kernel"),
        }
    }

    /// `c[32 × 32] = (load_c ? c : 0) + A panel · B panel`.
    ///
    /// # Safety
    /// `c` addresses 32 rows of 32 f32 with row stride `ldc`.
    unsafe fn run(&self, a: &[u16], b: &[u16], kcp: usize, c: *mut f32, ldc: usize, load_c: bool) {
        // SAFETY: the panels are whole (slices above); c from the caller; the CPU features
        // were checked when the kernel was chosen.
        unsafe {
            match self {
                BlockKernel::Amx(tiles) => tiles.block(a.as_ptr(), b.as_ptr(), kcp, c, ldc, load_c),
                BlockKernel::Avx512 => avx512::block(a.as_ptr(), b.as_ptr(), kcp, c, ldc, load_c),
            }
        }
    }
}

/// Elements of `op(b)` widened to f32 at a time on the [`Bf16Kernel::Widened`] path (16 MiB
/// of scratch: a whole projection of a small model, an LM head in a few column blocks).
const WIDEN_ELEMS: usize = 1 << 22;

/// The [`Bf16Kernel::Widened`] GEMM: `a` rounded to bf16 and widened back to f32 whole, `b`
/// in blocks of whole columns of at most [`WIDEN_ELEMS`] (bounded scratch; fewer, wider
/// f32 GEMMs), then the f32 GEMM.
#[allow(clippy::too_many_arguments)]
fn widened_gemm(
    m: usize,
    n: usize,
    k: usize,
    a: Operand<'_>,
    op_a: Op,
    b: Operand<'_>,
    op_b: Op,
    c: &mut [f32],
    accumulate: bool,
) {
    let a_wide = a.widened(0, 1, m * k, 0);
    // Rounded values are multiplied where they are: one block.
    let block = match b {
        Operand::Rounded(_) => n,
        _ => (WIDEN_ELEMS / k).max(1),
    };
    for j0 in (0..n).step_by(block) {
        let w = block.min(n - j0);
        // The block as stored: `[w, k]` rows of `[n, k]` (Op::T), or `[k, w]` (Op::N).
        let b_wide = match op_b {
            Op::T => b.widened(j0 * k, 1, w * k, 0),
            Op::N => b.widened(j0, k, w, n),
        };
        // SAFETY: a_wide is op(a) stored as given, b_wide the block's `[w, k]`/`[k, w]`;
        // columns j0..j0+w of c[m, n] (row stride n).
        unsafe {
            crate::gemm::sgemm_raw(
                m,
                w,
                k,
                a_wide.as_ptr(),
                op_a,
                b_wide.as_ptr(),
                op_b,
                c.as_mut_ptr().add(j0),
                n,
                accumulate,
            )
        }
    }
}

#[cfg(test)]
mod tests;
