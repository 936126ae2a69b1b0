//! The machine's own arithmetic peaks, measured (never looked up: the CPU model varies between
//! machines of one kind): every thread of the current rayon pool runs a loop of independent
//! multiply-adds on registers only, and the best of several rounds is kept.
//!
//! Benchmarks report model FLOP utilisation (MFU) against these numbers, as Megatron's MFU is
//! taken against the accelerator's peak.

use crate::gemm_bf16::Bf16Kernel;
use std::time::Instant;

/// One measured peak.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Peak {
    /// What runs: `f32-fma-avx512`, `f32-fma-avx2`, `bf16-dot-avx512`, `bf16-amx`.
    pub name: &'static str,
    /// Floating-point operations per second over all threads of the pool, in GFLOP/s (a
    /// multiply-add counts as two).
    pub gflops: f64,
}

/// Rounds of the measurement; the fastest is kept.
const ROUNDS: usize = 5;
/// Loop trips per thread and round (each trip is one batch of independent instructions).
const TRIPS: u64 = 2_000_000;

/// The f32 FMA peak of the widest vector FMA this CPU has (AVX-512 or AVX2), over all threads
/// of the current rayon pool. `None` on CPUs without FMA.
pub fn f32_fma() -> Option<Peak> {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F checked above.
            let flops = measure(|| unsafe { x86::fma_avx512(TRIPS) });
            return Some(Peak {
                name: "f32-fma-avx512",
                gflops: flops,
            });
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: AVX2 and FMA checked above.
            let flops = measure(|| unsafe { x86::fma_avx2(TRIPS) });
            return Some(Peak {
                name: "f32-fma-avx2",
                gflops: flops,
            });
        }
    }
    None
}

/// The bf16 dot-product peak of one [`Bf16Kernel`] (`vdpbf16ps` or AMX `tdpbf16ps`) over all
/// threads of the current rayon pool; `None` for [`Bf16Kernel::Widened`] (it runs at the f32
/// peak) or a kernel this machine does not run.
pub fn bf16_dot(kernel: Bf16Kernel) -> Option<Peak> {
    if !Bf16Kernel::available().contains(&kernel) {
        return None;
    }
    match kernel {
        #[cfg(target_arch = "x86_64")]
        Bf16Kernel::Avx512Bf16 => Some(Peak {
            name: "bf16-dot-avx512",
            // SAFETY: the kernel is available, so AVX512-BF16 is.
            gflops: measure(|| unsafe { x86::dpbf16_avx512(TRIPS) }),
        }),
        #[cfg(target_arch = "x86_64")]
        Bf16Kernel::Amx => Some(Peak {
            name: "bf16-amx",
            // SAFETY: the kernel is available, so AMX is (and was granted).
            gflops: measure(|| unsafe { crate::gemm_bf16::amx::peak_loop(TRIPS / 16) }),
        }),
        _ => None,
    }
}

/// One core's AVX512-BF16 `vdpbf16ps` FLOP rate over its AVX-512 f32 FMA rate, measured on
/// the calling thread (best of 3 short rounds each, ~1 ms per round); `None` without
/// AVX512-BF16. What [`Bf16Kernel::detect`] chooses by.
pub fn core_bf16_dot_ratio() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")) {
            return None;
        }
        const SHORT: u64 = 100_000;
        let rate = |work: &dyn Fn() -> f64| {
            (0..3)
                .map(|_| {
                    let t = Instant::now();
                    work() / t.elapsed().as_secs_f64()
                })
                .fold(0f64, f64::max)
        };
        // SAFETY: AVX-512F and AVX512-BF16 checked above.
        let dot = rate(&|| unsafe { x86::dpbf16_avx512(SHORT) });
        // SAFETY: as above.
        let fma = rate(&|| unsafe { x86::fma_avx512(SHORT) });
        Some(dot / fma)
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// Runs `work` (returning the FLOPs it did) on every thread of the current pool at once,
/// [`ROUNDS`] times; GFLOP/s of the fastest round.
fn measure(work: impl Fn() -> f64 + Sync) -> f64 {
    let mut best = 0f64;
    for _ in 0..ROUNDS {
        let t = Instant::now();
        let flops: f64 = rayon::broadcast(|_| work()).iter().sum();
        best = best.max(flops / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::hint::black_box;

    /// Independent accumulators: enough to cover latency × issue width on current cores.
    const ACC: usize = 16;

    /// `trips` × [`ACC`] AVX-512 FMAs; returns the FLOPs done.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma_avx512(trips: u64) -> f64 {
        let x = _mm512_set1_ps(black_box(0.999_999));
        let y = _mm512_set1_ps(black_box(1e-7));
        let mut acc = [_mm512_set1_ps(black_box(1.0)); ACC];
        for _ in 0..trips {
            for a in acc.iter_mut() {
                *a = _mm512_fmadd_ps(*a, x, y);
            }
        }
        black_box(acc);
        (trips * ACC as u64 * 16 * 2) as f64
    }

    /// `trips` × [`ACC`] AVX2 FMAs; returns the FLOPs done.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma_avx2(trips: u64) -> f64 {
        let x = _mm256_set1_ps(black_box(0.999_999));
        let y = _mm256_set1_ps(black_box(1e-7));
        let mut acc = [_mm256_set1_ps(black_box(1.0)); ACC];
        for _ in 0..trips {
            for a in acc.iter_mut() {
                *a = _mm256_fmadd_ps(*a, x, y);
            }
        }
        black_box(acc);
        (trips * ACC as u64 * 8 * 2) as f64
    }

    /// `trips` × [`ACC`] `vdpbf16ps` (16 lanes × 2 products each); returns the FLOPs done.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn dpbf16_avx512(trips: u64) -> f64 {
        let x: __m512bh = _mm512_cvtne2ps_pbh(
            _mm512_set1_ps(black_box(1e-3)),
            _mm512_set1_ps(black_box(1e-3)),
        );
        let mut acc = [_mm512_set1_ps(black_box(1.0)); ACC];
        for _ in 0..trips {
            for a in acc.iter_mut() {
                *a = _mm512_dpbf16_ps(*a, x, x);
            }
        }
        black_box(acc);
        (trips * ACC as u64 * 16 * 4) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_available_peak_is_measured() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        pool.install(|| {
            let peaks = f32_fma()
                .into_iter()
                .chain(Bf16Kernel::available().iter().copied().filter_map(bf16_dot));
            for peak in peaks {
                assert!(peak.gflops.is_finite() && peak.gflops > 0.1, "{peak:?}");
            }
            for &kernel in Bf16Kernel::available() {
                assert_eq!(
                    bf16_dot(kernel).is_some(),
                    kernel != Bf16Kernel::Widened,
                    "{kernel:?}"
                );
            }
        });
    }

    /// The per-core ratio exists exactly where AVX512-BF16 does, and the chosen kernel
    /// follows it.
    #[test]
    fn the_chosen_kernel_follows_the_measured_ratio() {
        let avx512 = Bf16Kernel::available().contains(&Bf16Kernel::Avx512Bf16);
        let ratio = core_bf16_dot_ratio();
        assert_eq!(ratio.is_some(), avx512);
        let chosen = Bf16Kernel::detect();
        if let Some(r) = ratio
            && !Bf16Kernel::available().contains(&Bf16Kernel::Amx)
        {
            assert!(r.is_finite() && r > 0.0, "{r}");
            let fast = r >= crate::gemm_bf16::BF16_DOT_MIN_RATIO;
            assert_eq!(
                chosen == Bf16Kernel::Avx512Bf16,
                fast,
                "ratio {r}, {chosen:?}"
            );
        }
    }
}
