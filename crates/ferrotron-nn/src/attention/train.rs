//! Training attention: a register-tiled forward that saves the per-row logsumexp and its
//! deterministic FlashAttention-2-style backward (Dao 2023), over the same shapes and masks as
//! [`super::core_attention`].

use super::tiles::{KB, Operands, RQ, Scratch, Tile};
use super::train_bf16::{AttentionPrecision, Kv, Need, Side, tile_pair_words};
use super::{AttentionDims, AttentionMask, alibi_bias, check_dims};
use ferrotron_tensor::multiversion;
use ferrotron_tensor::ops::tile_bf16::{Coefs, rows_product_bf16};
use ferrotron_tensor::ops::{dot, exp_in_place_normalizer, fast_exp, tile_rows_product};
use rayon::prelude::*;

/// Query time steps per task of the row-parallel passes.
const TQ: usize = 4;
/// Query rows whose `P` and `dS` the key-block pass buffers at a time.
const QC: usize = 64;

/// [`core_attention`](super::core_attention) for training: the same `out: [sq, b, a, d]`,
/// plus the per-row softmax statistic `lse: [sq, b, a]` (**overwritten**),
/// `lse = log Σⱼ exp(sⱼ)` over the visible keys with `s = q·kᵀ/√d` (plus the ALiBi bias
/// `slope_h·(j − i)` with [`AttentionMask::alibi_slopes`]) — what
/// [`core_attention_backward`] needs besides `q, k, v, out` (FlashAttention-2's saved `L`,
/// Dao 2023). Deterministic. Tiles of 4 query rows (of one batch and group) times 64 keys are
/// register-tiled products, so each key and value row read serves four query rows; each tile
/// only visits the key blocks its rows see (so packed documents cost their own span).
/// `precision` chooses f32 or bf16 products ([`AttentionPrecision`]).
///
/// # Panics
/// On inconsistent dims, slice lengths or document starts (caller bugs), as
/// [`core_attention`](super::core_attention).
#[allow(clippy::too_many_arguments)]
pub fn core_attention_forward_train(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
    dims: AttentionDims,
    mask: AttentionMask,
    precision: AttentionPrecision,
) {
    check_dims(q, k, v, &dims, &mask);
    assert!(out.len() == q.len() && lse.len() * dims.head_dim == q.len());
    let need = Need {
        kt: true,
        vt: false,
        kn: false,
        vn: true,
    };
    let ops = Operands::new([q, k, v], None, &dims, precision, need);
    let rows = dims.batch * dims.heads;
    out.par_chunks_mut(TQ * rows * dims.head_dim)
        .zip(lse.par_chunks_mut(TQ * rows))
        .enumerate()
        .for_each_init(Scratch::default, |scratch, (ci, (o, l))| {
            forward_chunk(q, v, &ops, ci * TQ, o, l, scratch, &dims, mask);
        });
}

multiversion! {
    /// Time steps `t0..` (as many as `lse` holds) of the training forward.
    fn forward_chunk(
        q: &[f32],
        v: &[f32],
        ops: &Operands,
        t0: usize,
        out: &mut [f32],
        lse: &mut [f32],
        scratch: &mut Scratch,
        dims: &AttentionDims,
        mask: AttentionMask,
    ) {
        let AttentionDims { batch: b, heads: a, groups: g, head_dim: d, .. } = *dims;
        let (row0, n_rows) = (t0 * b * a, lse.len() / (b * a) * (a / g));
        let scale = 1.0 / (d as f32).sqrt();
        let Scratch { scores, pairs, prod, .. } = scratch;
        for jg in 0..b * g {
            let v_row = |p: usize| &v[(p * b * g + jg) * d..][..d];
            for i0 in (0..n_rows).step_by(RQ) {
                let tile = Tile::new(t0, i0, RQ.min(n_rows - i0), jg, dims, mask);
                let keys = tile.keys();
                let b0 = keys.start / KB * KB;
                let width = keys.end.div_ceil(KB) * KB - b0;
                scores.resize(RQ * width, 0.0);
                for p0 in (b0..b0 + width).step_by(KB) {
                    let s = ops.dots(Kv::K, jg, &tile, q, p0, d);
                    for (r, s) in s.iter().enumerate() {
                        tile.scores(r, s, scale, p0, &mut scores[r * width + p0 - b0..][..KB]);
                    }
                }
                // Softmax numerators in place over the tile's keys; padding rows, and rows that
                // see no key of this call (a block of a longer sequence's keys: output 0,
                // log-sum-exp -inf), become 0.
                let mut inv = [0f32; RQ];
                for r in 0..RQ {
                    let s = &mut scores[r * width + keys.start - b0..][..keys.len()];
                    if !tile.sees_keys(r) {
                        s.fill(0.0);
                        if r < tile.n {
                            lse[tile.row[r] - row0] = f32::NEG_INFINITY;
                        }
                        continue;
                    }
                    let (max, sum) = exp_in_place_normalizer(s);
                    inv[r] = 1.0 / sum;
                    lse[tile.row[r] - row0] = max + sum.ln();
                }
                let off = keys.start - b0;
                let mut emit = |r: usize, c0: usize, vals: &[f32]| {
                    if r < tile.n {
                        let o = &mut out[(tile.row[r] - row0) * d + c0..][..vals.len()];
                        o.iter_mut().zip(vals).for_each(|(o, &x)| *o = x * inv[r]);
                    }
                };
                match ops {
                    Operands::F32(_) => tile_rows_product::<RQ>(
                        d,
                        keys.len(),
                        |r, i| scores[r * width + off + i],
                        |i| v_row(keys.start + i),
                        emit,
                    ),
                    Operands::Bf16 { kv, .. } => {
                        prod.resize(RQ * d, 0.0);
                        let coef = std::array::from_fn(|r| &scores[r * width..][..width]);
                        kv.product(Kv::V, jg, keys.clone(), (coef, b0), pairs, prod);
                        (0..RQ).for_each(|r| emit(r, 0, &prod[r * d..][..d]));
                    }
                }
            }
        }
    }
}

