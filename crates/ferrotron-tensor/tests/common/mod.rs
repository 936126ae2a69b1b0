//! Helpers for the gradient checks: a seeded generator, central differences of f64 reference
//! forwards, and relative-error comparison of the f32 kernels against them.

#![allow(dead_code)]

/// xorshift64* generator: reproducible inputs without a dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `[-scale, scale)`, rounded to f32 (so f32 and f64 paths see the same inputs).
    pub fn uniform(&mut self, scale: f64) -> f64 {
        let u = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        ((2.0 * u - 1.0) * scale) as f32 as f64
    }

    pub fn vec(&mut self, n: usize, scale: f64) -> Vec<f64> {
        (0..n).map(|_| self.uniform(scale)).collect()
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

pub fn to_f32(x: &[f64]) -> Vec<f32> {
    x.iter().map(|&v| v as f32).collect()
}

/// Central-difference gradient of a scalar f64 function at `x`.
pub fn numeric_grad(x: &[f64], eps: f64, mut f: impl FnMut(&[f64]) -> f64) -> Vec<f64> {
    let mut x = x.to_vec();
    (0..x.len())
        .map(|i| {
            let orig = x[i];
            x[i] = orig + eps;
            let up = f(&x);
            x[i] = orig - eps;
            let down = f(&x);
            x[i] = orig;
            (up - down) / (2.0 * eps)
        })
        .collect()
}

/// `Σ a·b` in f64.
pub fn dot64(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `max |got − want| / max |want|`; asserts it is at most `tol` and prints it.
pub fn check_close(name: &str, got: &[f32], want: &[f64], tol: f64) -> f64 {
    assert_eq!(got.len(), want.len(), "{name}: length");
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    let err = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (&g, &w)| m.max((g as f64 - w).abs()));
    let rel = err / scale;
    println!("{name}: max abs err {err:.3e}, relative {rel:.3e} (tol {tol:.0e})");
    assert!(rel <= tol, "{name}: relative error {rel:e} > {tol:e}");
    assert!(
        got.iter().all(|v| v.is_finite()),
        "{name}: non-finite value"
    );
    rel
}

/// Bitwise equality of two f32 slices.
pub fn assert_bitwise(name: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{name}: length");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(
            x.to_bits(),
            y.to_bits(),
            "{name}: element {i} differs: {x} vs {y}"
        );
    }
}

/// Runs `f` on a fresh rayon pool with `threads` threads.
pub fn with_threads<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("rayon pool")
        .install(f)
}
