//! LoRA adapters on linear layers (Hu et al. 2021; NeMo's `ParallelLinearAdapter`, PEFT's
//! `LoraLayer`): [`LoraAdapter`] as training holds it (`B: [out, r]`, optional input
//! dropout, [`LoraDropout`]), [`TransposedLoraAdapter`] as serving holds it (`Bᵀ: [r, out]`).

use ferrotron_tensor::TensorView;
use ferrotron_tensor::gemm::{WeightRef, matmul_weight_t};
use ferrotron_tensor::gemv::{gemv_serial, gemv_transposed};
use rayon::prelude::*;

/// A LoRA adapter on a linear layer (Hu et al. 2021; NeMo's `ParallelLinearAdapter`): adds
/// `scale·(dropout(x)·Aᵀ)·Bᵀ` to the layer's output, `A = linear_in: [r, in]`,
/// `B = linear_out: [out, r]` (any storage dtype), `scale = alpha / r`; `dropout` is the
/// identity unless the adapter trains with [`LoraDropout`].
#[derive(Clone, Copy, Debug)]
pub struct LoraAdapter<'a> {
    /// `A: [r, in]`.
    pub linear_in: TensorView<'a>,
    /// `B: [out, r]`.
    pub linear_out: TensorView<'a>,
    /// `alpha / r`.
    pub scale: f32,
    /// Dropout on the adapter's input (training passes only).
    pub dropout: Option<LoraDropout<'a>>,
}

/// Dropout on a LoRA adapter's input (PEFT's `lora_dropout`, NeMo's adapter dropout at the
/// `pre` position): each element of `x: [rows, in]` kept with probability `1 − p` and
/// scaled by `1 / (1 − p)`, zeroed otherwise. Which elements are kept is a pure function of
/// `key` (the adapter in this pass), the row's entry of `row_keys` and the element's column
/// in the whole layer (`col_offset` + local column: a row-parallel layer's rank holds a slice
/// of the columns), so the backward, a recomputed forward and every parallel layout see the
/// same mask without storing it.
#[derive(Clone, Copy, Debug)]
pub struct LoraDropout<'a> {
    /// Probability of dropping, in `(0, 1)`.
    pub p: f32,
    /// The adapter's stream in this pass.
    pub key: u64,
    /// `[rows]` one key per row.
    pub row_keys: &'a [u64],
    /// Global column of this rank's first input column.
    pub col_offset: usize,
}

impl LoraDropout<'_> {
    /// Whether element `(row, col)` (local column) is kept.
    fn keeps(&self, row: usize, col: usize) -> bool {
        let h = mix(self.key ^ mix(self.row_keys[row]) ^ (self.col_offset + col) as u64);
        // The top 24 bits as a uniform in [0, 1).
        ((h >> 40) as f32) / (1u64 << 24) as f32 >= self.p
    }

    /// `mask ⊙ v / (1 − p)` for `v: [rows, k]`, in place: the dropout of an input, and the
    /// backward of the dropout for a gradient.
    pub fn apply(&self, v: &mut [f32], k: usize) {
        let scale = 1.0 / (1.0 - self.p);
        v.par_chunks_mut(k).enumerate().for_each(|(row, r)| {
            for (col, x) in r.iter_mut().enumerate() {
                *x = if self.keeps(row, col) {
                    *x * scale
                } else {
                    0.0
                };
            }
        });
    }
}

/// SplitMix64's finalizer: a well-mixed 64-bit hash of `x`.
pub fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl LoraAdapter<'_> {
    /// The rank `r`.
    pub fn rank(&self) -> usize {
        self.linear_in.shape()[0]
    }

    /// `y[rows, out] += scale·(dropout(x[rows, in])·Aᵀ)·Bᵀ`.
    pub fn apply(&self, x: &[f32], y: &mut [f32]) {
        let k = self.linear_in.shape()[1];
        let rows = x.len() / k;
        let mut z = vec![0f32; rows * self.rank()];
        match &self.dropout {
            Some(d) => {
                let mut dropped = x.to_vec();
                d.apply(&mut dropped, k);
                self.down(&dropped, &mut z);
            }
            None => self.down(x, &mut z),
        }
        self.up(&z, y);
    }

    /// `z[rows, r] = scale·x[rows, in]·Aᵀ` (**overwritten**): the adapter's scaled
    /// bottleneck of `x` as given (the dropout, if any, is the caller's: [`LoraAdapter::apply`]).
    pub fn down(&self, x: &[f32], z: &mut [f32]) {
        lora_down(self.linear_in, self.scale, x, z);
    }

    /// `y[rows, out] += z[rows, r]·Bᵀ` for `z` from [`LoraAdapter::down`].
    pub fn up(&self, z: &[f32], y: &mut [f32]) {
        let (n, r) = (self.linear_out.shape()[0], self.rank());
        let rows = z.len() / r;
        lora_product(self.linear_out.weight_ref(), z, y, (rows, n, r), true);
    }
}

