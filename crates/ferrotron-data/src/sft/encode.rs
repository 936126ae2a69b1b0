//! Rendering a [`Conversation`] to text and tokens with a per-token answer mask (Pai's
//! `JSONSFTDataset.preprocess` / `build_idxmap_sft_dataset.py` `Encoder.encode`, which compare
//! `apply_chat_template(messages[:-1])` with `apply_chat_template(messages)`).
//!
//! # Finding the answer spans
//! For every assistant message `k` of a chat (`full` = the template's rendering of all messages):
//! 1. `prompt_k` = render(`messages[..k]`, `add_generation_prompt=true`) and `through_k` =
//!    render(`messages[..=k]`, `false`); `prompt_k` must be a prefix of `through_k`, and
//!    `through_k` a prefix of `full` (templates that rewrite earlier turns once later ones follow
//!    cannot be masked turn by turn and are rejected);
//! 2. the answer span starts at `prompt_k.len()` and ends after the first end token (the
//!    tokenizer config's `eos_token`, e.g. `<|im_end|>`) that follows the (trimmed) content; when
//!    no end token is known or found, the span runs to `through_k.len()`.
//!
//! Tokenization and its check are in `sft/spans.rs` (`tokenize_spans`): `full` is tokenized
//! (`add_special_tokens=false`, as `apply_chat_template(tokenize=True)` does) piece by piece,
//! checked against the whole, falling back to tokenizing the text before each boundary; a record
//! whose answer boundary falls inside a token is rejected with the first differing position.
//!
//! Unlike Pai (which trains from the end of the rendered prompt without generation prompt, i.e.
//! including `<|im_start|>assistant\n` and the trailing `\n`), only content + end token are trained.
//!
//! # Alpaca without a chat template
//! `prompt = ALPACA_PROMPT_INPUT` (input non-empty) or `ALPACA_PROMPT_NO_INPUT`, with `{instruction}`
//! and `{input}` substituted; the text is `prompt + output + eos_token`, the answer span
//! `output + eos_token`. Tokens the post-processor adds to an empty text (Llama: BOS; GPT-2 style
//! BPE: none) are put in front, masked.

use std::ops::Range;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::SftError;
use super::source::Conversation;
use super::spans::tokenize_spans;
use crate::Tokenizer;
use crate::chat::{ChatMessage, ChatTemplate};

/// Stanford-alpaca prompt for records with a non-empty `input` (`{instruction}`, `{input}` are
/// replaced; the answer follows `### Response:\n` directly).
pub const ALPACA_PROMPT_INPUT: &str = "Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n";

/// Stanford-alpaca prompt for records without `input`.
pub const ALPACA_PROMPT_NO_INPUT: &str = "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n";

/// A tokenized sample: `tokens[i]` is an answer token (trained as a target) iff `trained[i]`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EncodedSample {
    /// Token ids `[n]`.
    pub tokens: Vec<u32>,
    /// `[n]`, true on answer content and its end token.
    pub trained: Vec<bool>,
}

impl EncodedSample {
    /// Number of tokens `n`.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// True when there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

/// Special tokens from `tokenizer_config.json` (strings or `{"content": ...}` objects).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub pad_token: Option<String>,
}

impl SpecialTokens {
    /// Reads `bos_token`, `eos_token`, `pad_token` from an HF `tokenizer_config.json`.
    pub fn from_tokenizer_config(path: &Path) -> Result<Self, SftError> {
        let text = std::fs::read_to_string(path).map_err(|source| SftError::Io {
            path: path.into(),
            source,
        })?;
        let config: Value = serde_json::from_str(&text).map_err(|e| SftError::Model {
            path: path.into(),
            message: format!("invalid JSON: {e}"),
        })?;
        let token = |name: &str| match &config[name] {
            Value::String(s) => Some(s.clone()),
            v => v["content"].as_str().map(String::from),
        };
        Ok(SpecialTokens {
            bos_token: token("bos_token"),
            eos_token: token("eos_token"),
            pad_token: token("pad_token"),
        })
    }
}

