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
    Coefs, TILE_R, TILE_W, coef_pair, dots_bf16, pair_rows, rows_product_bf16,
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
    /// softmax and statistics in f32. Runs `vdpbf16ps` where the CPU has AVX512-BF16 at a
    /// rate that beats its f32 FMAs ([`ferrotron_tensor::gemm_bf16::fast_bf16_dot`], as the
    /// bf16 GEMM chooses) and `head_dim % 16 == 0`; elsewhere the f32 kernels run on the same
    /// `q`, `k`, `v` (already bf16 values in bf16 training) with `P`, `dS` and `dO`
    /// unrounded.
    Bf16,
    /// [`AttentionPrecision::Bf16`] on the `vdpbf16ps` kernels wherever the CPU has
    /// AVX512-BF16, whatever their rate (tests and benchmarks compare the kernels).
    Bf16Tiles,
}

impl AttentionPrecision {
    /// Whether this call runs the bf16 kernels (see [`AttentionPrecision::Bf16`]).
    pub(super) fn runs_bf16(self, head_dim: usize) -> bool {
        let tiles =
            head_dim.is_multiple_of(16) && ferrotron_tensor::ops::tile_bf16::bf16_tiles_available();
        match self {
            AttentionPrecision::F32 => false,
            AttentionPrecision::Bf16 => tiles && ferrotron_tensor::gemm_bf16::fast_bf16_dot(),
            AttentionPrecision::Bf16Tiles => tiles,
        }
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

    /// `out[r·d + c] = Σ_{key in keys} coef[r][key − base] · kv(key)[c]` over group `jg`'s
    /// keys, the coefficient rows rounded to bf16 pairwise into `pairs` (scratch; keys outside
    /// `keys` in the first and last pair get 0).
    pub(super) fn product(
        &self,
        which: Kv,
        jg: usize,
        keys: std::ops::Range<usize>,
        (coef, base): ([&[f32]; TILE_R], usize),
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
        pairs.clear();
        pairs.resize(TILE_R * count, 0);
        for (row, out) in coef.iter().zip(pairs.chunks_exact_mut(count)) {
            let src = &row[2 * first - base..];
            for (p, o) in out.iter_mut().enumerate() {
                let hi = src.get(2 * p + 1).copied().unwrap_or(0.0);
                *o = coef_pair(src[2 * p], hi);
            }
            if !keys.start.is_multiple_of(2) {
                out[0] &= 0xffff_0000;
            }
            if !keys.end.is_multiple_of(2) {
                out[count - 1] &= 0x0000_ffff;
            }
        }
        let coefs = Coefs {
            data: pairs,
            row: std::array::from_fn(|r| r * count),
            stride: 1,
        };
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

    /// The pair rows of `side` for group `jg` from the even row-list index `n0` on.
    pub(super) fn from(&self, side: Side, jg: usize, n0: usize) -> &[u16] {
        debug_assert!(n0.is_multiple_of(2));
        let all = match side {
            Side::Dout => &self.dout,
            Side::Q => &self.q,
        };
        let group = &all[jg * self.group_len..][..self.group_len];
        &group[(n0 / 2) * 2 * self.d..]
    }
}

/// Writes the coefficient pairs of a tile of query rows `i0..i0 + 4` (`i0` even) of the
/// key-block pass: `coef[r][l]` (tile row `r`, key `l`) rounded to bf16, rows `(i0 + 2q,
/// i0 + 2q + 1)` paired, into `words[(i0/2 + q)·KB + l]` — the `[pairs][KB]` layout
/// [`Coefs`] reads with stride `KB` (one column per key).
#[inline(always)]
pub(super) fn tile_pair_words<const KB: usize>(
    coef: &[[f32; KB]; TILE_R],
    i0: usize,
    words: &mut [u32],
) {
    for q in 0..TILE_R / 2 {
        let out = &mut words[(i0 / 2 + q) * KB..][..KB];
        let (lo, hi) = (&coef[2 * q], &coef[2 * q + 1]);
        for ((o, &a), &b) in out.iter_mut().zip(lo).zip(hi) {
            *o = coef_pair(a, b);
        }
    }
}