/// A LoRA adapter with `B` stored transposed, `linear_out_t = Bᵀ: [r, out]`, as served
/// adapters keep it (`ferrotron_model::lora::LoraWeights`): the up-projection then reads
/// contiguous rows of `Bᵀ` and updates 16 outputs per instruction ([`gemv_transposed`]),
/// which a token's `r`-long dot products cannot. Forward only.
#[derive(Clone, Copy, Debug)]
pub struct TransposedLoraAdapter<'a> {
    /// `A: [r, in]`.
    pub linear_in: TensorView<'a>,
    /// `Bᵀ: [r, out]`.
    pub linear_out_t: TensorView<'a>,
    /// `alpha / r`.
    pub scale: f32,
}

impl TransposedLoraAdapter<'_> {
    /// The rank `r`.
    pub fn rank(&self) -> usize {
        self.linear_in.shape()[0]
    }

    /// `y[rows, out] += scale·(x[rows, in]·Aᵀ)·Bᵀ`.
    pub fn apply(&self, x: &[f32], y: &mut [f32]) {
        let (r, n) = (self.rank(), self.linear_out_t.shape()[1]);
        let rows = x.len() / self.linear_in.shape()[1];
        let mut z = vec![0f32; rows * r];
        lora_down(self.linear_in, self.scale, x, &mut z);
        let b_t = self.linear_out_t.weight_ref();
        if rows * n * r <= SERIAL_MACS {
            return gemv_transposed(b_t, &z, y, (rows, n, r));
        }
        // A prompt's rows: blocks of rows in parallel, each row as it would be alone.
        const ROWS: usize = 16;
        z.par_chunks(ROWS * r)
            .zip(y.par_chunks_mut(ROWS * n))
            .for_each(|(z, y)| gemv_transposed(b_t, z, y, (z.len() / r, n, r)));
    }
}

/// `z[rows, r] = scale·x[rows, in]·Aᵀ` for `a = A: [r, in]`.
fn lora_down(a: TensorView<'_>, scale: f32, x: &[f32], z: &mut [f32]) {
    let (r, k) = (a.shape()[0], a.shape()[1]);
    let rows = x.len() / k;
    lora_product(a.weight_ref(), x, z, (rows, r, k), false);
    z.iter_mut().for_each(|v| *v *= scale);
}

/// Products of at most this many multiply-adds run on the calling thread (a token's adapter
/// product is a few thousand: handing it to rayon tasks costs more than it saves).
const SERIAL_MACS: usize = 1 << 18;

/// `y[m, n] (+)= x[m, k]·wᵀ` for an adapter's matrix `w`: small products row by row on this
/// thread ([`gemv_serial`], the one-row kernel every decode GEMV uses), larger ones by the
/// parallel [`matmul_weight_t`].
fn lora_product(
    w: WeightRef<'_>,
    x: &[f32],
    y: &mut [f32],
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
) {
    if m * n * k > SERIAL_MACS {
        return matmul_weight_t(x, w, y, m, n, k, accumulate);
    }
    for (xr, yr) in x.chunks_exact(k).zip(y.chunks_exact_mut(n)).take(m) {
        gemv_serial(w, xr, yr, accumulate);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropout_keeps_about_one_minus_p_and_scales_what_it_keeps() {
        let (rows, k) = (64, 256);
        let row_keys: Vec<u64> = (0..rows as u64).collect();
        let d = LoraDropout {
            p: 0.25,
            key: 7,
            row_keys: &row_keys,
            col_offset: 0,
        };
        let mut v = vec![1.0f32; rows * k];
        d.apply(&mut v, k);
        let kept = v.iter().filter(|&&x| x != 0.0).count() as f64 / v.len() as f64;
        assert!((kept - 0.75).abs() < 0.01, "kept {kept}");
        assert!(v.iter().all(|&x| x == 0.0 || x == 1.0 / 0.75));
        // The same keys give the same mask (what the backward recomputes).
        let mut again = vec![1.0f32; rows * k];
        d.apply(&mut again, k);
        assert_eq!(again, v);
    }

    #[test]
    fn a_column_slice_with_its_offset_gets_its_part_of_the_mask() {
        let (rows, k) = (5, 40);
        let row_keys = [3u64, 1, 4, 1, 5];
        let whole = |offset, cols| {
            LoraDropout {
                p: 0.5,
                key: 99,
                row_keys: &row_keys,
                col_offset: offset,
            }
            .keeps_all(rows, cols)
        };
        let (left, right) = (whole(0, k / 2), whole(k / 2, k / 2));
        let full = whole(0, k);
        for r in 0..rows {
            let joined: Vec<bool> = [&left[r][..], &right[r][..]].concat();
            assert_eq!(joined, full[r], "row {r}");
        }
    }

    impl LoraDropout<'_> {
        fn keeps_all(&self, rows: usize, cols: usize) -> Vec<Vec<bool>> {
            (0..rows)
                .map(|r| (0..cols).map(|c| self.keeps(r, c)).collect())
                .collect()
        }
    }
}
