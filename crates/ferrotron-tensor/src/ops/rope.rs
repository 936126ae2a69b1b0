//! Rotary position embedding (Su et al. 2021, "RoFormer"): HF's rotate-half convention, or
//! the interleaved pairs of DeepSeek's multi-latent attention ([`RotaryLayout`]).

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
    /// YaRN (Peng et al. 2023): each frequency blends its interpolated (`/ factor`) and
    /// original values along a ramp between the dims that turn `beta_fast` and `beta_slow`
    /// times over the original context, and cos/sin are scaled by an attention factor
    /// (transformers `_compute_yarn_parameters`; DeepSeek-V2's `yarn` rope).
    Yarn(YarnScaling),
}

/// YaRN's settings (HF `rope_parameters` with `rope_type: "yarn"`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct YarnScaling {
    /// `factor`: the context extension ratio.
    pub factor: f32,
    /// `original_max_position_embeddings`: the pretraining context.
    pub original_max_position_embeddings: usize,
    /// `beta_fast` (default 32): rotations bounding the extrapolated (unscaled) dims.
    pub beta_fast: f32,
    /// `beta_slow` (default 1): rotations bounding the interpolated dims.
    pub beta_slow: f32,
    /// `mscale`, when given (DeepSeek): the numerator's `log` weight of the default
    /// attention factor.
    pub mscale: Option<f32>,
    /// `mscale_all_dim`, when given (DeepSeek): the denominator's, and in DeepSeek-V2's
    /// attention the softmax scale's `mscale²` ([`YarnScaling::softmax_mscale`]).
    pub mscale_all_dim: Option<f32>,
    /// `attention_factor`, when given explicitly (else derived from `factor` and the
    /// mscales).
    pub attention_factor: Option<f32>,
    /// `truncate` (default true): round the ramp's ends to whole dims.
    pub truncate: bool,
}

/// YaRN's `get_mscale`: `0.1·m·ln(scale) + 1` for `scale > 1`, else 1.
fn yarn_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

impl YarnScaling {
    /// The factor cos and sin are multiplied by: `attention_factor` if given, else
    /// `get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)` when both mscales
    /// are set and non-zero, else `get_mscale(factor)` (computed in f64 as Python does).
    pub fn attention_factor(&self) -> f32 {
        if let Some(f) = self.attention_factor {
            return f;
        }
        let factor = f64::from(self.factor);
        match (self.mscale, self.mscale_all_dim) {
            (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                (yarn_mscale(factor, f64::from(m)) / yarn_mscale(factor, f64::from(all))) as f32
            }
            _ => yarn_mscale(factor, 1.0) as f32,
        }
    }

    /// DeepSeek-V2's softmax-scale multiplier `get_mscale(factor, mscale_all_dim)²` (1 without
    /// `mscale_all_dim`): transformers' `yarn_apply_mscale`, Megatron's MLA `softmax_scale`.
    pub fn softmax_mscale(&self) -> f32 {
        match self.mscale_all_dim {
            Some(all) if all != 0.0 => {
                let m = yarn_mscale(f64::from(self.factor), f64::from(all));
                (m * m) as f32
            }
            _ => 1.0,
        }
    }

    /// The scaled inverse frequencies `[d/2]` for rotary dim `d` and `base`, in f32 as
    /// transformers computes them (the ramp's ends in f64).
    fn inv_freq(&self, head_dim: usize, base: f32) -> Vec<f32> {
        let dim = head_dim as f64;
        let correction = |rotations: f32| {
            let max = self.original_max_position_embeddings as f64;
            let turns = f64::from(rotations) * 2.0 * std::f64::consts::PI;
            dim * (max / turns).ln() / (2.0 * f64::from(base).ln())
        };
        let (mut low, mut high) = (correction(self.beta_fast), correction(self.beta_slow));
        if self.truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0) as f32, high.min(dim - 1.0) as f32);
        if low == high {
            high += 0.001;
        }
        (0..head_dim / 2)
            .map(|i| {
                let pos_freq = base.powf((2 * i) as f32 / head_dim as f32);
                let (extrapolation, interpolation) =
                    (1.0 / pos_freq, 1.0 / (self.factor * pos_freq));
                let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                let keep = 1.0 - ramp;
                interpolation * (1.0 - keep) + extrapolation * keep
            })
            .collect()
    }
}

/// Which elements of a head rotate together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RotaryLayout {
    /// Pairs `(i, i + d/2)` (HF's `rotate_half`, GPT-NeoX; Megatron's default).
    #[default]
    RotateHalf,
    /// Pairs `(2i, 2i + 1)` (GPT-J, DeepSeek-V2's `apply_rotary_emb` on complex pairs;
    /// Megatron's `rotary_interleaved`).
    Interleaved,
}

