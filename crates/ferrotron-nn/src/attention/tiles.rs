//! The operands and register tiles of the training attention passes (`train.rs`): keys and
//! values laid out for f32 or bf16 products ([`Operands`]), tiles of query rows with their
//! visible keys ([`Tile`]), and per-task scratch.

use super::train_bf16::{AttentionPrecision, Kv, Need, PairedKv, PairedRows, bf16_bits};
use super::{AttentionDims, AttentionMask, alibi_bias};
use ferrotron_tensor::ops::tile_update;
use rayon::prelude::*;

/// Keys per block: one 64-lane register row of scores per query row.
pub(super) const KB: usize = 64;
/// Query rows per register tile: a `4 × 64` tile of scores is 16 AVX-512 accumulators, and each
/// key (or value) row loaded feeds four query rows.
pub(super) const RQ: usize = 4;

/// Keys and values of each `(batch, group)` transposed to `[d, skv_pad]` (zero-padded to whole
/// key blocks), so a tile of query rows times a block of keys is a register-tiled product.
pub(super) struct Transposed {
    kt: Vec<f32>, // [b, g, d, skv_pad]
    vt: Vec<f32>, // [b, g, d, skv_pad]
    skv_pad: usize,
}

/// Key positions padded to whole key blocks.
fn padded_keys(skv: usize) -> usize {
    skv.div_ceil(KB) * KB
}

impl Transposed {
    pub(super) fn new(k: &[f32], v: &[f32], dims: &AttentionDims) -> Transposed {
        let (skv, bg, d) = (dims.skv, dims.batch * dims.groups, dims.head_dim);
        let skv_pad = padded_keys(skv);
        let transpose = |src: &[f32]| {
            let mut t = vec![0f32; bg * d * skv_pad];
            t.par_chunks_mut(d * skv_pad)
                .enumerate()
                .for_each(|(jg, t)| {
                    for p in 0..skv {
                        for (c, &x) in src[(p * bg + jg) * d..][..d].iter().enumerate() {
                            t[c * skv_pad + p] = x;
                        }
                    }
                });
            t
        };
        let (kt, vt) = (transpose(k), transpose(v));
        Transposed { kt, vt, skv_pad }
    }

    /// `[d, skv_pad]` keys and values of `jg = j·g + gh`.
    fn group(&self, jg: usize, d: usize) -> (&[f32], &[f32]) {
        let n = d * self.skv_pad;
        (&self.kt[jg * n..][..n], &self.vt[jg * n..][..n])
    }
}

/// The operands of the tiled products in the call's [`AttentionPrecision`]: f32 keys and
/// values transposed, or bf16 pair layouts with the query-side rows (`q`, and `dO` in the
/// backward) as bf16 bits.
pub(super) enum Operands {
    F32(Transposed),
    Bf16 {
        kv: PairedKv,
        q: Vec<u16>,
        dout: Vec<u16>,
        /// The backward's query-side rows for the key-block pass.
        rows: Option<PairedRows>,
    },
}

impl Operands {
    /// `need`: the bf16 key/value layouts the pass uses; `dout` only for the backward.
    pub(super) fn new(
        [q, k, v]: [&[f32]; 3],
        dout: Option<&[f32]>,
        dims: &AttentionDims,
        precision: AttentionPrecision,
        need: Need,
    ) -> Operands {
        if !precision.runs_bf16(dims.head_dim) {
            return Operands::F32(Transposed::new(k, v, dims));
        }
        Operands::Bf16 {
            kv: PairedKv::new(k, v, dims, padded_keys(dims.skv), need),
            q: bf16_bits(q),
            dout: dout.map(bf16_bits).unwrap_or_default(),
            rows: dout.map(|dout| PairedRows::new(dout, q, dims)),
        }
    }

    /// Unscaled dots of the tile's rows of `x` (`q` or `dO`, f32 `x_f32` or the bf16 bits
    /// held here) with keys `p0..p0 + KB` of `which` (keys or values) of group `jg`. Inlined
    /// into the passes' `multiversion!` kernels, so the f32 tile compiles for AVX-512/AVX2.
    #[inline(always)]
    pub(super) fn dots(
        &self,
        which: Kv,
        jg: usize,
        tile: &Tile,
        x_f32: &[f32],
        p0: usize,
        d: usize,
    ) -> [[f32; KB]; RQ] {
        match self {
            Operands::F32(tr) => {
                let (kt, vt) = tr.group(jg, d);
                let t = match which {
                    Kv::K => kt,
                    Kv::V => vt,
                };
                block_dots(&tile.rows(x_f32, d), t, tr.skv_pad, p0)
            }
            Operands::Bf16 { kv, q, dout, .. } => {
                let bits = match which {
                    Kv::K => q,
                    Kv::V => dout,
                };
                kv.dots(which, jg, tile.rows(bits, d), p0)
            }
        }
    }
}

/// Per-task scratch of the passes.
#[derive(Default)]
pub(super) struct Scratch {
    pub(super) scores: Vec<f32>,
    pub(super) pairs: Vec<u32>,
    pub(super) prod: Vec<f32>,
}

