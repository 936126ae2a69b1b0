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
}
