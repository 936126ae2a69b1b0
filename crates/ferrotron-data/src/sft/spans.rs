//! Tokenizing a rendered text whose answer spans (byte ranges) must become token ranges.
//!
//! 1. **Pieces**: the text is cut at the span boundaries and each piece tokenized on its own;
//!    accepted when the concatenation equals the tokenization of the whole text. This is the
//!    common case for byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2) and is linear in the text.
//! 2. **Prefixes** (when 1 differs, e.g. SentencePiece tokenizers that prepend `▁` to every
//!    piece): for each boundary `b`, `text[..b]` is tokenized and must be a token prefix of the
//!    whole; its length is the boundary's token index (Pai compares `apply_chat_template(
//!    messages[:-1])` with the full ids the same way). Quadratic in the number of turns, so only
//!    a fallback.
//!
//! When neither holds, a token straddles an answer boundary (a BPE merge across it) and the
//! mask would be ambiguous: the record is rejected with the first differing position.

use std::ops::Range;

use super::encode::EncodedSample;
use crate::Tokenizer;

/// Tokens of `text` with `trained[i]` set on tokens inside `spans` (sorted, disjoint byte ranges
/// on char boundaries). Errors are messages for the bad-record report.
pub(super) fn tokenize_spans(
    tokenizer: &Tokenizer,
    text: &str,
    spans: &[Range<usize>],
) -> Result<EncodedSample, String> {
    let tok = |s: &str| {
        tokenizer
            .encode(s, false)
            .map_err(|e| format!("tokenizer: {e}"))
    };
    let mut out = EncodedSample::default();
    let mut pos = 0;
    let mut push = |piece: &str, trained: bool| -> Result<(), String> {
        let ids = tok(piece)?;
        out.trained.extend(std::iter::repeat_n(trained, ids.len()));
        out.tokens.extend(ids);
        Ok(())
    };
    for span in spans {
        push(&text[pos..span.start], false)?;
        push(&text[span.clone()], true)?;
        pos = span.end;
    }
    push(&text[pos..], false)?;
    let whole = tok(text)?;
    if whole == out.tokens {
        return Ok(out);
    }
    // Fallback: token index of every boundary from the tokenization of the text before it.
    let mut trained = vec![false; whole.len()];
    for span in spans {
        let mut at = [0; 2];
        for (k, b) in [span.start, span.end].into_iter().enumerate() {
            let ids = tok(&text[..b])?;
            if !whole.starts_with(&ids) {
                return Err(straddle(tokenizer, &ids, &whole, b));
            }
            at[k] = ids.len();
        }
        trained[at[0]..at[1]].fill(true);
    }
    Ok(EncodedSample {
        tokens: whole,
        trained,
    })
}

fn straddle(tokenizer: &Tokenizer, prefix: &[u32], whole: &[u32], byte: usize) -> String {
    let i = prefix.iter().zip(whole).take_while(|(a, b)| a == b).count();
    let show = |ids: &[u32]| {
        let tail = &ids[i.min(ids.len())..ids.len().min(i + 4)];
        tokenizer
            .decode(tail, false)
            .map_or_else(|_| format!("{tail:?}"), |s| format!("{s:?}"))
    };
    format!(
        "the text before the answer boundary at byte {byte} does not tokenize to a prefix of the \
         rendered text's tokens (they differ at token {i}: {} vs {}): a token spans an answer \
         boundary",
        show(prefix),
        show(whole)
    )
}