/// Backward of [`core_attention_forward_train`] (FlashAttention-2's backward, Dao 2023,
/// Algorithm 2, computed exactly without atomics). With `S = q·kᵀ/√d` (plus the ALiBi bias, a
/// constant: it reaches `q` and `k` only through `P`), `P = exp(S − lse)`,
/// `δᵢ = Σ dOᵢ ⊙ Oᵢ`:
/// `dV = Pᵀ·dO`, `dS = P ⊙ (dO·Vᵀ − δ)`, `dQ = dS·K/√d`, `dK = dSᵀ·Q/√d`; with GQA, `dK`/`dV` of
/// a group sum over its `a/g` query heads.
///
/// Shapes: `q, out, dout, dq: [sq, b, a, d]`; `k, v: [skv, b, g, d]` (at least; only the first
/// `skv` positions are read); `dk, dv: [skv, b, g, d]` exactly; `lse: [sq, b, a]`. `dq`, `dk`
/// and `dv` are **overwritten** (keys no query sees get 0).
///
/// Parallel and deterministic: a first pass computes `dQ` (and `δ`) for tiles of query rows; a
/// second pass computes `dK, dV` per (batch, group, block of 64 keys), recomputing `P` and `dS`
/// for the queries that may see the block (bounded by causality, the window and the
/// document of its last key), in a fixed order. Results are bitwise reproducible for
/// any thread count. Products are register-tiled as in the forward, in `precision`
/// ([`AttentionPrecision`]; `δ` is always the f32 dot of `dO` and `O`).
///
/// # Panics
/// On inconsistent dims, slice lengths, document starts or ALiBi slopes (caller bugs).
#[allow(clippy::too_many_arguments)]
pub fn core_attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &[f32],
    dout: &[f32],
    lse: &[f32],
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    dims: AttentionDims,
    mask: AttentionMask,
    precision: AttentionPrecision,
) {
    check_dims(q, k, v, &dims, &mask);
    let AttentionDims {
        skv,
        batch: b,
        heads: a,
        groups: g,
        head_dim: d,
        ..
    } = dims;
    assert!(out.len() == q.len() && dout.len() == q.len() && dq.len() == q.len());
    assert!(lse.len() * d == q.len(), "attention: lse is not [sq, b, a]");
    let kv_len = skv * b * g * d;
    assert!(
        dk.len() == kv_len && dv.len() == kv_len,
        "attention: dk/dv are not [skv, b, g, d]"
    );
    let need = Need {
        kt: true,
        vt: true,
        kn: true,
        vn: false,
    };
    let ops = Operands::new([q, k, v], Some(dout), &dims, precision, need);
    let io = BackwardInputs {
        q,
        k,
        dout,
        lse,
        ops: &ops,
    };

    // Pass 1: δ, then dQ for tiles of query rows.
    let mut delta = vec![0f32; lse.len()];
    delta.par_iter_mut().enumerate().for_each(|(r, x)| {
        *x = dot(&dout[r * d..][..d], &out[r * d..][..d]);
    });
    dq.par_chunks_mut(TQ * b * a * d)
        .enumerate()
        .for_each_init(Scratch::default, |scratch, (ci, dqc)| {
            dq_chunk(&io, &delta, ci * TQ, dqc, scratch, &dims, mask)
        });

    // Pass 2: dK, dV per (batch, group, key block), into [b, g, skv, d] scratch.
    let mut dk_s = vec![0f32; kv_len];
    let mut dv_s = vec![0f32; kv_len];
    dk_s.par_chunks_mut(skv * d)
        .zip(dv_s.par_chunks_mut(skv * d))
        .enumerate()
        .for_each(|(jg, (dkg, dvg))| {
            dkg.par_chunks_mut(KB * d)
                .zip(dvg.par_chunks_mut(KB * d))
                .enumerate()
                .for_each_init(Scratch::default, |scratch, (blk, (dkb, dvb))| {
                    dkv_block(&io, &delta, jg, blk * KB, dkb, dvb, scratch, &dims, mask);
                });
        });

    // Back to [skv, b, g, d].
    for (dst, src) in [(dk, &dk_s), (dv, &dv_s)] {
        dst.par_chunks_mut(d).enumerate().for_each(|(r, row)| {
            let (p, jg) = (r / (b * g), r % (b * g));
            row.copy_from_slice(&src[(jg * skv + p) * d..][..d]);
        });
    }
}

