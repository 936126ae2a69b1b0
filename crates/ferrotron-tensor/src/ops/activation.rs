use super::gelu::{gelu, gelu_and_grad, gelu_tanh, gelu_tanh_and_grad};
use super::math::{fast_exp, multiversion};
use rayon::prelude::*;

/// SiLU, `x · σ(x)` (Elfwing et al. 2017; HF `ACT2FN["silu"]`).
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// SwiGLU (Shazeer 2020): `out = silu(gate) ⊙ up`, all `[rows, f]`.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == up.len() && up.len() == out.len());
    out.par_chunks_mut(4096)
        .zip(gate.par_chunks(4096).zip(up.par_chunks(4096)))
        .for_each(|(o, (g, u))| {
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = silu(g) * u;
            }
        });
}

/// SwiGLU on Megatron's packed `linear_fc1` output `fc1: [rows, 2f]` (each row is
/// `[gate (f) | up (f)]`, megatron `bias_swiglu_impl` order) into `out: [rows, f]`.
pub fn swiglu_packed(fc1: &[f32], out: &mut [f32], f: usize) {
    assert!(f > 0 && fc1.len() == 2 * out.len() && out.len().is_multiple_of(f));
    out.par_chunks_mut(f)
        .zip(fc1.par_chunks(2 * f))
        .for_each(|(o, row)| {
            let (g, u) = row.split_at(f);
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = silu(g) * u;
            }
        });
}

/// `(silu(g), silu'(g))` with `σ = 1/(1+e⁻ᵍ)`: `silu = g·σ`, `silu' = σ·(1 + g·(1−σ))`.
#[inline(always)]
fn silu_and_grad(g: f32) -> (f32, f32) {
    let sig = 1.0 / (1.0 + fast_exp(-g));
    (g * sig, sig * (1.0 + g * (1.0 - sig)))
}

/// Backward of [`swiglu`]: given `dact = ∂L/∂out`, **overwrites** `dgate = dact ⊙ up ⊙ silu'(gate)`
/// and `dup = dact ⊙ silu(gate)`. All slices `[rows, f]`; `gate` and `up` are the saved forward
/// inputs. Same math as Megatron's `swiglu_back` (`bias_swiglu_impl`) and PyTorch autograd of
/// `F.silu(gate) * up`.
///
/// # Panics
/// When the lengths differ (a caller bug).
pub fn swiglu_backward(gate: &[f32], up: &[f32], dact: &[f32], dgate: &mut [f32], dup: &mut [f32]) {
    let n = gate.len();
    assert!(up.len() == n && dact.len() == n && dgate.len() == n && dup.len() == n);
    dgate
        .par_chunks_mut(4096)
        .zip(dup.par_chunks_mut(4096))
        .zip(
            gate.par_chunks(4096)
                .zip(up.par_chunks(4096))
                .zip(dact.par_chunks(4096)),
        )
        .for_each(|((dg, du), ((g, u), da))| swiglu_backward_span(g, u, da, dg, du));
}

/// Backward of [`swiglu_packed`]: `fc1: [rows, 2f]` is the saved forward input (rows
/// `[gate | up]`), `dact: [rows, f]` the gradient of the output; **overwrites**
/// `dfc1: [rows, 2f]` with rows `[dgate | dup]` (the gradient of `linear_fc1`'s output).
///
/// # Panics
/// When `f == 0` or the lengths do not match the shapes above (a caller bug).
pub fn swiglu_packed_backward(fc1: &[f32], dact: &[f32], dfc1: &mut [f32], f: usize) {
    assert!(f > 0 && fc1.len() == 2 * dact.len() && dact.len().is_multiple_of(f));
    assert_eq!(dfc1.len(), fc1.len());
    dfc1.par_chunks_mut(2 * f)
        .zip(fc1.par_chunks(2 * f).zip(dact.par_chunks(f)))
        .with_min_len((4096 / f).max(1))
        .for_each(|(drow, (row, da))| {
            let (g, u) = row.split_at(f);
            let (dg, du) = drow.split_at_mut(f);
            swiglu_backward_span(g, u, da, dg, du);
        });
}

multiversion! {
    fn swiglu_backward_span(g: &[f32], u: &[f32], da: &[f32], dg: &mut [f32], du: &mut [f32]) {
        for ((((dg, du), &g), &u), &da) in dg.iter_mut().zip(du.iter_mut()).zip(g).zip(u).zip(da) {
            let (s, ds) = silu_and_grad(g);
            *dg = da * u * ds;
            *du = da * s;
        }
    }
}

