//! Branch-free f32 math that auto-vectorizes, and the run-time AVX-512 dispatch the backward
//! kernels use for their loops.
//!
//! `f32::exp` is a libm call that never vectorizes; the softmax-shaped kernels (cross entropy
//! over a 49k vocabulary, attention probabilities) evaluate hundreds of millions of
//! exponentials per training step, so they use [`fast_exp`] instead.

/// `1.5 · 2²³`: adding it to `|t| < 2²²` rounds `t` to an integer (ties to even) held in the
/// low mantissa bits.
const MAGIC: f32 = 12_582_912.0;
/// `ln 2` split so that `n · LN2_HI` is exact for `|n| < 2⁸` (Cody & Waite).
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;

/// `eˣ` in f32, max relative error about 2 ulp (Cephes `expf`: Cody-Waite reduction
/// `x = n·ln2 + r`, `|r| <= ln2/2`, degree-6 polynomial, then scaling by `2ⁿ` through the
/// exponent bits). Inlined branch-free code, so loops over slices vectorize.
///
/// Special values: `-inf` (and anything below about -103.3) gives exactly 0, `+inf` (and
/// anything above `ln(f32::MAX)`) gives `+inf`, NaN gives NaN; results in the subnormal range
/// are rounded once, correctly scaled.
#[inline(always)]
pub fn fast_exp(x: f32) -> f32 {
    // Clamping keeps 2ⁿ within two normal factors; -105 underflows to 0, 89 overflows to inf.
    // NaN passes through `clamp` and poisons the polynomial.
    let xc = x.clamp(-105.0, 89.0);
    let k = xc * std::f32::consts::LOG2_E + MAGIC;
    let n = k - MAGIC;
    let ni = k.to_bits() as i32 - MAGIC.to_bits() as i32;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * (r * r) + r + 1.0;
    // 2ⁿ = 2^(n1) · 2^(n2), each factor a normal float for n in [-151, 129].
    let n1 = ni >> 1;
    let n2 = ni - n1;
    let s1 = f32::from_bits(((n1 + 127) as u32) << 23);
    let s2 = f32::from_bits(((n2 + 127) as u32) << 23);
    y * s1 * s2
}

/// Whether the AVX-512 clones made by [`multiversion!`](crate::multiversion) can run on this
/// CPU (the answer is cached by std).
#[inline]
pub fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512dq")
            && has_avx2_fma()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the AVX2 + FMA clones made by [`multiversion!`](crate::multiversion) can run on