/// Precomputed `cos`/`sin` tables, each `[max_positions, d/2]` (times YaRN's attention
/// factor under [`RopeScaling::Yarn`]).
#[derive(Clone, Debug)]
pub struct RopeTable {
    head_dim: usize,
    max_positions: usize,
    layout: RotaryLayout,
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
        let (inv_freq, attention_factor): (Vec<f32>, f32) = match scaling {
            RopeScaling::Yarn(yarn) => (yarn.inv_freq(head_dim, base), yarn.attention_factor()),
            _ => (
                (0..half)
                    .map(|i| {
                        let f = 1.0 / base.powf((2 * i) as f32 / head_dim as f32);
                        scale_frequency(f, scaling)
                    })
                    .collect(),
                1.0,
            ),
        };
        let mut cos = vec![0f32; max_positions * half];
        let mut sin = vec![0f32; max_positions * half];
        for p in 0..max_positions {
            for (i, &f) in inv_freq.iter().enumerate() {
                let angle = p as f32 * f;
                cos[p * half + i] = angle.cos() * attention_factor;
                sin[p * half + i] = angle.sin() * attention_factor;
            }
        }
        RopeTable {
            head_dim,
            max_positions,
            layout: RotaryLayout::RotateHalf,
            cos,
            sin,
        }
    }

    /// This table rotating the pairs of `layout`.
    pub fn with_layout(mut self, layout: RotaryLayout) -> RopeTable {
        self.layout = layout;
        self
    }

    /// Largest position + 1 the table covers.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// Rotates `x: [tokens, heads, d]` in place; token `t` is at position `positions[t]`
    /// (`< max_positions`). For each pair `(i, j)` of the layout (`j = i + d/2`, or `i = 2k`,
    /// `j = 2k + 1`) with the pair's angle: `out[i] = x[i]·cos − x[j]·sin`,
    /// `out[j] = x[j]·cos + x[i]·sin`.
    pub fn apply(&self, x: &mut [f32], positions: &[usize], heads: usize) {
        self.rotate(x, positions, heads, 1.0);
    }

    /// The transposed rotation (by −θ; the inverse unless YaRN scales the tables): the
    /// backward of [`RopeTable::apply`].
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
                    match self.layout {
                        RotaryLayout::RotateHalf => {
                            let (x1, x2) = head.split_at_mut(half);
                            for i in 0..half {
                                let (a, b) = (x1[i], x2[i]);
                                let si = sign * s[i];
                                x1[i] = a * c[i] - b * si;
                                x2[i] = b * c[i] + a * si;
                            }
                        }
                        RotaryLayout::Interleaved => {
                            for (i, pair) in head.chunks_exact_mut(2).enumerate() {
                                let (a, b) = (pair[0], pair[1]);
                                let si = sign * s[i];
                                pair[0] = a * c[i] - b * si;
                                pair[1] = b * c[i] + a * si;
                            }
                        }
                    }
                }
            });
    }
}

fn scale_frequency(f: f32, scaling: &RopeScaling) -> f32 {
    match *scaling {
        RopeScaling::None | RopeScaling::Yarn(_) => f,
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

    /// DeepSeek-V2's YaRN (`factor` 40 over 4096, β 32/1, dim 64) against transformers
    /// 5.23's `_compute_yarn_parameters`: extrapolated, ramped and interpolated dims.
    #[test]
    fn yarn_frequencies_match_transformers() {
        let yarn = YarnScaling {
            factor: 40.0,
            original_max_position_embeddings: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: Some(0.707),
            mscale_all_dim: Some(0.707),
            attention_factor: None,
            truncate: true,
        };
        let inv = yarn.inv_freq(64, 10000.0);
        let want = [
            (0, 1.0),
            (5, 0.237_137_36),
            (10, 0.056_234_13),
            (12, 0.026_879_36),
            (14, 0.012_447_956),
            (16, 0.005_500_000_4),
            (20, 0.000_790_569_4),
            (31, 3.333_803_5e-6),
        ];
        for (i, w) in want {
            assert!(
                (inv[i] - w).abs() <= 1e-6 * w,
                "inv_freq[{i}] {} vs {w}",
                inv[i]
            );
        }
        assert_eq!(yarn.attention_factor(), 1.0);
        assert!((yarn.softmax_mscale() - 1.589_626_2).abs() < 1e-6);
        let tiny = YarnScaling {
            factor: 4.0,
            original_max_position_embeddings: 16,
            mscale: Some(0.9),
            ..yarn
        };
        assert!((tiny.attention_factor() - 1.024_367_2).abs() < 1e-7);
    }

    #[test]
    fn interleaved_rotates_adjacent_pairs() {
        let t = RopeTable::new(4, 10000.0, &RopeScaling::None, 8);
        let half = t.clone();
        let pairs = t.with_layout(RotaryLayout::Interleaved);
        let mut a = vec![1.0, 2.0, 3.0, 4.0];
        let mut b = vec![1.0, 3.0, 2.0, 4.0];
        half.apply(&mut a, &[5], 1);
        pairs.apply(&mut b, &[5], 1);
        assert_eq!([b[0], b[2], b[1], b[3]], [a[0], a[1], a[2], a[3]]);
        pairs.apply_inverse(&mut b, &[5], 1);
        for (x, y) in b.iter().zip([1.0, 3.0, 2.0, 4.0]) {
            assert!((x - y).abs() < 1e-6);
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