/// Renders and tokenizes SFT records for one model.
pub struct SftEncoder {
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    eos: Option<(String, u32)>,
    pad_id: u32,
    prefix_tokens: Vec<u32>,
    source: PathBuf,
}

impl SftEncoder {
    /// Loads `<dir>/tokenizer.json` and, when present, `<dir>/tokenizer_config.json` (special
    /// tokens; its chat template or a `chat_template.jinja` beside it).
    ///
    /// Errors: unreadable tokenizer or config, invalid template, special tokens missing from the
    /// vocabulary, no EOS token while there is no chat template.
    pub fn from_model_dir(dir: &Path) -> Result<Self, SftError> {
        let tokenizer = Tokenizer::from_dir(dir)?;
        let config = dir.join("tokenizer_config.json");
        if !config.is_file() {
            return Self::new(tokenizer, None, SpecialTokens::default(), dir);
        }
        let special = SpecialTokens::from_tokenizer_config(&config)?;
        let text = std::fs::read_to_string(&config).unwrap_or_default();
        let has_template = dir.join("chat_template.jinja").is_file()
            || serde_json::from_str::<Value>(&text).is_ok_and(|v| !v["chat_template"].is_null());
        let template = if has_template {
            Some(ChatTemplate::from_tokenizer_config(&config)?)
        } else {
            None
        };
        Self::new(tokenizer, template, special, dir)
    }

    /// An encoder from parts; `source` names the model in error messages.
    pub fn new(
        tokenizer: Tokenizer,
        template: Option<ChatTemplate>,
        special: SpecialTokens,
        source: &Path,
    ) -> Result<Self, SftError> {
        let model_err = |message: String| SftError::Model {
            path: source.into(),
            message,
        };
        let id_of = |name: &str, tok: &Option<String>| -> Result<Option<(String, u32)>, SftError> {
            match tok {
                None => Ok(None),
                Some(t) => match tokenizer.token_to_id(t) {
                    Some(id) => Ok(Some((t.clone(), id))),
                    None => Err(model_err(format!("{name} {t:?} is not in the vocabulary"))),
                },
            }
        };
        let eos = id_of("eos_token", &special.eos_token)?;
        let pad = id_of("pad_token", &special.pad_token)?;
        if template.is_none() && eos.is_none() {
            return Err(model_err(
                "no chat template and no eos_token: the alpaca prompt needs an EOS token to end answers"
                    .into(),
            ));
        }
        let pad_id = pad.or(eos.clone()).map_or(0, |(_, id)| id);
        let prefix_tokens = tokenizer.encode("", true)?;
        Ok(SftEncoder {
            tokenizer,
            template,
            eos,
            pad_id,
            prefix_tokens,
            source: source.into(),
        })
    }

