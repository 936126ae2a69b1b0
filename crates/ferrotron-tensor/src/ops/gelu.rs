//! GELU (Hendrycks & Gimpel 2016), exact and tanh-approximated, as scalar functions returning the
//! value together with the derivative; the slice kernels are in `activation.rs`
//! ([`ActivationFunc`](super::ActivationFunc)).
//!
//! Both are evaluated in forms that are equal to PyTorch's in exact arithmetic but avoid its
//! cancellation `1 + erf(…)` / `1 + tanh(…)` for negative inputs: the exact GELU is within an
//! ulp of the true function everywhere, the tanh GELU within a few ulps of its value plus its
//! sensitivity to one rounding of `x` (the tests' `err_units`). Torch's own f32 results are off
//! by up to about `3·10⁻⁷·|x|` absolute for negative `x` (see `matches_torch` below).

use super::math::fast_exp;

/// `1/√2`.
const FRAC_1_SQRT_2: f64 = std::f64::consts::FRAC_1_SQRT_2;
/// `1/√(2π)`, the standard normal density at 0.
const FRAC_1_SQRT_2PI: f64 = 0.398_942_280_401_432_7;
/// `√(2/π)` (torch `kBeta = M_SQRT2 * M_2_SQRTPI * 0.5`).
const BETA: f32 = 0.797_884_6;
/// The cubic coefficient of the tanh approximation (torch `kKappa`).
const KAPPA: f32 = 0.044_715;

/// Exact GELU and its derivative, `(x·Φ(x), Φ(x) + x·φ(x))` with the standard normal
/// `Φ(x) = ½·erfc(−x/√2)` and `φ(x) = e^(−x²/2)/√(2π)`.
///
/// torch `F.gelu(x)` (`approximate="none"`, HF `ACT2FN["gelu"]`) computes
/// `x·½·(1 + erf(x/√2))` and its backward `dy·(cdf + x·pdf)`; the same function. Evaluated in
/// f64 (libm `erfc` / `exp`) and rounded once, so both results are within an ulp of the exact
/// values. `±inf` gives what torch gives (`+inf`; NaN for `−inf`), NaN gives NaN.
#[inline]
pub(crate) fn gelu_and_grad(x: f32) -> (f32, f32) {
    let xd = f64::from(x);
    let cdf = 0.5 * libm::erfc(-xd * FRAC_1_SQRT_2);
    let pdf = FRAC_1_SQRT_2PI * libm::exp(-0.5 * xd * xd);
    ((xd * cdf) as f32, (cdf + xd * pdf) as f32)
}

/// Exact GELU, `x·Φ(x)` (the value of [`gelu_and_grad`]).
#[inline]
pub(crate) fn gelu(x: f32) -> f32 {
    let xd = f64::from(x);
    (xd * 0.5 * libm::erfc(-xd * FRAC_1_SQRT_2)) as f32
}

/// `(t, q, s)` for the tanh approximation: `u = √(2/π)·(x + 0.044715·x³)`, `t = e^(−2|u|)`,
/// `q = 1/(1+t)`, `s = σ(2u)` (`q` for `u ≥ 0`, `t·q` otherwise, so no `1 − …` cancellation).
#[inline(always)]
fn tanh_parts(x: f32) -> (f32, f32, f32) {
    let u = BETA * (x + KAPPA * x * x * x);
    let t = fast_exp(-2.0 * u.abs());
    let q = 1.0 / (1.0 + t);
    (t, q, if u >= 0.0 { q } else { t * q })
}

/// Tanh-approximated GELU, `½·x·(1 + tanh(u))` with `u = √(2/π)·(x + 0.044715·x³)`: torch
/// `F.gelu(x, approximate="tanh")`, HF `ACT2FN["gelu_pytorch_tanh"]`, Megatron `fast_gelu` /
/// `openai_gelu` (the same function up to how `u` is grouped).
///
/// Evaluated as `x·σ(2u)` (`½(1 + tanh u) = σ(2u)`) with [`fast_exp`]; branch-free, so loops
/// over it vectorize.
#[inline(always)]
pub(crate) fn gelu_tanh(x: f32) -> f32 {
    x * tanh_parts(x).2
}

