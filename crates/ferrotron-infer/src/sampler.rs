//! Next-token selection with HuggingFace `generate` semantics.
//!
//! Mirrors transformers' `generation/logits_process.py` — `RepetitionPenaltyLogitsProcessor`,
//! `TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper` (all with
//! `min_tokens_to_keep = 1`) — applied in the order `GenerationMixin._get_logits_processor` builds
//! them, followed by the token choice of `GenerationMixin._sample`: `argmax` when
//! `do_sample=False`, `softmax` + `multinomial` otherwise. Warpers configured as "off" are skipped
//! exactly where HF skips adding them (`temperature == 1`, `top_k == 0`, `top_p == 1`,
//! `repetition_penalty == 1`).
//!
//! Everything before the random draw reproduces HF on the same f32 logits; the draw itself uses a
//! seeded ChaCha8 stream (reproducible per seed on every platform), not torch's generator. The only
//! known deviations from torch are summation order inside top-p's softmax/cumsum (last-ulp effects
//! at the `1 - top_p` boundary) and the order of exactly tied logits (torch's sort is unstable;
//! here ties are ordered by token id).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A [`SamplingParams`] field outside its valid range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// `field` holds `value`, which violates `requirement`.
    #[error("invalid sampling parameter `{field}` = {value}: {requirement}")]
    InvalidParam {
        /// Name of the offending field.
        field: &'static str,
        /// The rejected value.
        value: f32,
        /// What the field must satisfy.
        requirement: &'static str,
    },
}

/// Decoding settings, named like HF's `GenerationConfig` (`greedy` is `!do_sample`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// Pick the arg-max token (HF `do_sample=False`); temperature/top-k/top-p are then ignored.
    pub greedy: bool,
    /// Logits are divided by this before top-k/top-p; must be finite and > 0 when sampling.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (ties with the k-th are kept); 0 turns it off.
    pub top_k: usize,
    /// Nucleus sampling mass in (0, 1]; 1.0 turns it off.
    pub top_p: f32,
    /// CTRL-style repetition penalty (> 0); 1.0 turns it off. Also applies when greedy.
    pub repetition_penalty: f32,
    /// Seed of the sampler's random stream.
    pub seed: u64,
}