    /// Drops the chat template so that alpaca records use the plain alpaca prompt (chat records
    /// then fail). Errors when there is no EOS token.
    pub fn without_chat_template(mut self) -> Result<Self, SftError> {
        if self.eos.is_none() {
            return Err(SftError::Model {
                path: self.source.clone(),
                message: "no eos_token: the alpaca prompt needs an EOS token to end answers".into(),
            });
        }
        self.template = None;
        Ok(self)
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The chat template, if any.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// Default padding id: the pad token, else the EOS token, else 0.
    pub fn default_pad_id(&self) -> u32 {
        self.pad_id
    }

    /// EOS token and id, if known.
    pub fn eos(&self) -> Option<(&str, u32)> {
        self.eos.as_ref().map(|(t, id)| (t.as_str(), *id))
    }

    /// Renders `conversation`: the full text and the byte ranges of its answer spans (sorted,
    /// disjoint). Errors are messages for the bad-record report.
    pub fn render(
        &self,
        conversation: &Conversation,
    ) -> Result<(String, Vec<Range<usize>>), String> {
        match (conversation, &self.template) {
            (Conversation::Chat(messages), Some(t)) => self.render_chat(t, messages),
            (Conversation::Chat(_), None) => {
                Err("chat record, but the tokenizer has no chat template".into())
            }
            (
                Conversation::Alpaca {
                    instruction,
                    input,
                    output,
                },
                Some(t),
            ) => {
                let user = if input.is_empty() {
                    instruction.clone()
                } else {
                    format!("{instruction}\n\n{input}")
                };
                let messages = [
                    ChatMessage::new("user", user),
                    ChatMessage::new("assistant", output.clone()),
                ];
                self.render_chat(t, &messages)
            }
            (
                Conversation::Alpaca {
                    instruction,
                    input,
                    output,
                },
                None,
            ) => {
                let prompt = if input.is_empty() {
                    ALPACA_PROMPT_NO_INPUT.replace("{instruction}", instruction)
                } else {
                    ALPACA_PROMPT_INPUT
                        .replacen("{instruction}", instruction, 1)
                        .replacen("{input}", input, 1)
                };
                let eos = self.eos.as_ref().map_or("", |(t, _)| t.as_str());
                let text = format!("{prompt}{output}{eos}");
                let span = prompt.len()..text.len();
                Ok((text, vec![span]))
            }
        }
    }

    fn render_chat(
        &self,
        t: &ChatTemplate,
        messages: &[ChatMessage],
    ) -> Result<(String, Vec<Range<usize>>), String> {
        let render = |m: &[ChatMessage], generation: bool| {
            t.render(m, generation)
                .map_err(|e| format!("chat template: {e}"))
        };
        let full = render(messages, false)?;
        let mut spans: Vec<Range<usize>> = Vec::new();
        for (k, m) in messages.iter().enumerate() {
            if m.role != "assistant" {
                continue;
            }
            let prompt = render(&messages[..k], true)?;
            let through = render(&messages[..=k], false)?;
            if !through.starts_with(&prompt) {
                return Err(format!(
                    "messages[{k}] (assistant): the template's rendering of the messages before it \
                     with add_generation_prompt=true is not a prefix of its rendering through it; \
                     cannot locate the answer"
                ));
            }
            if !full.starts_with(&through) {
                return Err(format!(
                    "messages[{k}] (assistant): the template renders this turn differently once \
                     later messages follow; cannot mask turns separately"
                ));
            }
            let region = &through[prompt.len()..];
            let content = m.content.trim();
            let after = region.find(content).map_or(0, |i| i + content.len());
            let end = match &self.eos {
                Some((eos, _)) => region[after..]
                    .find(eos.as_str())
                    .map_or(region.len(), |i| after + i + eos.len()),
                None => region.len(),
            };
            let span = prompt.len()..prompt.len() + end;
            if spans.last().is_some_and(|p| p.end > span.start) {
                return Err(format!(
                    "messages[{k}] (assistant): answer span overlaps the previous one"
                ));
            }
            if !span.is_empty() {
                spans.push(span);
            }
        }
        Ok((full, spans))
    }

    /// Renders and tokenizes `conversation`, marking answer tokens (see the module docs).
    /// Errors are messages for the bad-record report (template failures, span mismatches).
    pub fn encode(&self, conversation: &Conversation) -> Result<EncodedSample, String> {
        let (text, spans) = self.render(conversation)?;
        // Chat templates write BOS themselves when the model wants one (HF tokenizes their
        // output with add_special_tokens=false); only the plain alpaca prompt gets the prefix.
        let prefix: &[u32] = match self.template {
            Some(_) => &[],
            None => &self.prefix_tokens,
        };
        let mut out = tokenize_spans(&self.tokenizer, &text, &spans)?;
        out.tokens.splice(0..0, prefix.iter().copied());
        out.trained.splice(0..0, prefix.iter().map(|_| false));
        if !out.trained.iter().any(|&t| t) {
            return Err("no answer tokens after rendering (empty answers?)".into());
        }
        Ok(out)
    }
}
