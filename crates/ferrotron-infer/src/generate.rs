use crate::sampler::{Sampler, SamplingError, SamplingParams};
use ferrotron_model::lora::LoraWeights;
use ferrotron_model::{GptModel, KvCache, LogitsMode, ModelError, NewTokens};
use std::ops::ControlFlow;
use std::sync::Arc;

/// What to generate: the HF `generate` knobs Ferrotron supports.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Upper bound on generated tokens (HF `max_new_tokens`).
    pub max_new_tokens: usize,
    /// Greedy or sampled decoding, with HF logits-processor semantics.
    pub sampling: SamplingParams,
    /// Generation stops after emitting any of these (HF `eos_token_id`; the EOS is kept in the
    /// output, as transformers does).
    pub stop_token_ids: Vec<u32>,
    /// A LoRA adapter on every token (`None`: the model alone), computed as a served request
    /// with it computes ([`GptModel::forward_with_lora`]).
    pub lora: Option<Arc<LoraWeights>>,
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// A stop (EOS) token was generated.
    Eos,
    /// `max_new_tokens` were generated.
    MaxTokens,
    /// The token callback asked to stop.
    Callback,
}

/// The result of [`generate`].
#[derive(Clone, Debug)]
pub struct Generation {
    pub generated_ids: Vec<u32>,
    pub stop_reason: StopReason,
    /// Time spent on the prompt (prefill), seconds.
    pub prefill_seconds: f64,
    /// Time spent generating tokens after the prefill, seconds.
    pub decode_seconds: f64,
}

/// Errors from [`generate`].
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// The prompt is empty or too long for the model.
    #[error("{0}")]
    Prompt(String),
}

/// Autoregressive generation with a KV cache (HF `GenerationMixin.generate` for one sequence):
/// one prefill pass over `prompt_ids`, then one single-token pass per new token. `on_token` is
/// called with each new token (for streaming) and may stop generation early.
pub fn generate(
    model: &GptModel,
    prompt_ids: &[u32],
    options: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> ControlFlow<()>,
) -> Result<Generation, GenerateError> {
    if prompt_ids.is_empty() {
        return Err(GenerateError::Prompt(
            "the prompt encodes to zero tokens".into(),
        ));
    }
    let max_pos = model.config().max_position_embeddings;
    if prompt_ids.len() >= max_pos {
        return Err(GenerateError::Prompt(format!(
            "the prompt has {} tokens; the model allows {max_pos} positions",
            prompt_ids.len()
        )));
    }
    let capacity = (prompt_ids.len() + options.max_new_tokens).min(max_pos);
    let mut cache = KvCache::new(model.config(), 1, capacity)?;
    let mut sampler = Sampler::new(options.sampling)?;
    let mut history = prompt_ids.to_vec();
    let mut generated = Vec::with_capacity(options.max_new_tokens);
    let start = std::time::Instant::now();
    let lora = options.lora.as_deref();
    let prompt = NewTokens::Prompt;
    let mut logits =
        model.forward_with_lora(prompt_ids, &mut cache, LogitsMode::Last, lora, prompt)?;
    let prefill_seconds = start.elapsed().as_secs_f64();
    let decode_start = std::time::Instant::now();
    let mut stop_reason = StopReason::MaxTokens;
    while generated.len() < options.max_new_tokens {
        let token = sampler.sample(&mut logits, &history);
        generated.push(token);
        history.push(token);
        if on_token(token).is_break() {
            stop_reason = StopReason::Callback;
            break;
        }
        if options.stop_token_ids.contains(&token) {
            stop_reason = StopReason::Eos;
            break;
        }
        if generated.len() == options.max_new_tokens || cache.len() == cache.capacity() {
            break;
        }
        let generated = NewTokens::Generated;
        logits =
            model.forward_with_lora(&[token], &mut cache, LogitsMode::Last, lora, generated)?;
    }
    Ok(Generation {
        generated_ids: generated,
        stop_reason,
        prefill_seconds,
        decode_seconds: decode_start.elapsed().as_secs_f64(),
    })
}
