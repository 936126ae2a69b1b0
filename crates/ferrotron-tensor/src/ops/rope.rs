//! Rotary position embedding (Su et al. 2021, "RoFormer"), in HF's rotate-half convention.

use rayon::prelude::*;

/// Frequency scaling applied to the base rotary frequencies (HF `rope_scaling` /
/// `rope_parameters.rope_type`; see transformers `modeling_rope_utils.py`).
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE: `inv_freq[i] = base^(-2i/d)`.
    None,
    /// Position interpolation: every `inv_freq` divided by `factor`.
    Linear { factor: f32 },
    /// LLaMA 3.1 scaling: low frequencies divided by `factor`, high ones kept, a smooth ramp
    /// in between (transformers `_compute_llama3_parameters`).
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: usize,
    },
}

/// Precomputed `cos`/`sin` tables, each `[max_positions, d/2]`.
#[derive(Clone, Debug)]
pub struct RopeTable {
    head_dim: usize,
    max_positions: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// Builds the tables for `head_dim` (even) and positions `0..max_positions`, computing
    /// `inv_freq` and the angles in f32 as transformers does so results agree to f32 rounding.
    pub fn new(
        head_dim: usize,
        base: f32,
        scaling: &RopeScaling,
        max_positions: usize,
    ) -> RopeTable {
        assert!(head_dim.is_multiple_of(2), "rotary head_dim must be even");
        let half = head_dim / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| {
                let f = 1.0 / base.powf((2 * i) as f32 / head_dim as f32);
                scale_frequency(f, scaling)
            })
            .collect();
        let mut cos = vec![0f32; max_positions * half];
        let mut sin = vec![0f32; max_positions * half];
        for p in 0..max_positions {
            for (i, &f) in inv_freq.iter().enumerate() {
                let angle = p as f32 * f;
                cos[p * half + i] = angle.cos();
                sin[p * half + i] = angle.sin();
            }
        }
        RopeTable {
            head_dim,
            max_positions,
            cos,
            sin,
        }
    }

    /// Largest position + 1 the table covers.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// Rotates `x: [tokens, heads, d]` in place; token `t` is at position `positions[t]`
    /// (`< max_positions`). `out[i] = x[i]·cos − x[i+d/2]·sin`, `out[i+d/2] = x[i+d/2]·cos + x[i]·sin`.
    pub fn apply(&self, x: &mut [f32], positions: &[usize], heads: usize) {
        self.rotate(x, positions, heads, 1.0);
    }

    /// The inverse rotation (rotation by −θ): the backward of [`RopeTable::apply`].
    pub fn apply_inverse(&self, x: &mut [f32], positions: &[usize], heads: usize) {
        self.rotate(x, positions, heads, -1.0);
    }

    fn rotate(&self, x: &mut [f32], positions: &[usize], heads: usize, sign: f32) {
        let d = self.head_dim;
        let half = d / 2;
        assert_eq!(x.len(), positions.len() * heads * d);
        x.par_chunks_mut(heads * d)
            .zip(positions.par_iter())
            .for_each(|(tok, &p)| {
                assert!(p < self.max_positions, "position {p} beyond rotary table");
                let (c, s) = (&self.cos[p * half..][..half], &self.sin[p * half..][..half]);
                for head in tok.chunks_exact_mut(d) {
                    let (x1, x2) = head.split_at_mut(half);
                    for i in 0..half {
                        let (a, b) = (x1[i], x2[i]);
                        let si = sign * s[i];
                        x1[i] = a * c[i] - b * si;
                        x2[i] = b * c[i] + a * si;
                    }
                }
            });
    }
}

fn scale_frequency(f: f32, scaling: &RopeScaling) -> f32 {
    match *scaling {
        RopeScaling::None => f,
        RopeScaling::Linear { factor } => f / factor,
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let old = original_max_position_embeddings as f32;
            let low_freq_wavelen = old / low_freq_factor;
            let high_freq_wavelen = old / high_freq_factor;
            let wavelen = 2.0 * std::f32::consts::PI / f;
            if wavelen < high_freq_wavelen {
                f
            } else if wavelen > low_freq_wavelen {
                f / factor
            } else {
                let smooth =
                    (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                (1.0 - smooth) * f / factor + smooth * f
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inverse_undoes_rotation_and_norm_is_kept() {
        let t = RopeTable::new(8, 10000.0, &RopeScaling::None, 16);
        let orig: Vec<f32> = (0..3 * 2 * 8).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut x = orig.clone();
        t.apply(&mut x, &[0, 5, 15], 2);
        assert_eq!(&x[..8], &orig[..8], "position 0 is the identity");
        let n0: f32 = orig[16..24].iter().map(|v| v * v).sum();
        let n1: f32 = x[16..24].iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-5);
        t.apply_inverse(&mut x, &[0, 5, 15], 2);
        for (a, b) in x.iter().zip(&orig) {
            assert!((a - b).abs() < 1e-5);
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let s = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 32,
        };
        let high = 1.0; // wavelength 2π < 8
        let low = 2.0 * std::f32::consts::PI / 100.0; // wavelength 100 > 32
        assert_eq!(scale_frequency(high, &s), high);
        assert_eq!(scale_frequency(low, &s), low / 8.0);
    }
}