/// [`gelu_tanh`] and its derivative: with `s = σ(2u)`,
/// `d/dx = s + 2x·s(1−s)·u'`, `u' = √(2/π)·(1 + 3·0.044715·x²)` (torch `GeluBackward` with
/// `approximate="tanh"`: `½(1+tanh u) + ½x·(1 − tanh²u)·u'`, the same function). `s(1−s)` is
/// formed as `t·q²`, and `x` is clamped to ±10⁴ inside `u'` only (where `s(1−s)` is already 0),
/// so every finite input has a finite derivative.
#[inline(always)]
pub(crate) fn gelu_tanh_and_grad(x: f32) -> (f32, f32) {
    let (t, q, s) = tanh_parts(x);
    let xc = x.clamp(-1.0e4, 1.0e4);
    let du = BETA * (1.0 + 3.0 * KAPPA * xc * xc);
    (x * s, s + x * (t * q * q) * (2.0 * du))
}

/// f64 definitions for the tests (straight from the formulas, no rearrangement beyond what f64
/// needs over the tested range).
#[cfg(test)]
pub(super) mod reference {
    /// Standard normal CDF `Φ(x) = ½·erfc(−x/√2)` (`½(1 + erf(x/√2))` cancels for `x ≪ 0`).
    pub fn phi_cdf(x: f64) -> f64 {
        0.5 * libm::erfc(-x / 2f64.sqrt())
    }
    pub fn gelu(x: f64) -> f64 {
        x * phi_cdf(x)
    }
    pub fn gelu_grad(x: f64) -> f64 {
        phi_cdf(x) + x * (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt()
    }
    fn u(x: f64) -> f64 {
        (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)
    }
    /// `½·x·(1 + tanh u)`, written as `x·σ(2u)` (the same in exact arithmetic) because
    /// `1 + tanh u` cancels in f64 too for `x < −4`.
    pub fn gelu_tanh(x: f64) -> f64 {
        x / (1.0 + (-2.0 * u(x)).exp())
    }
    /// `½(1 + tanh u) + ½·x·(1 − tanh²u)·u'` (torch's formula), written with `s = σ(2u)`
    /// (`½(1 + tanh u) = s`, `1 − tanh²u = 4s(1−s)`) for the same reason.
    pub fn gelu_tanh_grad(x: f64) -> f64 {
        let e = (-2.0 * u(x)).exp();
        let (s, s1s) = (1.0 / (1.0 + e), e / ((1.0 + e) * (1.0 + e)));
        let du = (2.0 / std::f64::consts::PI).sqrt() * (1.0 + 3.0 * 0.044715 * x * x);
        s + 2.0 * x * s1s * du
    }
    /// torch's form of [`gelu_tanh_grad`], accurate in f64 where `1 + tanh u` does not cancel.
    pub fn gelu_tanh_grad_torch_form(x: f64) -> f64 {
        let th = u(x).tanh();
        let du = (2.0 / std::f64::consts::PI).sqrt() * (1.0 + 3.0 * 0.044715 * x * x);
        0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * du
    }
    /// torch's form of [`gelu_tanh`].
    pub fn gelu_tanh_torch_form(x: f64) -> f64 {
        0.5 * x * (1.0 + u(x).tanh())
    }
    pub fn silu(x: f64) -> f64 {
        x / (1.0 + (-x).exp())
    }
    pub fn silu_grad(x: f64) -> f64 {
        let s = 1.0 / (1.0 + (-x).exp());
        s * (1.0 + x * (1.0 - s))
    }
    /// Central finite difference of `f` at `x` (step `1e-5·max(1, |x|)`; f64 truncation and
    /// rounding errors both about 1e-10 relative).
    pub fn central_diff(f: impl Fn(f64) -> f64, x: f64) -> f64 {
        let h = 1e-5 * x.abs().max(1.0);
        (f(x + h) - f(x - h)) / (2.0 * h)
    }
    /// Test inputs: a grid over [−10, 10] with a step that hits no round numbers, plus zero,
    /// tiny values and the grid's half-integers.
    pub fn inputs() -> Vec<f32> {
        let mut xs: Vec<f32> = (0..=4000).map(|i| -10.0 + i as f32 * 0.005_000_3).collect();
        xs.extend([
            0.0, -0.0, 1e-30, -1e-30, 1e-6, -1e-6, 1e-3, -1e-3, 0.5, -0.5, 3.0, -3.0,
        ]);
        xs
    }
}

#[cfg(test)]
mod tests {
    use super::reference as r;
    use super::*;