struct BackwardInputs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    dout: &'a [f32],
    lse: &'a [f32],
    ops: &'a Operands,
}

/// `P` and `dS = P ⊙ (dP − δ)` of a tile against keys `p0..p0 + KB` (0 where not visible);
/// `P` from the same scaled-and-biased scores as the forward's logsumexp.
#[inline(always)]
fn probs_and_dscores<const ALIBI: bool>(
    io: &BackwardInputs,
    delta: &[f32],
    tile: &Tile,
    jg: usize,
    p0: usize,
    d: usize,
) -> ([[f32; KB]; RQ], [[f32; KB]; RQ]) {
    let mut p = io.ops.dots(Kv::K, jg, tile, io.q, p0, d);
    let mut ds = io.ops.dots(Kv::V, jg, tile, io.dout, p0, d);
    let scale = 1.0 / (d as f32).sqrt();
    for r in 0..RQ {
        let (lse, dl) = (io.lse[tile.row[r]], delta[tile.row[r]]);
        let (slope, d0) = (tile.slope[r], p0 as i32 - tile.q_pos[r] as i32);
        for l in 0..KB {
            let vis = p0 + l >= tile.lo[r] && p0 + l < tile.hi[r];
            let pr = if !vis {
                0.0
            } else if ALIBI {
                fast_exp(p[r][l] * scale + alibi_bias(slope, d0 + l as i32) - lse)
            } else {
                fast_exp(p[r][l] * scale - lse)
            };
            p[r][l] = pr;
            ds[r][l] = pr * (ds[r][l] - dl);
        }
    }
    (p, ds)
}

multiversion! {
    /// `dq` rows of time steps `t0..` (as many as `dq` holds).
    fn dq_chunk(io: &BackwardInputs, delta: &[f32], t0: usize, dq: &mut [f32], scratch: &mut Scratch, dims: &AttentionDims, mask: AttentionMask) {
        let AttentionDims { batch: b, heads: a, groups: g, head_dim: d, .. } = *dims;
        let (row0, n_rows) = (t0 * b * a, dq.len() / (b * a * d) * (a / g));
        dq.fill(0.0);
        for jg in 0..b * g {
            let k_row = |p: usize| &io.k[(p * b * g + jg) * d..][..d];
            for i0 in (0..n_rows).step_by(RQ) {
                let tile = Tile::new(t0, i0, RQ.min(n_rows - i0), jg, dims, mask);
                let keys = tile.keys();
                for p0 in (keys.start / KB * KB..keys.end).step_by(KB) {
                    let (_, ds) = match tile.alibi {
                        true => probs_and_dscores::<true>(io, delta, &tile, jg, p0, d),
                        false => probs_and_dscores::<false>(io, delta, &tile, jg, p0, d),
                    };
                    let (lo, hi) = (p0.max(keys.start), (p0 + KB).min(keys.end));
                    let mut emit = |r: usize, c0: usize, vals: &[f32]| {
                        if r < tile.n {
                            let o = &mut dq[(tile.row[r] - row0) * d + c0..][..vals.len()];
                            o.iter_mut().zip(vals).for_each(|(o, &x)| *o += x);
                        }
                    };
                    match io.ops {
                        Operands::F32(_) => tile_rows_product::<RQ>(d, hi - lo, |r, i| ds[r][lo - p0 + i], |i| k_row(lo + i), emit),
                        Operands::Bf16 { kv, .. } => {
                            let Scratch { pairs, prod, .. } = &mut *scratch;
                            prod.resize(RQ * d, 0.0);
                            let coef = std::array::from_fn(|r| &ds[r][..]);
                            kv.product(Kv::K, jg, lo..hi, (coef, p0), pairs, prod);
                            (0..RQ).for_each(|r| emit(r, 0, &prod[r * d..][..d]));
                        }
                    }
                }
            }
        }
        let scale = 1.0 / (d as f32).sqrt();
        dq.iter_mut().for_each(|x| *x *= scale);
    }
}

