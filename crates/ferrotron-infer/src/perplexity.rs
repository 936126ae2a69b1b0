//! Perplexity of a long text in windows, as llama.cpp's `llama-perplexity` measures it
//! (`tools/perplexity/perplexity.cpp`, `perplexity()`): the tokens are cut into windows of
//! `n_ctx`, each window runs alone (its first token replaced by BOS when the model adds one),
//! and only the second half of each window is scored — every scored token sees at least
//! `n_ctx / 2` tokens of context. The same windows and statistics give numbers comparable
//! with llama.cpp's on the same GGUF file.

use crate::sampler::log_softmax;
use ferrotron_model::{GptModel, KvCache, LogitsMode, ModelError};

/// How [`perplexity`] cuts and runs the text.
#[derive(Clone, Copy, Debug)]
pub struct PerplexityOptions {
    /// Tokens per window (`-c` of llama-perplexity).
    pub n_ctx: usize,
    /// Tokens per forward pass within a window (`-ub`): `n_ctx` runs each window at once
    /// (prompt arithmetic); 16 or fewer runs it with the decode kernels of a quantized model.
    pub ubatch: usize,
    /// The BOS id to put first in every window, when the tokenizer adds one.
    pub bos: Option<u32>,
}

/// Running totals of [`perplexity`].
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Perplexity {
    /// Windows scored.
    pub chunks: usize,
    /// Tokens scored.
    pub tokens: usize,
    /// Mean negative log-likelihood, nats per token.
    pub nll: f64,
    /// `exp(nll)`.
    pub ppl: f64,
    /// llama.cpp's uncertainty of `ppl`: `ppl · sqrt(var(nll) / (tokens - 1))`.
    pub ppl_stderr: f64,
    /// The estimate after each window.
    pub ppl_after_chunk: Vec<f64>,
}

/// The perplexity of `ids` under `model` (see the module doc); `on_chunk(i, running)` is
/// called after window `i`.
///
/// # Errors
/// Fewer than `2·n_ctx` tokens (llama-perplexity's minimum), `n_ctx < 2` or `ubatch == 0`,
/// or what the forward pass reports.
pub fn perplexity(
    model: &GptModel,
    ids: &[u32],
    opts: PerplexityOptions,
    mut on_chunk: impl FnMut(usize, &Perplexity),
) -> Result<Perplexity, ModelError> {
    let n_ctx = opts.n_ctx;
    if n_ctx < 2 || opts.ubatch == 0 || ids.len() < 2 * n_ctx {
        return Err(ModelError::Input(format!(
            "{} tokens with n_ctx {n_ctx} and ubatch {}: perplexity needs n_ctx >= 2, \
             ubatch >= 1 and at least 2·n_ctx tokens",
            ids.len(),
            opts.ubatch
        )));
    }
    let v = model.config().vocab_size;
    let first = n_ctx / 2;
    let (mut nll, mut nll2) = (0f64, 0f64);
    let mut out = Perplexity::default();
    let mut lp = vec![0f32; v];
    for (i, window) in ids.chunks_exact(n_ctx).enumerate() {
        let mut tokens = window.to_vec();
        if let Some(bos) = opts.bos {
            tokens[0] = bos;
        }
        let mut cache = KvCache::new(model.config(), 1, n_ctx)?;
        let mut logits = Vec::with_capacity(n_ctx * v);
        for piece in tokens.chunks(opts.ubatch) {
            logits.extend(model.forward(piece, &mut cache, LogitsMode::All)?);
        }
        for j in first..n_ctx - 1 {
            log_softmax(&logits[j * v..(j + 1) * v], &mut lp);
            let x = -f64::from(lp[tokens[j + 1] as usize]);
            nll += x;
            nll2 += x * x;
            out.tokens += 1;
        }
        out.chunks = i + 1;
        out.nll = nll / out.tokens as f64;
        out.ppl = out.nll.exp();
        out.ppl_after_chunk.push(out.ppl);
        let var = nll2 / out.tokens as f64 - out.nll * out.nll;
        out.ppl_stderr = if var > 0.0 && out.tokens > 1 {
            out.ppl * (var / (out.tokens - 1) as f64).sqrt()
        } else {
            0.0
        };
        on_chunk(i, &out);
    }
    Ok(out)
}