    /// `|got − want|` in units of `ε·(|want| + |x·want'|)`, `ε = 2⁻²⁴`: the error an f32 function
    /// makes by rounding its output once and its input once. A handful of units is as good as
    /// f32 gets; where the function is well-conditioned it is a plain relative error.
    fn err_units(got: f32, want: f64, x: f64, dwant: f64) -> f64 {
        let scale = want.abs() + (x * dwant).abs();
        if scale == 0.0 {
            return if got == 0.0 { 0.0 } else { f64::INFINITY };
        }
        (f64::from(got) - want).abs() / (scale * f64::from(f32::EPSILON) / 2.0)
    }

    /// Checks `f32` value and derivative against the f64 definition, the analytic derivative
    /// against central differences, and returns the worst errors: in [`err_units`] for the value
    /// and the derivative (over results above 1e-35; below, where `e^(−2|u|)` is subnormal,
    /// the absolute error must be under 1e-40), and relative over `x > −2`
    /// where `|f| > 1e-3` and `|f'| > 0.05` (away from the zero of `f'` near −0.75).
    fn check(
        name: &str,
        f: fn(f32) -> (f32, f32),
        value: fn(f32) -> f32,
        def: fn(f64) -> f64,
        grad: fn(f64) -> f64,
    ) -> [(f64, f32); 4] {
        let mut worst = [(0f64, 0f32); 4];
        let mut note = |k: usize, e: f64, x: f32| {
            if e > worst[k].0 {
                worst[k] = (e, x);
            }
        };
        for x in r::inputs() {
            let xd = f64::from(x);
            let (v, g) = f(x);
            assert_eq!(v.to_bits(), value(x).to_bits(), "{name}({x})");
            let (want, dwant) = (def(xd), grad(xd));
            let fd = r::central_diff(def, xd);
            assert!(
                (fd - dwant).abs() <= 1e-8 * (1.0 + dwant.abs()),
                "{name}'({x}): {fd} {dwant}"
            );
            let d2 = r::central_diff(grad, xd);
            for (k, got, want, slope) in [(0, v, want, dwant), (1, g, dwant, d2)] {
                if want.abs() > 1e-35 || want == 0.0 {
                    note(k, err_units(got, want, xd, slope), x);
                } else {
                    assert!((f64::from(got) - want).abs() < 1e-40, "{name} {k} at {x}");
                }
                if xd > -2.0 && want.abs() > [1e-3, 0.05][k] {
                    note(k + 2, (f64::from(got) - want).abs() / want.abs(), x);
                }
            }
        }
        eprintln!("{name}: worst (error, at x) {worst:?}");
        worst
    }

    #[test]
    fn gelu_matches_f64_definition() {
        let w = check("gelu", gelu_and_grad, gelu, r::gelu, r::gelu_grad);
        assert!(
            w[0].0 < 2.0 && w[1].0 < 2.0 && w[2].0 < 1e-7 && w[3].0 < 1e-7,
            "{w:?}"
        );
    }

    #[test]
    fn gelu_tanh_matches_f64_definition() {
        let w = check(
            "gelu_tanh",
            gelu_tanh_and_grad,
            gelu_tanh,
            r::gelu_tanh,
            r::gelu_tanh_grad,
        );
        assert!(
            w[0].0 < 8.0 && w[1].0 < 8.0 && w[2].0 < 1e-6 && w[3].0 < 1e-6,
            "{w:?}"
        );
        // The σ(2u) forms of the reference are torch's tanh forms where those do not cancel.
        for x in r::inputs().into_iter().map(f64::from).filter(|&x| x > -3.0) {
            let (a, b) = (r::gelu_tanh(x), r::gelu_tanh_torch_form(x));
            assert!((a - b).abs() <= 1e-13 * (a.abs() + x.abs()), "{x}");
            let (a, b) = (r::gelu_tanh_grad(x), r::gelu_tanh_grad_torch_form(x));
            assert!((a - b).abs() <= 1e-13 * (1.0 + x.abs()), "{x}");
        }
    }

