//! ALiBi, attention with linear biases (Press et al. 2022, "Train Short, Test Long"): no
//! position embeddings; query head `h` adds `slope_h·(j − i)` to the score of key position `j`
//! for the query at position `i`, a penalty growing linearly with the distance. Slopes as HF
//! `BloomForCausalLM` computes them (`transformers/models/bloom/modeling_bloom.py`,
//! `build_alibi_tensor` / `_get_alibi_slopes`).
//!
//! HF Bloom adds `slope_h·j` (the key position) instead of `slope_h·(j − i)`: the two differ by
//! `slope_h·i`, a constant along each query row, and the softmax is shift-invariant per row,
//! so the probabilities are the same (up to f32 rounding; the relative form keeps the bias
//! small next to the diagonal instead of growing with the absolute position). It also makes
//! the bias independent of where a packed document starts: `j − i` is the same whether
//! positions count from the row or from the document.
//!
//! Baichuan-13B (`_get_interleave` in its `modeling_baichuan.py`) uses the same formula but
//! evaluates it in Python f64 before rounding to f32, so some of its slopes differ from
//! Bloom's in the last bits (none for 4, 6 or 8 heads; 2 of 12 and 34 of Baichuan-13B's 40,
//! by at most 5·10⁻⁷ relative).

/// One ALiBi slope per attention head, as HF Bloom's `_get_alibi_slopes(num_heads)`: with
/// `c = 2^⌊log2 n⌋` (the closest power of two not above `n`) and `base = 2^(−2^−(log2 c − 3))`
/// (`= 2^(−8/c)`), the slopes `base¹, …, base^c`; for `n` not a power of two, then the first
/// `n − c` odd powers `extra¹, extra³, …` of `extra = 2^(−8/(2c))`.
///
/// Computed as HF does: the base is a Python (f64) float rounded to f32 (`torch.full(…,
/// dtype=torch.float32)`), then raised to integer powers in f32 (`torch.pow`), here as the
/// correctly rounded f32 power of the f32 base. So with 40 heads the 8th slope is `0.25000003`
/// (`(2^−1/4 rounded to f32)⁸`), not `0.25`, as in Bloom. Against transformers 5.23 / torch
/// 2.15 on an AVX-512 CPU: bit-identical for 1 to 31 heads; from 32 heads on, torch's
/// vectorized `pow` (SLEEF, 1-ulp accurate, used on whole 32-element chunks; its scalar tail
/// is correctly rounded) rounds a few slopes the other way, by one ulp (with 32 to 63 heads
/// only the 15th slope: torch `0x3d9837f2`, exact `0.07432546…` rounds to `0x3d9837f3`).
/// Which slopes those are depends on torch's SIMD width and device, so HF itself is not
/// reproducible to the last bit there.
///
/// For a tensor-parallel rank, pass the slice of its own heads to
/// [`AttentionMask::alibi_slopes`](super::AttentionMask::alibi_slopes).
///
/// # Panics
/// When `num_heads` is 0 (HF's `math.log2(0)` raises too).
pub fn alibi_slopes(num_heads: usize) -> Vec<f32> {
    assert!(num_heads > 0, "alibi_slopes: num_heads must be positive");
    let closest = 1usize << num_heads.ilog2();
    // `2 ** (-(2 ** -(math.log2(c) - 3)))` in f64, then `dtype=torch.float32`.
    let base = |c: usize| 2f64.powf(-(2f64.powf(-((c as f64).log2() - 3.0)))) as f32;
    // `torch.pow(base, powers)` in f32: the f32 rounding of `base^p`, taken from an f64
    // product whose error (at most `p` roundings of 2⁻⁵³) is far below half an f32 ulp.
    let pow = |base: f32, p: usize| (0..p).fold(1f64, |x, _| x * base as f64) as f32;
    let b = base(closest);
    let mut slopes: Vec<f32> = (1..=closest).map(|p| pow(b, p)).collect();
    if closest != num_heads {
        let extra = base(2 * closest);
        let remaining = closest.min(num_heads - closest);
        slopes.extend((0..remaining).map(|i| pow(extra, 2 * i + 1)));
    }
    slopes
}

/// The ALiBi bias `slope·distance` of a key at `distance = key − query` positions from its
/// query (`<= 0` under the causal mask, so the bias is `<= 0`). The distance converts to f32
/// exactly (below 2²⁴); the kernels all use this one formula with the same integer distance,
/// so the training forward's logsumexp and the backward's recomputed probabilities agree. An
/// `i32` distance (positions below 2³¹) keeps the conversion one vector instruction.
#[inline(always)]
pub(super) fn alibi_bias(slope: f32, distance: i32) -> f32 {
    slope * distance as f32
}