/// The MLP's activation function, named as in Megatron's `activation_func` (a `torch`
/// function) and HF's `hidden_act` / `hidden_activation` (`ACT2FN`). With a gated MLP
/// (Megatron `gated_linear_unit`) it is applied to the gate half, see [`glu_packed`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActivationFunc {
    /// `silu(x) = x·σ(x)`, `silu'(x) = σ(x)·(1 + x·(1 − σ(x)))`: Megatron `F.silu`, HF `"silu"`
    /// (LLaMA, OLMo, …; SwiGLU when gated).
    Silu,
    /// Exact GELU, `gelu(x) = x·Φ(x) = ½x·(1 + erf(x/√2))`, `gelu'(x) = Φ(x) + x·φ(x)` with
    /// `φ(x) = e^(−x²/2)/√(2π)`: Megatron `F.gelu`, torch `F.gelu(x)`, HF `"gelu"` (Falcon).
    Gelu,
    /// Tanh-approximated GELU, `½x·(1 + tanh u)`, `u = √(2/π)·(x + 0.044715·x³)`, derivative
    /// `½(1 + tanh u) + ½x·(1 − tanh²u)·√(2/π)·(1 + 3·0.044715·x²)`: Megatron `fast_gelu` /
    /// `openai_gelu`, torch `F.gelu(x, approximate="tanh")`, HF `"gelu_pytorch_tanh"`
    /// (StarCoder2, Gemma's GeGLU; Bloom's `bloom_gelu` is this function with rounded
    /// constants).
    GeluTanh,
}

impl ActivationFunc {
    /// `f(x)`, exactly as the slice kernels compute it (see the variants for the formulas).
    #[inline]
    pub fn forward(self, x: f32) -> f32 {
        match self {
            ActivationFunc::Silu => silu(x),
            ActivationFunc::Gelu => gelu(x),
            ActivationFunc::GeluTanh => gelu_tanh(x),
        }
    }

    /// `f'(x)`, exactly as the backward kernels compute it (see the variants for the formulas).
    #[inline]
    pub fn derivative(self, x: f32) -> f32 {
        self.value_and_derivative(x).1
    }

    /// `(f(x), f'(x))` as the backward kernels use them. For `Silu` the value is formed with
    /// [`fast_exp`] like in [`swiglu_backward`] (it can differ from [`Self::forward`] by an ulp).
    #[inline(always)]
    fn value_and_derivative(self, x: f32) -> (f32, f32) {
        match self {
            ActivationFunc::Silu => silu_and_grad(x),
            ActivationFunc::Gelu => gelu_and_grad(x),
            ActivationFunc::GeluTanh => gelu_tanh_and_grad(x),
        }
    }
}

/// Elements per rayon task of the elementwise kernels below.
const SPAN: usize = 4096;

/// `out = f(x)` elementwise (any shape; `x` and `out` the same length).
///
/// # Panics
/// When the lengths differ (a caller bug).
pub fn activation(f: ActivationFunc, x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "activation: x and out differ in length");
    out.par_chunks_mut(SPAN)
        .zip(x.par_chunks(SPAN))
        .for_each(|(o, x)| activation_span(f, x, o));
}

/// Backward of [`activation`]: **overwrites** `dx = dout ⊙ f'(x)` (torch autograd of `f(x)`);
/// `x` is the saved forward input. All three slices the same length.
///
/// # Panics
/// When the lengths differ (a caller bug).
pub fn activation_backward(f: ActivationFunc, x: &[f32], dout: &[f32], dx: &mut [f32]) {
    assert!(
        dout.len() == x.len() && dx.len() == x.len(),
        "activation_backward: lengths differ"
    );
    dx.par_chunks_mut(SPAN)
        .zip(x.par_chunks(SPAN).zip(dout.par_chunks(SPAN)))
        .for_each(|(dx, (x, d))| activation_backward_span(f, x, d, dx));
}

/// Gated linear unit on Megatron's packed `linear_fc1` output: `fc1: [rows, 2·ffn]`, each row
/// `[gate (ffn) | up (ffn)]`, into `out: [rows, ffn]` with `out = f(gate) ⊙ up` (Megatron
/// `gated_linear_unit=True`: `glu(x) = activation_func(x₁) * x₂` over `torch.chunk(x, 2, -1)`;
/// HF `act_fn(gate_proj(x)) * up_proj(x)`). SwiGLU for [`ActivationFunc::Silu`] (it calls
/// [`swiglu_packed`], so results are bit-identical to it), GeGLU for the GELUs (Gemma).
///
/// # Panics
/// When `ffn == 0` or the lengths do not match the shapes above (a caller bug).
pub fn glu_packed(f: ActivationFunc, fc1: &[f32], out: &mut [f32], ffn: usize) {
    if f == ActivationFunc::Silu {
        return swiglu_packed(fc1, out, ffn);
    }
    glu_packed_generic(f, fc1, out, ffn);
}

