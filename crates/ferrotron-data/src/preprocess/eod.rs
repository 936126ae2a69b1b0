//! Which token `--append-eod` appends.
//!
//! Megatron appends `tokenizer.eod`. For HF tokenizers both of Megatron's wrappers
//! (`_HuggingFaceTokenizer` in `megatron/training/tokenizer/tokenizer.py`, whose `eod` is
//! `self._tokenizer.eos_token_id`, and `megatron.core.tokenizers`' `HuggingFaceTokenizer`,
//! whose `eod` is the id of `eos_token`) take the tokenizer's `eos_token` from
//! `tokenizer_config.json`. That is [`EodToken::TokenizerEos`], the default, so that our
//! datasets equal Megatron's for the same tokenizer directory.
//!
//! For chat-tuned checkpoints this is the end-of-turn token: SmolLM2-Instruct's `eos_token` is
//! `<|im_end|>` (id 2), while its base model separates pretraining documents with
//! `<|endoftext|>` (id 0). Pass [`EodToken::Token`]`("<|endoftext|>")` (the CLI's
//! `--eod-token`) to use the document separator instead; training must then use the same id
//! for EOD masking and position resets.

use super::PreprocessError;
use crate::Tokenizer;
use serde_json::Value;
use std::path::Path;

/// How to choose the end-of-document token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EodToken {
    /// Megatron's choice: the id of `eos_token` in `tokenizer_config.json` (falling back to
    /// `special_tokens_map.json`).
    TokenizerEos,
    /// A token string of the vocabulary, e.g. `"<|endoftext|>"`.
    Token(String),
    /// A token id (must be below the vocabulary size).
    Id(u32),
}

/// `eos_token` as HF stores it: a string, or an AddedToken object with `content`.
fn token_string(v: &Value) -> Option<&str> {
    match v {
        Value::String(s) => Some(s),
        Value::Object(o) => o.get("content").and_then(Value::as_str),
        _ => None,
    }
}

/// Megatron's EOD id for the HF tokenizer in `tokenizer_dir`: the id of its `eos_token`.
///
/// Errors: neither `tokenizer_config.json` nor `special_tokens_map.json` names an
/// `eos_token` (or one cannot be parsed), or the token is not in the vocabulary.
pub fn megatron_eod_id(
    tokenizer_dir: &Path,
    tokenizer: &Tokenizer,
) -> Result<u32, PreprocessError> {
    let mut tried = Vec::new();
    for name in ["tokenizer_config.json", "special_tokens_map.json"] {
        let path = tokenizer_dir.join(name);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                tried.push(name);
                continue;
            }
            Err(source) => return Err(PreprocessError::Io { path, source }),
        };
        let json: Value = serde_json::from_str(&text).map_err(|e| PreprocessError::Eod {
            path: path.clone(),
            detail: format!("invalid JSON: {e}"),
        })?;
        let Some(token) = json.get("eos_token").and_then(token_string) else {
            tried.push(name);
            continue;
        };
        return tokenizer
            .token_to_id(token)
            .ok_or_else(|| PreprocessError::Eod {
                path,
                detail: format!("eos_token {token:?} is not in the tokenizer's vocabulary"),
            });
    }
    Err(PreprocessError::Eod {
        path: tokenizer_dir.to_path_buf(),
        detail: format!(
            "no eos_token in {}; choose the EOD token explicitly",
            tried.join(" or ")
        ),
    })
}

/// The EOD id for `choice` (see [`EodToken`]).
///
/// Errors: those of [`megatron_eod_id`]; a token string not in the vocabulary; an id not below
/// the vocabulary size.
pub fn resolve_eod(
    choice: &EodToken,
    tokenizer: &Tokenizer,
    tokenizer_dir: &Path,
) -> Result<u32, PreprocessError> {
    let bad = |detail: String| PreprocessError::Eod {
        path: tokenizer_dir.to_path_buf(),
        detail,
    };
    match choice {
        EodToken::TokenizerEos => megatron_eod_id(tokenizer_dir, tokenizer),
        EodToken::Token(t) => tokenizer
            .token_to_id(t)
            .ok_or_else(|| bad(format!("EOD token {t:?} is not in the vocabulary"))),
        EodToken::Id(id) if (*id as usize) < tokenizer.vocab_size() => Ok(*id),
        EodToken::Id(id) => Err(bad(format!(
            "EOD id {id} is not below the vocabulary size {}",
            tokenizer.vocab_size()
        ))),
    }
}