impl Default for SamplingParams {
    /// HF `GenerationConfig` defaults: `do_sample=False`, `temperature=1.0`, `top_k=50`,
    /// `top_p=1.0`, `repetition_penalty=1.0`; seed 0.
    fn default() -> Self {
        Self {
            greedy: true,
            temperature: 1.0,
            top_k: 50,
            top_p: 1.0,
            repetition_penalty: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Validating constructor; see [`SamplingParams::validate`].
    pub fn new(
        greedy: bool,
        temperature: f32,
        top_k: usize,
        top_p: f32,
        repetition_penalty: f32,
        seed: u64,
    ) -> Result<Self, SamplingError> {
        let params = Self {
            greedy,
            temperature,
            top_k,
            top_p,
            repetition_penalty,
            seed,
        };
        params.validate()?;
        Ok(params)
    }

    /// Greedy decoding with no repetition penalty (HF defaults).
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Checks every field, naming the first bad one: `temperature` must be finite and > 0 unless
    /// `greedy`; `top_p` must lie in (0, 1]; `repetition_penalty` must be finite and > 0.
    pub fn validate(&self) -> Result<(), SamplingError> {
        let bad = |field, value, requirement| {
            Err(SamplingError::InvalidParam {
                field,
                value,
                requirement,
            })
        };
        let temperature_ok = self.temperature.is_finite() && self.temperature > 0.0;
        if !self.greedy && !temperature_ok {
            return bad(
                "temperature",
                self.temperature,
                "must be finite and > 0 when sampling (greedy = false)",
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", self.top_p, "must be in (0, 1]");
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad(
                "repetition_penalty",
                self.repetition_penalty,
                "must be finite and > 0",
            );
        }
        Ok(())
    }
}

/// Picks next tokens from logits with HF `generate` semantics; owns the seeded RNG and scratch
/// buffers so that sampling a 49k vocabulary allocates nothing after the first call.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    tokens: Vec<u32>,
    values: Vec<f32>,
    candidates: Vec<(f32, u32)>,
    cumulative: Vec<f64>,
}

impl Sampler {
    /// Validates `params` and seeds the random stream with `params.seed`.
    pub fn new(params: SamplingParams) -> Result<Self, SamplingError> {
        params.validate()?;
        Ok(Self {
            params,
            rng: ChaCha8Rng::seed_from_u64(params.seed),
            tokens: Vec::new(),
            values: Vec::new(),
            candidates: Vec::new(),
            cumulative: Vec::new(),
        })
    }

    /// The settings this sampler was built with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Processes `logits` in place (repetition penalty, then — when sampling — temperature, top-k,
    /// top-p) and returns the chosen token id. `previous_tokens` is prompt + generated so far.
    ///
    /// If sampling meets degenerate logits (all `-inf`, a `+inf` or NaN), where torch's
    /// `multinomial` would raise, the arg-max token is returned instead.
    ///
    /// # Panics
    /// If `logits` is empty or a previous token id is `>= logits.len()`.
    pub fn sample(&mut self, logits: &mut [f32], previous_tokens: &[u32]) -> u32 {
        if self.process(logits, previous_tokens) {
            return argmax(logits);
        }
        multinomial(logits, &mut self.rng, &mut self.cumulative)
    }

    /// Speculative verification of a proposed token (a point-mass proposal, as prompt lookup
    /// makes): processes `logits` as [`Sampler::sample`] does, then keeps `draft` with
    /// probability `p(draft)` under the processed distribution and otherwise draws from `p`
    /// with `draft` removed — the rejection rule of Leviathan et al. (2023) and Chen et al.
    /// (2023) with `q = δ_draft`, so the token returned is distributed exactly as `sample`'s.
    /// Greedy: the arg-max (the draft is kept iff it is the arg-max).
    ///
    /// # Panics
    /// As [`Sampler::sample`], or a `draft >= logits.len()`.
    pub fn verify(&mut self, logits: &mut [f32], previous_tokens: &[u32], draft: u32) -> u32 {
        if self.process(logits, previous_tokens) {
            return argmax(logits);
        }
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let total: f64 = logits.iter().map(|&x| f64::from((x - max).exp())).sum();
        let p_draft = f64::from((logits[draft as usize] - max).exp()) / total;
        if !p_draft.is_finite() {
            return multinomial(logits, &mut self.rng, &mut self.cumulative);
        }
        if self.rng.random::<f64>() < p_draft {
            return draft;
        }
        logits[draft as usize] = f32::NEG_INFINITY;
        multinomial(logits, &mut self.rng, &mut self.cumulative)
    }

    /// The logits processors in HF's order (repetition penalty, then — when sampling —
    /// temperature, top-k, top-p), in place; returns whether the choice is greedy.
    fn process(&mut self, logits: &mut [f32], previous_tokens: &[u32]) -> bool {
        assert!(!logits.is_empty(), "Sampler::sample: empty logits");
        let p = self.params;
        if p.repetition_penalty != 1.0 {
            repetition_penalty_with(
                logits,
                previous_tokens,
                p.repetition_penalty,
                &mut self.tokens,
            );
        }
        if p.greedy {
            return true;
        }
        if p.temperature != 1.0 {
            apply_temperature(logits, p.temperature);
        }
        top_k_with(logits, p.top_k, &mut self.values);
        top_p_with(logits, p.top_p, &mut self.candidates);
        false
    }
}

/// HF `RepetitionPenaltyLogitsProcessor`: for every distinct token in `previous_tokens`,
/// `logit < 0 ? logit * penalty : logit / penalty` (applied once per token, like HF's
/// gather/scatter).
///
/// # Panics
/// If a token id is `>= logits.len()` (HF's `gather` raises there too).
pub fn apply_repetition_penalty(logits: &mut [f32], previous_tokens: &[u32], penalty: f32) {
    repetition_penalty_with(logits, previous_tokens, penalty, &mut Vec::new());
}

fn repetition_penalty_with(
    logits: &mut [f32],
    previous: &[u32],
    penalty: f32,
    tokens: &mut Vec<u32>,
) {
    tokens.clear();
    tokens.extend_from_slice(previous);
    tokens.sort_unstable();
    tokens.dedup();
    let vocab = logits.len();
    for &t in tokens.iter() {
        let x = logits.get_mut(t as usize).unwrap_or_else(|| {
            panic!("repetition penalty: token id {t} is outside the vocabulary ({vocab} logits)")
        });
        *x = if *x < 0.0 { *x * penalty } else { *x / penalty };
    }
}

/// HF `TemperatureLogitsWarper`: `logits / temperature` (f32 division, as torch does).
pub fn apply_temperature(logits: &mut [f32], temperature: f32) {
    logits.iter_mut().for_each(|x| *x /= temperature);
}

/// HF `TopKLogitsWarper`: sets to `-inf` every logit `< ` the k-th largest value, so ties with the
/// k-th value survive (HF's `scores < topk(scores, k)[0][..., -1]`). `top_k == 0` is a no-op (HF
/// does not add the warper); `top_k >= len` removes nothing. O(vocab) via `select_nth_unstable`.
pub fn apply_top_k(logits: &mut [f32], top_k: usize) {
    top_k_with(logits, top_k, &mut Vec::new());
}

fn top_k_with(logits: &mut [f32], top_k: usize, values: &mut Vec<f32>) {
    if top_k == 0 || top_k >= logits.len() {
        return;
    }
    values.clear();
    values.extend_from_slice(logits);
    // Descending total order: NaN counts as largest, like torch.topk.
    let (_, kth, _) = values.select_nth_unstable_by(top_k - 1, |a, b| b.total_cmp(a));
    let kth = *kth;
    logits
        .iter_mut()
        .filter(|x| **x < kth)
        .for_each(|x| *x = f32::NEG_INFINITY);
}

/// HF `TopPLogitsWarper` (`min_tokens_to_keep = 1`): sort ascending, take the cumulative softmax,
/// set to `-inf` the tokens whose cumulative probability is `<= 1 - top_p`, always keeping the
/// most likely token. `top_p >= 1` is a no-op (HF does not add the warper). Only finite-logit
/// candidates are sorted: after top-k about k of them; on a full vocabulary usually only the
/// largest 1024, once a `select_nth_unstable` partition shows the rest is removed wholesale.
///
/// Like torch, probabilities are f32, the cumsum accumulates in f64 and is compared in f32 with
/// `1 - top_p`, where `top_p` is read as the decimal a Python user would have typed
/// (`0.9f32` -> `0.9f64`) so the threshold equals HF's.
pub fn apply_top_p(logits: &mut [f32], top_p: f32) {
    top_p_with(logits, top_p, &mut Vec::new());
}

/// Without top-k, top-p sees the whole vocabulary; everything below the largest `TOP_P_HEAD`
/// candidates is first tested as one block (see `top_p_with`).
const TOP_P_HEAD: usize = 1024;

fn top_p_with(logits: &mut [f32], top_p: f32, candidates: &mut Vec<(f32, u32)>) {
    if top_p >= 1.0 {
        return;
    }
    let python_top_p: f64 = top_p.to_string().parse().unwrap_or(f64::from(top_p));
    let threshold = (1.0 - python_top_p) as f32;
    candidates.clear();
    let finite = logits
        .iter()
        .enumerate()
        .filter(|(_, x)| **x > f32::NEG_INFINITY);
    candidates.extend(finite.map(|(i, &x)| (x, i as u32)));
    let order = |a: &(f32, u32), b: &(f32, u32)| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1));
    let max = candidates.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.0));
    let sum: f64 = candidates
        .iter()
        .map(|c| f64::from((c.0 - max).exp()))
        .sum();
    let prob = |x: f32| f64::from((f64::from((x - max).exp()) / sum) as f32);
    let mut cumulative = 0f64;
    // The candidates below the head form one ascending prefix: if its total mass is <= the
    // threshold, so is every cumsum inside it; they all go and only the head is sorted.
    if candidates.len() > TOP_P_HEAD {
        let split = candidates.len() - TOP_P_HEAD;
        candidates.select_nth_unstable_by(split, order);
        let tail: f64 = candidates[..split].iter().map(|c| prob(c.0)).sum();
        if tail as f32 <= threshold {
            let removed = candidates.drain(..split);
            removed.for_each(|(_, id)| logits[id as usize] = f32::NEG_INFINITY);
            cumulative = tail;
        }
    }
    candidates.sort_unstable_by(order);
    // The last (largest) candidate is always kept: min_tokens_to_keep = 1.
    for &(x, id) in &candidates[..candidates.len().saturating_sub(1)] {
        cumulative += prob(x);
        if cumulative as f32 > threshold {
            break; // the cumsum is monotone: every later token survives too
        }
        logits[id as usize] = f32::NEG_INFINITY;
    }
}

