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
