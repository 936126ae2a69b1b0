//! The bf16 operands of the training attention ([`AttentionPrecision::Bf16`]): keys and
//! values rounded to bf16 and laid out in pairs for `vdpbf16ps`
//! ([`ferrotron_tensor::ops::tile_bf16`]), query-side rows as bf16 bits, and the tile
//! products the forward and backward passes run on them (f32 accumulation).
//!
//! Per `(batch, group)` with keys padded to `skv_pad` (zeros):
//! - `kt`, `vt`: `[d/2][skv_pad][2]` — pairs along the head dim, for `q·kᵀ` and `dO·vᵀ`
//!   (a tile of query rows against a block of 64 keys);
//! - `kn`, `vn`: `[skv_pad/2][d][2]` — pairs along the keys, for `P·v` and `dS·k` (a tile of
//!   query rows times a range of key rows).

use super::AttentionDims;
use ferrotron_tensor::ops::tile_bf16::{
    TILE_R, TILE_W, coef_pair, dots_bf16, pair_rows, rows_product_bf16,
};
use ferrotron_tensor::round_to_bf16_bits;
use rayon::prelude::*;

/// The arithmetic of the training attention's products.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum AttentionPrecision {
    /// f32 operands, f32 accumulation.
    #[default]
    F32,
    /// As PyTorch's CPU flash attention on bf16 tensors (autocast): `q`, `k`, `v`, `dO`, the
    /// softmax numerators `P` and `dS` rounded to bf16 for each product, f32 accumulation,
    /// softmax and statistics in f32. Runs `vdpbf16ps` where the CPU has AVX512-BF16 and
    /// `head_dim % 16 == 0`; elsewhere the f32 kernels run on the same `q`, `k`, `v` (already
    /// bf16 values in bf16 training) with `P`, `dS` and `dO` unrounded.
    Bf16,
}

impl AttentionPrecision {
    /// Whether this call runs the bf16 kernels (see [`AttentionPrecision::Bf16`]).
    pub(super) fn runs_bf16(self, head_dim: usize) -> bool {
        self == AttentionPrecision::Bf16
            && head_dim.is_multiple_of(16)
            && ferrotron_tensor::ops::tile_bf16::bf16_tiles_available()
    }
}

/// Which of the key/value layouts to build.
#[derive(Clone, Copy)]
pub(super) struct Need {
    pub kt: bool,
    pub vt: bool,
    pub kn: bool,
    pub vn: bool,
}

/// Keys and values of every `(batch, group)` in the pair layouts of the module docs.
pub(super) struct PairedKv {
    kt: Vec<u16>,
    vt: Vec<u16>,
    kn: Vec<u16>,
    vn: Vec<u16>,
    skv_pad: usize,
    d: usize,
}

/// Key or value.
#[derive(Clone, Copy)]
pub(super) enum Kv {
    K,
    V,
}

impl PairedKv {
    /// The layouts `need` asks for of `k, v: [skv, b, g, d]`, keys padded to `skv_pad`.
    pub(super) fn new(
        k: &[f32],
        v: &[f32],
        dims: &AttentionDims,
        skv_pad: usize,
        need: Need,
    ) -> Self {
        let (skv, bg, d) = (dims.skv, dims.batch * dims.groups, dims.head_dim);
        let along_dim = |src: &[f32]| {
            let mut out = vec![0u16; bg * d * skv_pad];
            out.par_chunks_mut(d * skv_pad)
                .enumerate()
                .for_each(|(jg, out)| {
                    for p in 0..skv {
                        for (c, &x) in kv_row(src, bg, d, jg, p).iter().enumerate() {
                            out[(c / 2) * 2 * skv_pad + 2 * p + c % 2] = round_to_bf16_bits(x);
                        }
                    }
                });
            out
        };
        let along_keys = |src: &[f32]| {
            let mut out = vec![0u16; bg * skv_pad * d];
            out.par_chunks_mut(skv_pad * d)
                .enumerate()
                .for_each(|(jg, out)| {
                    let mut paired = Vec::new();
                    pair_rows(skv, d, |p| kv_row(src, bg, d, jg, p), &mut paired);
                    out[..paired.len()].copy_from_slice(&paired);
                });
            out
        };
        let build = |on: bool, f: &dyn Fn(&[f32]) -> Vec<u16>, src: &[f32]| {
            if on { f(src) } else { Vec::new() }
        };
        PairedKv {
            kt: build(need.kt, &along_dim, k),
            vt: build(need.vt, &along_dim, v),
            kn: build(need.kn, &along_keys, k),
            vn: build(need.vn, &along_keys, v),
            skv_pad,
            d,
        }
    }

    /// Unscaled `x[r]·kv(key)` for the 64 keys from `p0` (a multiple of 64) of group `jg`,
    /// `x` the tile's rows as bf16 bits.
    pub(super) fn dots(
        &self,
        which: Kv,
        jg: usize,
        x: [&[u16]; TILE_R],
        p0: usize,
    ) -> [[f32; TILE_W]; TILE_R] {
        let t = match which {
            Kv::K => &self.kt,
            Kv::V => &self.vt,
        };
        let group = &t[jg * self.d * self.skv_pad..][..self.d * self.skv_pad];
        dots_bf16(x, &group[2 * p0..], 2 * self.skv_pad, self.d)
    }

