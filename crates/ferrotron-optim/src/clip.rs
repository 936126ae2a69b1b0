//! Gradient statistics and clipping by global L2 norm (Megatron-Core
//! megatron/core/optimizer/clip_grads.py), plus the fp16 unscale + inf/NaN check.
//!
//! Distributed use: each rank computes the sum of squares of the gradients it is responsible
//! for ([`grad_sq_sum`]), the sums are all-reduced (SUM) over the model-parallel group (and
//! the data-parallel group with the distributed optimizer), then
//! `total_norm = sqrt(sum)`, `clip_coeff = max_norm / (total_norm + 1e-6)` and grads are
//! scaled by it when it is < 1. [`clip_grad_norm`] does this with a caller-supplied reduction.

use rayon::prelude::*;

/// Added to the norm in the clip coefficient (Megatron `clip_grad_by_total_norm_fp32`).
pub const CLIP_EPS: f64 = 1.0e-6;

const PAR_CHUNK: usize = 64 * 1024;

/// Sum of squares of `grads`, accumulated in f64: each square is exact in f64, summed into
/// [`LANES`] running sums per chunk of [`PAR_CHUNK`] elements (16 for each of [`STREAMS`]
/// quarters of the chunk), the chunks' sums then added in order, so the result does not
/// depend on the thread count, the CPU's vector width or scheduling. NaN/inf propagate.
pub fn grad_sq_sum(grads: &[f32]) -> f64 {
    let partials: Vec<f64> = grads.par_chunks(PAR_CHUNK).map(chunk_sq_sum).collect();
    partials.iter().sum()
}

/// Independent running sums in [`chunk_sq_sum`]: eight AVX-512 registers of f64 sums in
/// flight, enough to cover the multiply-add's latency on two pipes (with 16, two registers,
/// the sum ran latency-bound at ~19 GB/s on a 2-core Xeon; the step's other passes reach ~40).
const LANES: usize = 64;

/// Parts of a chunk [`chunk_sq_sum`] reads side by side, [`LANES`]` / STREAMS` lanes each: one
/// core reads several streams faster than one (measured ~25 against ~19 GB/s on 2 cores of a
/// Xeon).
const STREAMS: usize = 4;
const _: () = assert!(STREAMS == 4, "chunk_sq_sum spells out four streams");

ferrotron_tensor::multiversion! {
    /// The sum of squares of one chunk, compiled for AVX-512, AVX2+FMA and baseline (the same
    /// bits: the lanes and their order are fixed, `mul_add` of an exact square is the same
    /// addition).
    fn chunk_sq_sum(c: &[f32]) -> f64 {
        const W: usize = LANES / STREAMS;
        let mut acc = [0f64; LANES];
        let part = c.len() / (STREAMS * W) * W;
        let (whole, rest) = c.split_at(STREAMS * part);
        // Spelled out for the four streams: an array of iterators measured ~5% slower.
        let (s01, s23) = whole.split_at(2 * part);
        let ((s0, s1), (s2, s3)) = (s01.split_at(part), s23.split_at(part));
        let blocks = s0.chunks_exact(W).zip(s1.chunks_exact(W));
        for ((b0, b1), (b2, b3)) in blocks.zip(s2.chunks_exact(W).zip(s3.chunks_exact(W))) {
            for (lanes, block) in acc.chunks_exact_mut(W).zip([b0, b1, b2, b3]) {
                for (a, &g) in lanes.iter_mut().zip(block) {
                    *a = f64::from(g).mul_add(f64::from(g), *a);
                }
            }
        }
        for (i, &g) in rest.iter().enumerate() {
            acc[i % LANES] = f64::from(g).mul_add(f64::from(g), acc[i % LANES]);
        }
        acc.iter().sum()
    }
}

/// `max_norm / (total_norm + 1e-6)`; grads are scaled by it only when it is < 1.
pub fn clip_coeff(max_norm: f64, total_norm: f64) -> f64 {
    max_norm / (total_norm + CLIP_EPS)
}

/// Multiplies `grads` by `factor` (f32, as Megatron's `multi_tensor_scale`).
pub fn scale_in_place(grads: &mut [f32], factor: f32) {
    grads
        .par_chunks_mut(PAR_CHUNK)
        .for_each(|c| c.iter_mut().for_each(|g| *g *= factor));
}

/// Clips `grads` (the slices this rank is responsible for) to global L2 norm `max_norm` and
/// returns the total norm before clipping. `reduce_sum` turns the local sum of squares into
/// the global one (identity on one rank; an all-reduce SUM across ranks). `norm_slices` are the
/// slices counted in the norm (e.g. without tensor-parallel duplicates); all `grads` are
/// scaled. A `max_norm <= 0` only measures the norm.
pub fn clip_grad_norm(
    norm_slices: &[&[f32]],
    grads: &mut [&mut [f32]],
    max_norm: f64,
    reduce_sum: impl FnOnce(f64) -> f64,
) -> f64 {
    let local: f64 = norm_slices.iter().map(|s| grad_sq_sum(s)).sum();
    let total_norm = reduce_sum(local).sqrt();
    if max_norm > 0.0 {
        let coeff = clip_coeff(max_norm, total_norm);
        if coeff < 1.0 {
            for g in grads.iter_mut() {
                scale_in_place(g, coeff as f32);
            }
        }
    }
    total_norm
}

/// Multiplies `grads` by `inv_scale` and reports whether any value was inf or NaN before
/// scaling (torch `_amp_foreach_non_finite_check_and_unscale_`, used by Megatron's
/// `_unscale_main_grads_and_check_for_nan`).
pub fn unscale_and_check_finite(grads: &mut [f32], inv_scale: f32) -> bool {
    grads
        .par_chunks_mut(PAR_CHUNK)
        .map(|c| {
            let mut found = false;
            for g in c.iter_mut() {
                found |= !g.is_finite();
                *g *= inv_scale;
            }
            found
        })
        .reduce(|| false, |a, b| a | b)
}
