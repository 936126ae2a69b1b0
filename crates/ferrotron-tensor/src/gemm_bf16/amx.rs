//! The AMX-BF16 block kernel (Intel Sapphire Rapids and later): a `32 × 32` f32 block of C
//! held in four 16×16 tiles, A and B fed as 16×32-bf16 tiles, `tdpbf16ps` doing 16·16·32
//! multiply-adds per instruction (Intel SDM vol. 2, "TDPBF16PS"; Linux's AMX permission
//! protocol: `Documentation/arch/x86/xstate.rst`).
//!
//! AMX instructions are written as inline assembly (Rust's AMX intrinsics are unstable); the
//! tile registers are invisible to the compiler, so one kernel call configures, uses and
//! releases them on the calling thread.

use super::pack::{MR, NR};
use std::arch::asm;

/// Whether this CPU has AMX-TILE and AMX-BF16, the OS saves tile state, and Linux granted
/// this process permission to use it (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`,
/// requested here; the grant is per process).
pub fn available() -> bool {
    // CPUID.(EAX=7, ECX=0):EDX bit 22 = AMX-BF16, bit 24 = AMX-TILE; XCR0 bits 17 and 18 =
    // XTILECFG and XTILEDATA state enabled by the OS.
    // SAFETY: CPUID leaf 7 exists on every x86-64 CPU that could run AVX-512 code; leaf 0
    // reports the maximum leaf, checked first.
    let leaf7 = {
        if std::arch::x86_64::__cpuid(0).eax < 7 {
            return false;
        }
        std::arch::x86_64::__cpuid_count(7, 0)
    };
    let cpu = leaf7.edx & (1 << 22) != 0 && leaf7.edx & (1 << 24) != 0;
    if !cpu || !std::arch::is_x86_feature_detected!("xsave") {
        return false;
    }
    // SAFETY: XGETBV is available (OSXSAVE implied by the xsave detection above).
    let xcr0 = unsafe { std::arch::x86_64::_xgetbv(0) };
    if xcr0 & (0b11 << 17) != 0b11 << 17 {
        return false;
    }
    request_permission()
}

#[cfg(target_os = "linux")]
fn request_permission() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain system call with integer arguments.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn request_permission() -> bool {
    false
}

/// The `ldtilecfg` operand: palette 1, tiles 0–3 hold C (16 rows × 16 f32), 4–5 A
/// (16 rows × 32 bf16), 6–7 B (16 pair-rows × 16 columns × 2 bf16); all 16 rows × 64 bytes.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    fn blocks() -> TileConfig {
        let mut cfg = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for t in 0..8 {
            cfg.colsb[t] = 64;
            cfg.rows[t] = 16;
        }
        cfg
    }
}

/// Tile state configured on the current thread for the lifetime of the guard.
pub struct Tiles(());

impl Tiles {
    /// Configures the tiles of this thread.
    ///
    /// # Safety
    /// [`available`] returned true in this process.
    pub unsafe fn configure() -> Tiles {
        let cfg = TileConfig::blocks();
        // SAFETY: AMX is available (caller); the operand is a valid 64-byte configuration.
        unsafe { asm!("ldtilecfg [{}]", in(reg) &cfg, options(nostack, readonly)) };
        Tiles(())
    }

    /// `c[32 × 32]` (row stride `ldc` f32) `= (load_c ? c : 0) + A · B` over `kcp` (a multiple
    /// of 32) from one A panel (`[MR][kcp]`) and one B panel (`[kcp/2][NR][2]`).
    ///
    /// # Safety
    /// `a`, `b` address whole panels of depth `kcp`; `c` addresses 32 rows of 32 f32 with row
    /// stride `ldc`.
    pub unsafe fn block(
        &self,
        a: *const u16,
        b: *const u16,
        kcp: usize,
        c: *mut f32,
        ldc: usize,
        load_c: bool,
    ) {
        debug_assert!(MR == 32 && NR == 32 && kcp.is_multiple_of(32));
        let c_stride = ldc * 4;
        let c_lo = c;
        // SAFETY: in bounds of the 32 × 32 block of c (caller).
        let c_hi = unsafe { c.add(16 * ldc) };
        // SAFETY (all asm below): tiles configured by `self`; addresses inside the panels and
        // the C block (caller).
        unsafe {
            if load_c {
                asm!(
                    "tileloadd tmm0, [{lo} + {s}*1]",
                    "tileloadd tmm1, [{lo} + {s}*1 + 64]",
                    "tileloadd tmm2, [{hi} + {s}*1]",
                    "tileloadd tmm3, [{hi} + {s}*1 + 64]",
                    lo = in(reg) c_lo, hi = in(reg) c_hi, s = in(reg) c_stride,
                    options(nostack, readonly),
                );
            } else {
                asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3",
                    options(nostack, nomem)
                );
            }
            let a_stride = kcp * 2;
            for p in (0..kcp).step_by(32) {
                let a_lo = a.add(p);
                let a_hi = a.add(16 * kcp + p);
                let b_at = b.add(p * NR);
                asm!(
                    "tileloadd tmm4, [{alo} + {ast}*1]",
                    "tileloadd tmm5, [{ahi} + {ast}*1]",
                    "tileloadd tmm6, [{b} + {bs}*1]",
                    "tileloadd tmm7, [{b} + {bs}*1 + 64]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    alo = in(reg) a_lo, ahi = in(reg) a_hi, ast = in(reg) a_stride,
                    b = in(reg) b_at, bs = in(reg) NR * 4,
                    options(nostack, readonly),
                );
            }
            asm!(
                "tilestored [{lo} + {s}*1], tmm0",
                "tilestored [{lo} + {s}*1 + 64], tmm1",
                "tilestored [{hi} + {s}*1], tmm2",
                "tilestored [{hi} + {s}*1 + 64], tmm3",
                lo = in(reg) c_lo, hi = in(reg) c_hi, s = in(reg) c_stride,
                options(nostack),
            );
        }
    }
}

/// `trips` × 8 `tdpbf16ps` on register tiles only (the AMX peak, [`crate::peak`]); returns
/// the FLOPs done (16·16·32 multiply-adds per instruction).
///
/// # Safety
/// [`available`] returned true in this process.
pub unsafe fn peak_loop(trips: u64) -> f64 {
    // SAFETY: AMX is available (caller); configuring zeroes every tile.
    let _tiles = unsafe { Tiles::configure() };
    for _ in 0..trips {
        // SAFETY: tiles configured above; no memory is touched.
        unsafe {
            asm!(
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                options(nostack, nomem),
            )
        };
    }
    (trips * 8 * 16 * 16 * 32 * 2) as f64
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: tiles were configured by `configure`; releasing returns them to init state.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}