    /// `out[r·d + c] = Σ_{key in keys} coef(r, key) · kv(key)[c]` over group `jg`'s keys
    /// (`coef` must be 0 where row `r` does not see the key; it is not called outside
    /// `keys`), rounded to bf16 pairwise. `pairs` is scratch.
    pub(super) fn product(
        &self,
        which: Kv,
        jg: usize,
        keys: std::ops::Range<usize>,
        coef: impl Fn(usize, usize) -> f32,
        pairs: &mut Vec<u32>,
        out: &mut [f32],
    ) {
        let n = match which {
            Kv::K => &self.kn,
            Kv::V => &self.vn,
        };
        let group = &n[jg * self.skv_pad * self.d..][..self.skv_pad * self.d];
        let first = keys.start / 2;
        let count = keys.end.div_ceil(2) - first;
        let at = |r: usize, key: usize| {
            if keys.contains(&key) {
                coef(r, key)
            } else {
                0.0
            }
        };
        pairs.clear();
        for r in 0..TILE_R {
            pairs.extend((first..first + count).map(|p| coef_pair(at(r, 2 * p), at(r, 2 * p + 1))));
        }
        let coefs = std::array::from_fn(|r| &pairs[r * count..][..count]);
        rows_product_bf16(coefs, count, &group[first * 2 * self.d..], self.d, out);
    }
}

/// Row `p` of group `jg` of `src: [skv, bg, d]`.
fn kv_row(src: &[f32], bg: usize, d: usize, jg: usize, p: usize) -> &[f32] {
    &src[(p * bg + jg) * d..][..d]
}

/// `x` rounded to bf16 (bits), in parallel.
pub(super) fn bf16_bits(x: &[f32]) -> Vec<u16> {
    let mut out = vec![0u16; x.len()];
    out.par_chunks_mut(1 << 14)
        .zip(x.par_chunks(1 << 14))
        .for_each(|(o, x)| {
            o.iter_mut()
                .zip(x)
                .for_each(|(o, &x)| *o = round_to_bf16_bits(x))
        });
    out
}

/// The query-side rows of the key-block pass (`dO` for `dV`, `q` for `dK`) of every
/// `(batch, group)`, rounded to bf16 and paired along the group's row list
/// `n = t·(a/g) + hh` (time step `t`, head `hh` within the group) — the order the pass visits
/// them in: `[b·g][ceil(sq·a/g / 2)][d][2]`, built once per backward.
pub(super) struct PairedRows {
    dout: Vec<u16>,
    q: Vec<u16>,
    /// Elements per group.
    group_len: usize,
    d: usize,
}

/// Which query-side rows.
#[derive(Clone, Copy)]
pub(super) enum Side {
    Dout,
    Q,
}

impl PairedRows {
    /// Pairs `dout` and `q` (`[sq, b, a, d]`).
    pub(super) fn new(dout: &[f32], q: &[f32], dims: &AttentionDims) -> PairedRows {
        let (b, a, g, d) = (dims.batch, dims.heads, dims.groups, dims.head_dim);
        let hpg = a / g;
        let n = dims.sq * hpg;
        let group_len = n.div_ceil(2) * 2 * d;
        let pair = |x: &[f32]| {
            let mut out = vec![0u16; b * g * group_len];
            out.par_chunks_mut(group_len)
                .enumerate()
                .for_each(|(jg, out)| {
                    let (j, gh) = (jg / g, jg % g);
                    let row = |i: usize| {
                        let (t, hh) = (i / hpg, i % hpg);
                        &x[((t * b + j) * a + gh * hpg + hh) * d..][..d]
                    };
                    let mut paired = Vec::new();
                    pair_rows(n, d, row, &mut paired);
                    out.copy_from_slice(&paired);
                });
            out
        };
        PairedRows {
            dout: pair(dout),
            q: pair(q),
            group_len,
            d,
        }
    }

    /// The pair rows of `side` for group `jg` from row-list index `n0` on, starting at the
    /// pair holding `n0`, and `n0 % 2` (the rows before `n0` in that first pair).
    pub(super) fn from(&self, side: Side, jg: usize, n0: usize) -> (&[u16], usize) {
        let all = match side {
            Side::Dout => &self.dout,
            Side::Q => &self.q,
        };
        let group = &all[jg * self.group_len..][..self.group_len];
        (&group[(n0 / 2) * 2 * self.d..], n0 % 2)
    }
}

/// `out[r·d + c] = Σ_{i < n} coef(r, i) · row i` over rows paired along `i` with `lead` rows
/// before row 0 in the first pair (`paired`, from [`PairedRows::from`]; those rows get
/// coefficient 0), `coef` rounded pairwise into `pairs` (scratch): the key-block pass's
/// `Pᵀ·dO` and `dSᵀ·q`.
pub(super) fn paired_product(
    (n, lead): (usize, usize),
    d: usize,
    coef: impl Fn(usize, usize) -> f32,
    paired: &[u16],
    pairs: &mut Vec<u32>,
    out: &mut [f32],
) {
    let count = (lead + n).div_ceil(2);
    let at = |r: usize, e: usize| match e.checked_sub(lead) {
        Some(i) if i < n => coef(r, i),
        _ => 0.0,
    };
    pairs.clear();
    for r in 0..TILE_R {
        pairs.extend((0..count).map(|p| coef_pair(at(r, 2 * p), at(r, 2 * p + 1))));
    }
    let coefs = std::array::from_fn(|r| &pairs[r * count..][..count]);
    rows_product_bf16(coefs, count, paired, d, out);
}