/// this CPU.
#[inline]
pub fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Defines `fn $name(args) -> ret { body }` (optionally generic: `fn $name<T: Bound>(..)`)
/// compiled three times on x86-64 (AVX-512, AVX2 + FMA, baseline) and picks the best clone
/// the CPU runs ([`ops::has_avx512`], [`ops::has_avx2_fma`]); for kernels whose plain loops should vectorize as wide as the CPU
/// allows. Rust never contracts `a * b + c` into an FMA and `f32::mul_add` is exactly rounded on
/// every path (an instruction in the x86 clones and on aarch64, a libm call in the x86 baseline
/// clone, which only CPUs older than 2013 take), so all clones compute bit-identical results.
///
/// [`ops::has_avx512`]: crate::ops::has_avx512
/// [`ops::has_avx2_fma`]: crate::ops::has_avx2_fma
#[macro_export]
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident $(<$($g:ident: $bound:path),+>)? ($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name $(<$($g: $bound),+>)? ($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn generic $(<$($g: $bound),+>)? ($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx512 $(<$($g: $bound),+>)? ($($arg: $ty),*) $(-> $ret)? {
                    generic($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx2 $(<$($g: $bound),+>)? ($($arg: $ty),*) $(-> $ret)? {
                    generic($($arg),*)
                }
                if $crate::ops::has_avx512() {
                    // SAFETY: the CPU supports the enabled features (checked just above).
                    return unsafe { avx512($($arg),*) };
                }
                if $crate::ops::has_avx2_fma() {
                    // SAFETY: as above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            generic($($arg),*)
        }
    };
}
pub(crate) use crate::multiversion;

/// Lanes of the partial sums in the reductions below (two AVX-512 vectors).
pub(crate) const LANES: usize = 32;

/// `Σ x·y` with `LANES` (32) partial sums in a fixed order (vectorizes; same result on every
/// dispatch path).
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Largest element (NaN ignored, `-inf` for an empty slice), [`LANES`] partial maxima.
#[inline(always)]
pub(crate) fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let c = x.chunks_exact(LANES);
    let tail = c
        .remainder()
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    for x in c {
        for l in 0..LANES {
            acc[l] = acc[l].max(x[l]);
        }
    }
    acc.iter().copied().fold(tail, f32::max)
}

/// `Σ exp(x - m)` with [`LANES`] partial sums.
#[inline(always)]
pub(crate) fn sum_exp_shifted(x: &[f32], m: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let c = x.chunks_exact(LANES);
    let tail: f32 = c.remainder().iter().map(|&v| fast_exp(v - m)).sum();
    for x in c {
        for l in 0..LANES {
            acc[l] += fast_exp(x[l] - m);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `Σ x` with [`LANES`] partial sums in a fixed order.
#[inline(always)]
pub(crate) fn sum(x: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let c = x.chunks_exact(LANES);
    let tail: f32 = c.remainder().iter().sum();
    for v in c {
        for l in 0..LANES {
            acc[l] += v[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `(Σ(x − m), Σ(x − m)²)` with [`LANES`] partial sums in a fixed order.
#[inline(always)]
pub(crate) fn dev_sums(x: &[f32], m: f32) -> (f32, f32) {
    let (mut a1, mut a2) = ([0f32; LANES], [0f32; LANES]);
    let c = x.chunks_exact(LANES);
    let (mut t1, mut t2) = (0f32, 0f32);
    for &v in c.remainder() {
        let d = v - m;
        t1 += d;
        t2 += d * d;
    }
    for v in c {
        for l in 0..LANES {
            let d = v[l] - m;
            a1[l] += d;
            a2[l] += d * d;
        }
    }
    (a1.iter().sum::<f32>() + t1, a2.iter().sum::<f32>() + t2)
}

/// Replaces `s` by `exp(s − max)` ([`fast_exp`]) and returns `(max, Σ exp(s − max))`, with 16
/// partial maxima and sums in a fixed order: the softmax numerators and normalizer of a row
/// (`log_sum_exp = max + ln(sum)`). `-inf` entries become 0 as long as one entry is finite.
/// Inlined, so it vectorizes inside a [`multiversion!`](crate::multiversion) kernel.
#[inline(always)]
pub fn exp_in_place_normalizer(s: &mut [f32]) -> (f32, f32) {
    let mut acc = [f32::NEG_INFINITY; 16];
    let mut chunks = s.chunks_exact(16);
    for c in &mut chunks {
        for l in 0..16 {
            acc[l] = acc[l].max(c[l]);
        }
    }
    let max = chunks
        .remainder()
        .iter()
        .chain(&acc)
        .fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let mut acc = [0f32; 16];
    let mut chunks = s.chunks_exact_mut(16);
    for c in &mut chunks {
        for l in 0..16 {
            c[l] = fast_exp(c[l] - max);
            acc[l] += c[l];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for x in chunks.into_remainder() {
        *x = fast_exp(*x - max);
        sum += *x;
    }
    (max, sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_is_accurate_and_handles_special_values() {
        let mut worst = 0f64;
        let mut x = -103.0f32;
        while x < 88.7 {
            let want = (x as f64).exp();
            let got = fast_exp(x) as f64;
            if want > f32::MIN_POSITIVE as f64 {
                worst = worst.max(((got - want) / want).abs());
            }
            x += 0.000_731;
        }
        assert!(worst < 2.5e-7, "max relative error {worst:e}");
        assert_eq!(fast_exp(0.0), 1.0);
        assert_eq!(fast_exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(fast_exp(-200.0), 0.0);
        assert_eq!(fast_exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(fast_exp(89.0), f32::INFINITY);
        assert!(fast_exp(f32::NAN).is_nan());
        assert!(fast_exp(88.7) > 3.2e38);
        let sub = fast_exp(-95.0) as f64;
        assert!((sub - (-95f64).exp()).abs() < 2e-45);
    }

    #[test]
    fn reductions_match_scalar() {
        let x: Vec<f32> = (0..101).map(|i| (i as f32 * 0.37).sin()).collect();
        let y: Vec<f32> = (0..101).map(|i| (i as f32 * 0.11).cos()).collect();
        let d: f64 = x.iter().zip(&y).map(|(a, b)| (a * b) as f64).sum();
        assert!((dot(&x, &y) as f64 - d).abs() < 1e-5);
        assert_eq!(max(&x), x.iter().copied().fold(f32::MIN, f32::max));
        let s: f64 = x.iter().map(|&v| ((v - 1.0) as f64).exp()).sum();
        assert!((sum_exp_shifted(&x, 1.0) as f64 - s).abs() < 1e-4);
    }
}