    #[test]
    fn derivatives_are_finite_for_finite_inputs() {
        for x in [f32::MAX, -f32::MAX, 1e19, -1e19, 1e4, -1e4, 40.0, -40.0] {
            let (v, g) = gelu_tanh_and_grad(x);
            assert!(v.is_finite() && g.is_finite(), "{x}: {v} {g}");
            let (v, g) = gelu_and_grad(x);
            assert!(v.is_finite() && g.is_finite(), "{x}: {v} {g}");
        }
        assert_eq!(gelu_tanh_and_grad(1e19), (1e19, 1.0));
        assert_eq!(gelu_tanh_and_grad(-1e19).1, 0.0);
        assert_eq!(gelu_and_grad(1e19), (1e19, 1.0));
        assert!(gelu_tanh(f32::NAN).is_nan() && gelu(f32::NAN).is_nan());
    }

    /// Pinned against PyTorch 2.15.0 (CPU), produced in `tools/.venv` by
    /// ```text
    /// x = torch.tensor([-6.0, -3.0, -1.5, -0.5, -1e-3, 0.0, 1e-3, 0.25, 0.5, 1.0, 1.5, 3.0, 6.0])
    /// F.gelu(x); F.gelu(x, approximate="tanh")            # values, printed with float(v)
    /// xx = x.requires_grad_(); F.gelu(xx, approximate=a).sum().backward(); xx.grad  # a in none, tanh
    /// ```
    /// Torch's vectorized CPU `erf` is less accurate than libm's: its exact-GELU values at
    /// negative x are off by up to about `3.3·10⁻⁷·|x|` absolute (measured over
    /// `linspace(−8, 8, 100001)`; a one-element tensor, which takes the scalar `std::erf` path,
    /// gives −0.0040496886 at −3 where the vectorized path gives −0.0040502250), and its tanh
    /// form cancels in `1 + tanh u` (at −3 it is 1.9·10⁻⁴ off, relatively). So the tolerance is
    /// 6 ulps (we measured at most 5) plus, for `x < −1`, `4·10⁻⁷·|x|` absolute.
    #[test]
    fn matches_torch() {
        const X: [f32; 13] = [
            -6.0, -3.0, -1.5, -0.5, -1e-3, 0.0, 1e-3, 0.25, 0.5, 1.0, 1.5, 3.0, 6.0,
        ];
        const GELU: [f32; 13] = [
            -0.0,
            -0.004_050_225,
            -0.100_210_86,
            -0.154_268_77,
            -0.000_499_601_07,
            0.0,
            0.000_500_399,
            0.149_676_58,
            0.345_731_23,
            0.841_344_7,
            1.399_789_1,
            2.995_949_7,
            6.0,
        ];
        const GELU_TANH: [f32; 13] = [
            -0.0,
            -0.003_637_433,
            -0.100_428_43,
            -0.154_286,
            -0.000_499_601_07,
            0.0,
            0.000_500_399,
            0.149_675_35,
            0.345_714,
            0.841_192,
            1.399_571_5,
            2.996_362_7,
            6.0,
        ];
        const GELU_GRAD: [f32; 13] = [
            -2.980_232_2e-8,
            -0.011_945_605,
            -0.127_469_15,
            0.132_504_91,
            0.499_202_2,
            0.5,
            0.500_797_8,
            0.695_373_3,
            0.867_495_06,
            1.083_315_4,
            1.127_469_2,
            1.011_945_6,
            1.0,
        ];
        const GELU_TANH_GRAD: [f32; 13] = [
            0.0,
            -0.011_584_297,
            -0.127_710_82,
            0.132_630_1,
            0.499_202_13,
            0.5,
            0.500_797_87,
            0.695_354_1,
            0.867_369_9,
            1.082_964,
            1.127_710_8,
            1.011_584_3,
            1.0,
        ];
        let close = |got: f32, want: f32, x: f32| {
            let tail = if x < -1.0 { 4e-7 * x.abs() } else { 0.0 };
            (got - want).abs() <= 6.0 * f32::EPSILON * want.abs() + tail
        };
        for i in 0..X.len() {
            let x = X[i];
            let (v, g) = gelu_and_grad(x);
            assert!(close(v, GELU[i], x), "gelu({x}) = {v}, torch {}", GELU[i]);
            assert!(
                close(g, GELU_GRAD[i], x),
                "gelu'({x}) = {g}, torch {}",
                GELU_GRAD[i]
            );
            let (v, g) = gelu_tanh_and_grad(x);
            assert!(
                close(v, GELU_TANH[i], x),
                "gelu_tanh({x}) = {v}, torch {}",
                GELU_TANH[i]
            );
            let want = GELU_TANH_GRAD[i];
            assert!(close(g, want, x), "gelu_tanh'({x}) = {g}, torch {want}");
        }
    }
}
