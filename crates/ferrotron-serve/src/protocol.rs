//! The request bodies of `/v1/completions` and `/v1/chat/completions` (OpenAI's fields with
//! vLLM's extras, `vllm/entrypoints/openai/protocol.py`) and their translation into engine
//! settings. Unknown fields are ignored, as OpenAI and vLLM do; a known field of the wrong
//! type or out of range is a 400 naming it.

use crate::error::{ApiError, parse_body};
use ferrotron_infer::engine::{RequestLimits, RequestParams};
use ferrotron_infer::sampler::SamplingParams;
use serde::Deserialize;

/// Most log-probabilities per token a request may ask for (vLLM's default `max_logprobs`).
pub const MAX_LOGPROBS: usize = 20;

/// `stop`: one string or a list.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The generation fields both endpoints share.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct SamplingFields {
    pub model: Option<String>,
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// vLLM extra: `-1` or `0` turn it off.
    pub top_k: Option<i64>,
    pub n: Option<usize>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub stop: Option<Stop>,
    /// vLLM extra: token ids that end generation (kept in the output).
    pub stop_token_ids: Option<Vec<u32>>,
    pub seed: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// vLLM extra: HF's repetition penalty over prompt and output.
    pub repetition_penalty: Option<f32>,
    /// vLLM extra: do not stop at the model's EOS.
    pub ignore_eos: Option<bool>,
    pub logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
}

/// `prompt` of `/v1/completions`: a string, strings, token ids, or lists of token ids.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

/// `POST /v1/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    pub echo: Option<bool>,
    /// Log-probabilities of the chosen token and this many alternatives.
    pub logprobs: Option<usize>,
    pub suffix: Option<String>,
    pub best_of: Option<usize>,
    /// The shared fields, parsed from the same body ([`parse_request`]).
    #[serde(skip)]
    pub sampling: SamplingFields,
}

/// One part of a message's content list.
#[derive(Clone, Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// A message's `content`: text, a list of parts, or null (an assistant turn with tool calls).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One chat message.
#[derive(Clone, Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
}

/// `POST /v1/chat/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatCompletionRequest {
    pub messages: Vec<Message>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<usize>,
    /// Preferred over the deprecated `max_tokens`.
    pub max_completion_tokens: Option<usize>,
    pub tools: Option<Vec<serde_json::Value>>,
    /// The shared fields, parsed from the same body ([`parse_request`]).
    #[serde(skip)]
    pub sampling: SamplingFields,
}

impl Message {
    /// The message's text: a string, or its text parts joined (other part types are a 400).
    pub fn text(&self, index: usize) -> Result<String, ApiError> {
        match &self.content {
            None => Ok(String::new()),
            Some(Content::Text(t)) => Ok(t.clone()),
            Some(Content::Parts(parts)) => parts
                .iter()
                .map(|p| match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => Ok(t.as_str()),
                    (kind, _) => Err(ApiError::bad_request(
                        format!("content parts of type {kind:?} are not supported (text only)"),
                        Some(&format!("messages[{index}].content")),
                    )),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(|t| t.concat()),
        }
    }
}

/// How one choice is generated: the engine's settings plus the stop strings the server
/// matches in the text.
#[derive(Clone, Debug)]
pub struct ChoiceParams {
    pub engine: RequestParams,
    pub stop_strings: Vec<String>,
    /// The model's EOS ids (a stop on them reports `stop_reason: null`).
    pub eos_token_ids: Vec<u32>,
}

/// What the endpoint contributes to [`SamplingFields::choice_params`].
pub struct EndpointDefaults {
    /// `max_tokens` when the request gives none (16 for completions, the rest of the context
    /// for chat).
    pub max_tokens: Option<usize>,
    /// Log-probabilities asked for (`None`: none).
    pub logprobs: Option<usize>,
    /// Log-probabilities of the prompt tokens too (completions' `echo` with `logprobs`).
    pub prompt_logprobs: Option<usize>,
}

impl SamplingFields {
    /// Choices per prompt (`n`, 1 by default, at most `max_n`).
    pub fn n(&self, max_n: usize) -> Result<usize, ApiError> {
        match self.n.unwrap_or(1) {
            n if (1..=max_n).contains(&n) => Ok(n),
            n => Err(ApiError::bad_request(
                format!("n must be between 1 and {max_n} (the server's --max-num-seqs), got {n}"),
                Some("n"),
            )),
        }
    }

    /// Engine settings for one choice of a prompt of `prompt_len` tokens, sampling with
    /// `seed`. Errors name the field: a context overflow (vLLM's wording), out-of-range
    /// values, unsupported `logit_bias`, unknown stop token ids, empty stop strings.
    pub fn choice_params(
        &self,
        prompt_len: usize,
        limits: RequestLimits,
        eos_token_ids: &[u32],
        endpoint: EndpointDefaults,
        seed: u64,
    ) -> Result<ChoiceParams, ApiError> {
        let max_tokens = self.max_tokens(prompt_len, limits.max_model_len, endpoint.max_tokens)?;
        let (stop_token_ids, stop_strings) = self.stops(limits.vocab_size, eos_token_ids)?;
        let engine = RequestParams {
            max_tokens,
            sampling: self.sampling(seed)?,
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            stop_token_ids,
            logprobs: endpoint.logprobs,
            prompt_logprobs: endpoint.prompt_logprobs,
        };
        Ok(ChoiceParams {
            engine,
            stop_strings,
            eos_token_ids: eos_token_ids.to_vec(),
        })
    }