fn glu_packed_generic(f: ActivationFunc, fc1: &[f32], out: &mut [f32], ffn: usize) {
    assert!(ffn > 0 && fc1.len() == 2 * out.len() && out.len().is_multiple_of(ffn));
    out.par_chunks_mut(ffn)
        .zip(fc1.par_chunks(2 * ffn))
        .with_min_len((SPAN / ffn).max(1))
        .for_each(|(o, row)| {
            let (g, u) = row.split_at(ffn);
            glu_span(f, g, u, o);
        });
}

/// Backward of [`glu_packed`]: `fc1: [rows, 2·ffn]` is the saved forward input (rows
/// `[gate | up]`), `dact: [rows, ffn]` the gradient of the output; **overwrites**
/// `dfc1: [rows, 2·ffn]` with rows `[dgate | dup]`, `dgate = dact ⊙ up ⊙ f'(gate)`,
/// `dup = dact ⊙ f(gate)` (torch autograd of `f(gate) * up`). For [`ActivationFunc::Silu`] it
/// calls [`swiglu_packed_backward`] (bit-identical results).
///
/// # Panics
/// When `ffn == 0` or the lengths do not match the shapes above (a caller bug).
pub fn glu_packed_backward(
    f: ActivationFunc,
    fc1: &[f32],
    dact: &[f32],
    dfc1: &mut [f32],
    ffn: usize,
) {
    if f == ActivationFunc::Silu {
        return swiglu_packed_backward(fc1, dact, dfc1, ffn);
    }
    glu_packed_backward_generic(f, fc1, dact, dfc1, ffn);
}

fn glu_packed_backward_generic(
    f: ActivationFunc,
    fc1: &[f32],
    dact: &[f32],
    dfc1: &mut [f32],
    ffn: usize,
) {
    assert!(ffn > 0 && fc1.len() == 2 * dact.len() && dact.len().is_multiple_of(ffn));
    assert_eq!(dfc1.len(), fc1.len());
    dfc1.par_chunks_mut(2 * ffn)
        .zip(fc1.par_chunks(2 * ffn).zip(dact.par_chunks(ffn)))
        .with_min_len((SPAN / ffn).max(1))
        .for_each(|(drow, (row, da))| {
            let (g, u) = row.split_at(ffn);
            let (dg, du) = drow.split_at_mut(ffn);
            glu_backward_span(f, g, u, da, dg, du);
        });
}

// Each span matches on `f` once, outside its loop, and hands the loop a function item (a
// zero-sized type), so every loop is monomorphic with its function inlined: the tanh GELU and
// the SiLU derivative vectorize; libm's `erfc` and std's `exp` (the SiLU forward) do not.

multiversion! {
    fn activation_span(f: ActivationFunc, x: &[f32], out: &mut [f32]) {
        match f {
            ActivationFunc::Silu => map(x, out, silu),
            ActivationFunc::Gelu => map(x, out, gelu),
            ActivationFunc::GeluTanh => map(x, out, gelu_tanh),
        }
    }
}

multiversion! {
    fn activation_backward_span(f: ActivationFunc, x: &[f32], dout: &[f32], dx: &mut [f32]) {
        match f {
            ActivationFunc::Silu => map_grad(x, dout, dx, silu_and_grad),
            ActivationFunc::Gelu => map_grad(x, dout, dx, gelu_and_grad),
            ActivationFunc::GeluTanh => map_grad(x, dout, dx, gelu_tanh_and_grad),
        }
    }
}

multiversion! {
    fn glu_span(f: ActivationFunc, g: &[f32], u: &[f32], out: &mut [f32]) {
        match f {
            ActivationFunc::Silu => glu_loop(g, u, out, silu),
            ActivationFunc::Gelu => glu_loop(g, u, out, gelu),
            ActivationFunc::GeluTanh => glu_loop(g, u, out, gelu_tanh),
        }
    }
}

multiversion! {
    fn glu_backward_span(
        f: ActivationFunc,
        g: &[f32],
        u: &[f32],
        da: &[f32],
        dg: &mut [f32],
        du: &mut [f32],
    ) {
        match f {
            ActivationFunc::Silu => glu_backward_loop(g, u, da, dg, du, silu_and_grad),
            ActivationFunc::Gelu => glu_backward_loop(g, u, da, dg, du, gelu_and_grad),
            ActivationFunc::GeluTanh => glu_backward_loop(g, u, da, dg, du, gelu_tanh_and_grad),
        }
    }
}