multiversion! {
    /// `dk, dv: [keys, d]` of the key block starting at `p0` of batch/group `jg`.
    fn dkv_block(
        io: &BackwardInputs,
        delta: &[f32],
        jg: usize,
        p0: usize,
        dk: &mut [f32],
        dv: &mut [f32],
        scratch: &mut Scratch,
        dims: &AttentionDims,
        mask: AttentionMask,
    ) {
        let AttentionDims { sq, heads: a, groups: g, head_dim: d, q_offset, kv_offset, .. } = *dims;
        let (nk, hpg) = (dk.len() / d, a / g);
        dk.fill(0.0);
        dv.fill(0.0);
        // Queries at positions `key..=last_pos` may see the block (window and document bounds
        // of its last key); the masks inside the tiles do the rest.
        let key = kv_offset + p0;
        let last_pos = mask.last_query(key + nk - 1, jg / g);
        let first_t = key.saturating_sub(q_offset);
        let end_t = last_pos.checked_sub(q_offset).map_or(0, |t| sq.min(t.saturating_add(1)));
        let paired_rows = match io.ops {
            Operands::Bf16 { rows, .. } => rows.as_ref(),
            Operands::F32(_) => None,
        };
        // The group's row list `n = t·hpg + hh` from `n_begin`; the bf16 products pair rows
        // `(2m, 2m + 1)`, so they start at an even index (an extra earlier row, which sees no
        // key of this block: its coefficients are 0).
        let n_begin = match paired_rows {
            Some(_) => first_t * hpg / 2 * 2,
            None => first_t * hpg,
        };
        let n_rows = (end_t * hpg).saturating_sub(n_begin) * usize::from(end_t > first_t);
        let Scratch { scores: buf, pairs: words, prod } = scratch;
        buf.resize(2 * QC * KB, 0.0);
        words.resize(QC * KB, 0);
        prod.resize(RQ * d, 0.0);
        let (pbuf, dsbuf) = buf.split_at_mut(QC * KB);
        let (pwords, dswords) = words.split_at_mut(QC / 2 * KB);
        let mut rows = [0usize; QC];
        for c0 in (0..n_rows).step_by(QC) {
            let nc = QC.min(n_rows - c0);
            for i0 in (0..nc).step_by(RQ) {
                let tile = Tile::new(0, n_begin + c0 + i0, RQ.min(nc - i0), jg, dims, mask);
                let (p, ds) = match tile.alibi {
                    true => probs_and_dscores::<true>(io, delta, &tile, jg, p0, d),
                    false => probs_and_dscores::<false>(io, delta, &tile, jg, p0, d),
                };
                if paired_rows.is_some() {
                    tile_pair_words(&p, i0, pwords);
                    tile_pair_words(&ds, i0, dswords);
                    continue;
                }
                for r in 0..tile.n {
                    rows[i0 + r] = tile.row[r];
                    pbuf[(i0 + r) * KB..][..KB].copy_from_slice(&p[r]);
                    dsbuf[(i0 + r) * KB..][..KB].copy_from_slice(&ds[r]);
                }
            }
            for k0 in (0..nk).step_by(RQ) {
                let sources = [
                    (&mut *dv, &*pbuf, &*pwords, io.dout, Side::Dout),
                    (&mut *dk, &*dsbuf, &*dswords, io.q, Side::Q),
                ];
                for (dst, coef, words, x, side) in sources {
                    let mut emit = |r: usize, c: usize, vals: &[f32]| {
                        if k0 + r < nk {
                            let o = &mut dst[(k0 + r) * d + c..][..vals.len()];
                            o.iter_mut().zip(vals).for_each(|(o, &x)| *o += x);
                        }
                    };
                    match paired_rows {
                        Some(paired) => {
                            let coefs = Coefs { data: words, row: std::array::from_fn(|r| k0 + r), stride: KB };
                            let rows = paired.from(side, jg, n_begin + c0);
                            rows_product_bf16(coefs, nc.div_ceil(2), rows, d, prod);
                            (0..RQ).for_each(|r| emit(r, 0, &prod[r * d..][..d]));
                        }
                        None => {
                            let coef = |r: usize, i: usize| coef[i * KB + k0 + r];
                            tile_rows_product::<RQ>(d, nc, coef, |i| &x[rows[i] * d..][..d], emit)
                        }
                    }
                }
            }
        }
        let scale = 1.0 / (d as f32).sqrt();
        dk.iter_mut().for_each(|x| *x *= scale);
    }
}