    /// `max_tokens` (or the endpoint's default, else the rest of the context), checked against
    /// the context length with vLLM's wording.
    fn max_tokens(
        &self,
        prompt_len: usize,
        max_len: usize,
        default: Option<usize>,
    ) -> Result<usize, ApiError> {
        let bad = |m: String, p: &str| Err(ApiError::bad_request(m, Some(p)));
        if prompt_len >= max_len {
            return bad(
                format!(
                    "This model's maximum context length is {max_len} tokens. However, your \
                     prompt has {prompt_len} tokens, which leaves no room for output."
                ),
                "prompt",
            );
        }
        let room = max_len - prompt_len;
        let max_tokens = self.max_tokens.or(default).unwrap_or(room);
        if max_tokens == 0 {
            return bad("max_tokens must be at least 1".into(), "max_tokens");
        }
        if max_tokens > room {
            return bad(
                format!(
                    "This model's maximum context length is {max_len} tokens. However, you \
                     requested {} tokens ({prompt_len} in the prompt, {max_tokens} in the \
                     completion). Please reduce the length of the prompt or completion.",
                    prompt_len + max_tokens
                ),
                "max_tokens",
            );
        }
        Ok(max_tokens)
    }

    /// The sampler's settings (temperature 0: greedy), the penalties' ranges and the
    /// unsupported `logit_bias` checked.
    fn sampling(&self, seed: u64) -> Result<SamplingParams, ApiError> {
        let bad = |m: String, p: &str| Err(ApiError::bad_request(m, Some(p)));
        let temperature = self.temperature.unwrap_or(1.0);
        if !(temperature.is_finite() && temperature >= 0.0) {
            let m = format!("temperature must be >= 0, got {temperature}");
            return bad(m, "temperature");
        }
        let top_k = match self.top_k.unwrap_or(0) {
            -1 | 0 => 0,
            k if k > 0 => k as usize,
            k => return bad(format!("top_k must be -1 (off) or >= 1, got {k}"), "top_k"),
        };
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if let Some(v) = v.filter(|v| !(-2.0..=2.0).contains(v)) {
                return bad(format!("{name} must be in [-2, 2], got {v}"), name);
            }
        }
        if self.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
            return bad("logit_bias is not supported".into(), "logit_bias");
        }
        let greedy = temperature == 0.0;
        SamplingParams::new(
            greedy,
            if greedy { 1.0 } else { temperature },
            top_k,
            self.top_p.unwrap_or(1.0),
            self.repetition_penalty.unwrap_or(1.0),
            seed,
        )
        .map_err(|e| {
            let ferrotron_infer::sampler::SamplingError::InvalidParam { field, .. } = &e;
            ApiError::bad_request(e.to_string(), Some(field))
        })
    }

    /// The stop token ids (the request's, then the model's EOS unless `ignore_eos`) and the
    /// stop strings.
    fn stops(
        &self,
        vocab: usize,
        eos_token_ids: &[u32],
    ) -> Result<(Vec<u32>, Vec<String>), ApiError> {
        let bad = |m: String, p: &str| Err(ApiError::bad_request(m, Some(p)));
        let mut ids = self.stop_token_ids.clone().unwrap_or_default();
        if let Some(&t) = ids.iter().find(|&&t| t as usize >= vocab) {
            let m = format!("stop token id {t} is outside the vocabulary");
            return bad(m, "stop_token_ids");
        }
        if !self.ignore_eos.unwrap_or(false) {
            ids.extend_from_slice(eos_token_ids);
        }
        let strings = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if strings.iter().any(String::is_empty) {
            return bad("stop strings must not be empty".into(), "stop");
        }
        Ok((ids, strings))
    }
}

/// An endpoint's request body: its own fields and the shared [`SamplingFields`], each parsed
/// from the whole body (a type error names the field either way; serde's `flatten` would
/// lose the field's name).
pub trait EndpointRequest: serde::de::DeserializeOwned {
    fn sampling_mut(&mut self) -> &mut SamplingFields;
}

impl EndpointRequest for CompletionRequest {
    fn sampling_mut(&mut self) -> &mut SamplingFields {
        &mut self.sampling
    }
}

impl EndpointRequest for ChatCompletionRequest {
    fn sampling_mut(&mut self) -> &mut SamplingFields {
        &mut self.sampling
    }
}

/// Parses `body` as `T` with its [`SamplingFields`].
pub fn parse_request<T: EndpointRequest>(body: &[u8]) -> Result<T, ApiError> {
    let mut req: T = parse_body(body)?;
    *req.sampling_mut() = parse_body(body)?;
    Ok(req)
}

/// Checks a requested number of log-probabilities against [`MAX_LOGPROBS`].
pub fn check_logprobs(n: Option<usize>, param: &str) -> Result<Option<usize>, ApiError> {
    match n {
        Some(n) if n > MAX_LOGPROBS => Err(ApiError::bad_request(
            format!("{param} must be at most {MAX_LOGPROBS}, got {n}"),
            Some(param),
        )),
        n => Ok(n),
    }
}