/// Up to [`RQ`] query rows of one `(batch j, group gh)`: the rows `i0..i0 + n` of the list
/// `(t, head in group)` for `t >= t0`, with their global row indices `(t·b + j)·a + h`,
/// visible keys `lo..hi` (indices into `k, v`: positions minus [`AttentionDims::kv_offset`];
/// empty, `lo == hi`, when a row sees none of them) and, with ALiBi (`alibi`), their slopes
/// and query positions (relative to `kv_offset`). Padding rows (`r >= n`) repeat row 0 and
/// see no key.
pub(super) struct Tile {
    pub(super) row: [usize; RQ],
    pub(super) lo: [usize; RQ],
    pub(super) hi: [usize; RQ],
    pub(super) n: usize,
    pub(super) alibi: bool,
    pub(super) slope: [f32; RQ],
    pub(super) q_pos: [usize; RQ],
}

impl Tile {
    pub(super) fn new(
        t0: usize,
        i0: usize,
        n: usize,
        jg: usize,
        dims: &AttentionDims,
        mask: AttentionMask,
    ) -> Tile {
        let (b, a, g) = (dims.batch, dims.heads, dims.groups);
        let (j, gh, hpg) = (jg / g, jg % g, a / g);
        let mut tile = Tile {
            row: [0; RQ],
            lo: [0; RQ],
            hi: [0; RQ],
            n,
            alibi: mask.alibi_slopes.is_some(),
            slope: [0.0; RQ],
            q_pos: [0; RQ],
        };
        let (k0, k1) = (dims.kv_offset, dims.kv_offset + dims.skv);
        for r in 0..n {
            let (t, h) = (t0 + (i0 + r) / hpg, gh * hpg + (i0 + r) % hpg);
            let q_pos = dims.q_offset + t;
            let keys = mask.key_range(q_pos, j);
            let (lo, hi) = (keys.start.max(k0), keys.end.min(k1));
            tile.row[r] = (t * b + j) * a + h;
            (tile.lo[r], tile.hi[r]) = if lo < hi { (lo - k0, hi - k0) } else { (0, 0) };
            // Causal: a query at or past the keys' start (kv_offset <= q_offset).
            tile.q_pos[r] = q_pos - k0;
            tile.slope[r] = mask.alibi_slopes.map_or(0.0, |s| s[h]);
        }
        for r in n..RQ {
            tile.row[r] = tile.row[0];
        }
        tile
    }

    /// Keys visible to any row of the tile (rows that see none do not count).
    pub(super) fn keys(&self) -> std::ops::Range<usize> {
        let seen = || (0..self.n).filter(|&r| self.lo[r] < self.hi[r]);
        seen().map(|r| self.lo[r]).min().unwrap_or(0)..seen().map(|r| self.hi[r]).max().unwrap_or(0)
    }

    /// Whether row `r` sees at least one key.
    pub(super) fn sees_keys(&self, r: usize) -> bool {
        r < self.n && self.lo[r] < self.hi[r]
    }

    /// Scaled scores `s·scale` (plus the ALiBi bias of row `r`, if any) of keys `p0..p0 + KB`
    /// into `dst`, `-inf` where row `r` does not see the key. The branch on ALiBi is per row
    /// and block, outside the loop over keys.
    #[inline(always)]
    pub(super) fn scores(&self, r: usize, s: &[f32; KB], scale: f32, p0: usize, dst: &mut [f32]) {
        let (lo, hi) = (self.lo[r], self.hi[r]);
        if self.alibi {
            let (slope, d0) = (self.slope[r], p0 as i32 - self.q_pos[r] as i32);
            for (l, (o, &s)) in dst.iter_mut().zip(s).enumerate() {
                let vis = p0 + l >= lo && p0 + l < hi;
                *o = if vis {
                    s * scale + alibi_bias(slope, d0 + l as i32)
                } else {
                    f32::NEG_INFINITY
                };
            }
        } else {
            for (l, (o, &s)) in dst.iter_mut().zip(s).enumerate() {
                let vis = p0 + l >= lo && p0 + l < hi;
                *o = if vis { s * scale } else { f32::NEG_INFINITY };
            }
        }
    }

    /// `d`-long rows of `x` (`[rows, d]`) for the tile.
    pub(super) fn rows<'a, T>(&self, x: &'a [T], d: usize) -> [&'a [T]; RQ] {
        std::array::from_fn(|r| &x[self.row[r] * d..][..d])
    }
}

/// Unscaled dot products of the tile's rows `x` with keys `p0..p0 + KB` of `t: [d, skv_pad]`.
#[inline(always)]
fn block_dots(x: &[&[f32]; RQ], t: &[f32], skv_pad: usize, p0: usize) -> [[f32; KB]; RQ] {
    let mut acc = [[0f32; KB]; RQ];
    tile_update(
        &mut acc,
        x[0].len(),
        |r, c| x[r][c],
        |c| &t[c * skv_pad + p0..],
    );
    acc
}