#[inline(always)]
fn map(x: &[f32], out: &mut [f32], f: impl Fn(f32) -> f32) {
    for (o, &x) in out.iter_mut().zip(x) {
        *o = f(x);
    }
}

#[inline(always)]
fn map_grad(x: &[f32], dout: &[f32], dx: &mut [f32], f: impl Fn(f32) -> (f32, f32)) {
    for ((dx, &x), &d) in dx.iter_mut().zip(x).zip(dout) {
        *dx = d * f(x).1;
    }
}

#[inline(always)]
fn glu_loop(g: &[f32], u: &[f32], out: &mut [f32], f: impl Fn(f32) -> f32) {
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
        *o = f(g) * u;
    }
}

/// `dg = da·u·f'(g)`, `du = da·f(g)`: the same operations, in the same order, as
/// `swiglu_backward_span` (so `Silu` gives the same bits either way).
#[inline(always)]
fn glu_backward_loop(
    g: &[f32],
    u: &[f32],
    da: &[f32],
    dg: &mut [f32],
    du: &mut [f32],
    f: impl Fn(f32) -> (f32, f32),
) {
    for ((((dg, du), &g), &u), &da) in dg.iter_mut().zip(du.iter_mut()).zip(g).zip(u).zip(da) {
        let (s, ds) = f(g);
        *dg = da * u * ds;
        *du = da * s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_matches_unpacked() {
        let fc1 = [1.0, -2.0, 0.5, 3.0, 0.0, 4.0, -1.0, 2.0];
        let mut a = [0.0; 4];
        swiglu_packed(&fc1, &mut a, 2);
        let mut b = [0.0; 2];
        swiglu(&fc1[0..2], &fc1[2..4], &mut b);
        assert_eq!(&a[..2], &b);
        assert!((silu(1.0) - 1.0 / (1.0 + (-1.0f32).exp())).abs() < 1e-7);
    }

    use super::super::gelu::reference as r;

    const ALL: [ActivationFunc; 3] = [
        ActivationFunc::Silu,
        ActivationFunc::Gelu,
        ActivationFunc::GeluTanh,
    ];

    type F64Fn = fn(f64) -> f64;

    /// The f64 definition of `f` and of its derivative.
    fn reference(f: ActivationFunc) -> (F64Fn, F64Fn) {
        match f {
            ActivationFunc::Silu => (r::silu, r::silu_grad),
            ActivationFunc::Gelu => (r::gelu, r::gelu_grad),
            ActivationFunc::GeluTanh => (r::gelu_tanh, r::gelu_tanh_grad),
        }
    }

    /// `|got − want| ≤ 1e-6·(|want| + |x·want'|)`: relative 1e-6, widened by the function's
    /// sensitivity to one rounding of its input `x` (which matters only in the GELUs' tails).
    fn assert_close(what: &str, got: f32, want: f64, x: f64, dwant: f64) {
        let tol = 1e-6 * (want.abs() + (x * dwant).abs()) + 1e-38;
        assert!(
            (f64::from(got) - want).abs() <= tol,
            "{what} at {x}: {got} vs {want}"
        );
    }

    /// Deterministic inputs in roughly [−scale, scale].
    fn wave(n: usize, seed: f32, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|i| scale * ((i as f32 * 0.618_034 + seed).sin() * (i as f32 * 0.013).cos()))
            .collect()
    }

    #[test]
    fn activation_kernels_match_f64_definition_and_scalar_methods() {
        let mut x = r::inputs();
        x.extend(wave(6000, 0.3, 7.0)); // > 2 rayon spans
        let dout = wave(x.len(), 1.7, 2.0);
        for f in ALL {
            let (def, grad) = reference(f);
            let mut out = vec![0.0; x.len()];
            activation(f, &x, &mut out);
            let mut dx = vec![f32::NAN; x.len()];
            activation_backward(f, &x, &dout, &mut dx);
            for i in 0..x.len() {
                let xd = f64::from(x[i]);
                assert_eq!(
                    out[i].to_bits(),
                    f.forward(x[i]).to_bits(),
                    "{f:?}({})",
                    x[i]
                );
                let d = f.derivative(x[i]);
                assert_eq!(dx[i].to_bits(), (dout[i] * d).to_bits(), "{f:?}'({})", x[i]);
                assert_close(&format!("{f:?}"), out[i], def(xd), xd, grad(xd));
                // The analytic f64 derivative against central differences of the definition,
                // and ours against both (|x·f''| from central differences of f').
                let (dwant, fd) = (grad(xd), r::central_diff(def, xd));
                assert!(
                    (fd - dwant).abs() <= 1e-8 * (1.0 + dwant.abs()),
                    "{f:?}' at {xd}"
                );
                let d2 = r::central_diff(grad, xd);
                assert_close(&format!("{f:?}' (analytic)"), d, dwant, xd, d2);
                assert_close(&format!("{f:?}' (finite diff.)"), d, fd, xd, d2);
            }
        }
    }

    #[test]
    fn glu_packed_matches_f64_definition() {
        let (rows, ffn) = (5, 131);
        let fc1 = wave(rows * 2 * ffn, 0.9, 5.0);
        let dact = wave(rows * ffn, 2.3, 1.5);
        for f in ALL {
            let (def, grad) = reference(f);
            let mut out = vec![f32::NAN; rows * ffn];
            glu_packed(f, &fc1, &mut out, ffn);
            let mut dfc1 = vec![f32::NAN; fc1.len()];
            glu_packed_backward(f, &fc1, &dact, &mut dfc1, ffn);
            // L = Σ dact ⊙ f(gate) ⊙ up in f64, for the finite differences.
            let loss = |v: &[f64]| -> f64 {
                (0..rows * ffn)
                    .map(|k| {
                        let (row, j) = (k / ffn, k % ffn);
                        let (g, u) = (v[row * 2 * ffn + j], v[row * 2 * ffn + ffn + j]);
                        f64::from(dact[k]) * def(g) * u
                    })
                    .sum()
            };
            let mut v: Vec<f64> = fc1.iter().map(|&a| f64::from(a)).collect();
            for k in 0..rows * ffn {
                let (row, j) = (k / ffn, k % ffn);
                let (ig, iu) = (row * 2 * ffn + j, row * 2 * ffn + ffn + j);
                let (g, u, da) = (v[ig], v[iu], f64::from(dact[k]));
                let (fg, dfg) = (def(g), grad(g));
                assert_close(&format!("{f:?} glu"), out[k], fg * u, g, dfg * u);
                let d2 = r::central_diff(grad, g);
                assert_close(
                    &format!("{f:?} dgate"),
                    dfc1[ig],
                    da * u * dfg,
                    g,
                    da * u * d2,
                );
                assert_close(&format!("{f:?} dup"), dfc1[iu], da * fg, g, da * dfg);
                for (i, want) in [(ig, da * u * dfg), (iu, da * fg)] {
                    let h = 1e-6 * v[i].abs().max(1.0);
                    let x0 = v[i];
                    v[i] = x0 + h;
                    let lp = loss(&v);
                    v[i] = x0 - h;
                    let lm = loss(&v);
                    v[i] = x0;
                    let fd = (lp - lm) / (2.0 * h);
                    assert!(
                        (fd - want).abs() <= 1e-6 * (1.0 + want.abs()),
                        "{f:?} at {i}"
                    );
                }
            }
        }
    }

    #[test]
    fn glu_silu_is_swiglu_bit_for_bit() {
        let (rows, ffn) = (7, 97);
        let fc1 = wave(rows * 2 * ffn, 0.1, 9.0);
        let dact = wave(rows * ffn, 0.5, 2.0);
        let mut want = vec![0.0; rows * ffn];
        swiglu_packed(&fc1, &mut want, ffn);
        let mut dwant = vec![0.0; fc1.len()];
        swiglu_packed_backward(&fc1, &dact, &mut dwant, ffn);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        // The public entry points dispatch to swiglu; the generic path agrees as well.
        let mut out = vec![f32::NAN; rows * ffn];
        glu_packed(ActivationFunc::Silu, &fc1, &mut out, ffn);
        assert_eq!(bits(&out), bits(&want));
        out.fill(f32::NAN);
        glu_packed_generic(ActivationFunc::Silu, &fc1, &mut out, ffn);
        assert_eq!(bits(&out), bits(&want));
        let mut dfc1 = vec![f32::NAN; fc1.len()];
        glu_packed_backward(ActivationFunc::Silu, &fc1, &dact, &mut dfc1, ffn);
        assert_eq!(bits(&dfc1), bits(&dwant));
        dfc1.fill(f32::NAN);
        glu_packed_backward_generic(ActivationFunc::Silu, &fc1, &dact, &mut dfc1, ffn);
        assert_eq!(bits(&dfc1), bits(&dwant));
    }
}