/// `torch.argmax` over the last dimension: index of the first maximum (the first NaN, if any).
///
/// # Panics
/// If `logits` is empty.
pub fn argmax(logits: &[f32]) -> u32 {
    assert!(!logits.is_empty(), "argmax of empty logits");
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate().skip(1) {
        let b = logits[best];
        if b.is_nan() {
            break;
        }
        if x > b || x.is_nan() {
            best = i;
        }
    }
    best as u32
}

/// `softmax` then `torch.multinomial(probs, 1)`: one inverse-CDF draw from a uniform f64.
fn multinomial(logits: &[f32], rng: &mut ChaCha8Rng, cumulative: &mut Vec<f64>) -> u32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return argmax(logits);
    }
    cumulative.clear();
    let mut total = 0f64;
    for &x in logits {
        if x != f32::NEG_INFINITY {
            total += f64::from((x - max).exp()); // NaN propagates to the check below
        }
        cumulative.push(total);
    }
    if !total.is_finite() {
        return argmax(logits);
    }
    let target = rng.random::<f64>() * total;
    let idx = cumulative.partition_point(|&c| c <= target);
    if idx < logits.len() {
        return idx as u32;
    }
    // Rounding put the target at the very top: take the last token with non-zero probability.
    let last_positive = logits.iter().rposition(|&x| (x - max).exp() > 0.0);
    last_positive.unwrap_or(0) as u32
}

/// Numerically stable `log_softmax` (like `torch.log_softmax`): `x - max - ln(sum(exp(x - max)))`
/// with the sum in f64. All-`-inf` input gives NaN, as in torch.
///
/// # Panics
/// If `out.len() != logits.len()`.
pub fn log_softmax(logits: &[f32], out: &mut [f32]) {
    assert_eq!(
        logits.len(),
        out.len(),
        "log_softmax: output length must match logits"
    );
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&x| f64::from(x - max).exp()).sum();
    let log_sum = sum.ln();
    for (o, &x) in out.iter_mut().zip(logits) {
        *o = (f64::from(x - max) - log_sum) as f32;
    }
}
