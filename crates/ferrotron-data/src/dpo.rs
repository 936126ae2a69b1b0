//! Preference pairs for DPO (`data.dataset_type = "dpo"`, TRL's preference dataset forms):
//! JSONL records `{"prompt", "chosen", "rejected"}` with plain strings, or conversational
//! (`prompt` a list of messages, `chosen` / `rejected` an assistant message's text or a list
//! of messages), or TRL's implicit-prompt form (`chosen` / `rejected` whole conversations
//! sharing all but their last message); an optional `margin` (a number) is TRL's reward-model
//! margin, carried by both rows of the pair ([`GptSample::margin`]).
//!
//! Each side is tokenized as prompt + completion with the completion's tokens marked
//! ([`EncodedSample::trained`]): conversational ones through the chat template
//! ([`SftEncoder`], the last assistant turn's content and end token), plain ones as
//! `encode(prompt, add_special_tokens) + encode(completion) + [eos]` (TRL's `tokenize_row`).
//! A side longer than the sequence loses prompt tokens from its start first, then completion
//! tokens from its end. Pair `k` is rows `2k` (chosen) and `2k + 1` (rejected) of
//! [`DpoRows`], which the sampler keeps together in micro-batches of an even size.

use std::path::Path;
use std::sync::Arc;

use serde_json::Value;

use crate::chat::ChatMessage;
use crate::sft::{Conversation, EncodedSample, SftEncoder, SftError, build_sequence};
use crate::{Dataset, DatasetError, GptSample};

/// One tokenized preference pair: both sides share the prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct DpoPair {
    /// Prompt + preferred completion.
    pub chosen: EncodedSample,
    /// Prompt + dispreferred completion.
    pub rejected: EncodedSample,
    /// The record's `margin` (TRL's reward-model margin: how much more the chosen reward
    /// must be), 0 without one.
    pub margin: f32,
}

/// What loading a DPO file found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DpoReport {
    /// Pairs read.
    pub pairs: usize,
    /// Sides cut to the sequence length.
    pub truncated: usize,
}

/// The prompt of a record.
enum Prompt {
    Text(String),
    Chat(Vec<ChatMessage>),
}

/// Reads and tokenizes every pair of the JSONL file `path`, each side fitted to
/// `seq_length` tokens.
///
/// # Errors
/// An unreadable file; a line that is not a JSON object with the fields above, names the
/// line and field (e.g. `pairs.jsonl:7: missing field \`rejected\``); a side without
/// completion tokens; plain text without an EOS token in the tokenizer config.
pub fn load_dpo_jsonl(
    path: &Path,
    encoder: &SftEncoder,
    seq_length: usize,
) -> Result<(Vec<DpoPair>, DpoReport), SftError> {
    let text = std::fs::read_to_string(path).map_err(|source| SftError::Io {
        path: path.into(),
        source,
    })?;
    let mut pairs = Vec::new();
    let mut report = DpoReport::default();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let bad = |message: String| SftError::BadRecord {
            path: path.into(),
            line: i + 1,
            message,
        };
        let v: Value = serde_json::from_str(line).map_err(|e| bad(format!("not JSON: {e}")))?;
        let (prompt, chosen, rejected) = parse_record(&v).map_err(&bad)?;
        let mut side = |completion: &Vec<ChatMessage>, name: &str| {
            let sample = encode_side(encoder, &prompt, completion)
                .map_err(|e| bad(format!("{name}: {e}")))?;
            let (sample, cut) = fit(sample, seq_length);
            report.truncated += usize::from(cut);
            Ok::<_, SftError>(sample)
        };
        let margin = record_margin(&v).map_err(&bad)?;
        let pair = DpoPair {
            chosen: side(&chosen, "chosen")?,
            rejected: side(&rejected, "rejected")?,
            margin,
        };
        pairs.push(pair);
    }
    report.pairs = pairs.len();
    Ok((pairs, report))
}

/// `(prompt, chosen completion, rejected completion)` of a record; completions as the
/// messages that follow the prompt.
fn parse_record(v: &Value) -> Result<(Prompt, Vec<ChatMessage>, Vec<ChatMessage>), String> {
    if !v.is_object() {
        return Err("expected a JSON object with `chosen` and `rejected`".into());
    }
    let field = |name: &str| v.get(name).ok_or_else(|| format!("missing field `{name}`"));
    let (chosen, rejected) = (field("chosen")?, field("rejected")?);
    match v.get("prompt") {
        Some(Value::String(p)) => Ok((
            Prompt::Text(p.clone()),
            completion(chosen, "chosen")?,
            completion(rejected, "rejected")?,
        )),
        Some(Value::Array(_)) => Ok((
            Prompt::Chat(messages(&v["prompt"], "prompt")?),
            completion(chosen, "chosen")?,
            completion(rejected, "rejected")?,
        )),
        Some(_) => Err("field `prompt`: expected a string or a list of messages".into()),
        None => {
            // TRL's implicit prompt: all but the last message, the same on both sides.
            let (mut c, mut r) = (messages(chosen, "chosen")?, messages(rejected, "rejected")?);
            let (Some(c_last), Some(r_last)) = (c.pop(), r.pop()) else {
                return Err("`chosen` and `rejected` need at least one message".into());
            };
            if c != r {
                return Err(
                    "without `prompt`, `chosen` and `rejected` must share every \
                            message but their last"
                        .into(),
                );
            }
            Ok((Prompt::Chat(c), vec![c_last], vec![r_last]))
        }
    }
}

/// A record's optional `margin` (TRL's reward-model column), 0 without one.
fn record_margin(v: &Value) -> Result<f32, String> {
    match v.get("margin") {
        None | Some(Value::Null) => Ok(0.0),
        Some(m) => m
            .as_f64()
            .filter(|m| m.is_finite())
            .map(|m| m as f32)
            .ok_or_else(|| format!("field `margin`: expected a finite number, got {m}")),
    }
}

/// A completion: an assistant message's text, or a list of messages.
fn completion(v: &Value, name: &str) -> Result<Vec<ChatMessage>, String> {
    match v {
        Value::String(s) => Ok(vec![ChatMessage::new("assistant", s.clone())]),
        Value::Array(_) => messages(v, name),
        _ => Err(format!(
            "field `{name}`: expected a string or a list of messages"
        )),
    }
}

/// A list of `{"role", "content"}` messages.
fn messages(v: &Value, name: &str) -> Result<Vec<ChatMessage>, String> {
    let list = v
        .as_array()
        .ok_or_else(|| format!("field `{name}`: expected a list of messages"))?;
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let get = |k: &str| {
                m.get(k)
                    .and_then(Value::as_str)
                    .ok_or_else(|| format!("{name}[{i}].{k}: expected a string"))
            };
            Ok(ChatMessage::new(get("role")?, get("content")?))
        })
        .collect()
}

/// Prompt + `completion` tokenized, only the completion's last assistant turn marked.
fn encode_side(
    encoder: &SftEncoder,
    prompt: &Prompt,
    completion: &[ChatMessage],
) -> Result<EncodedSample, String> {
    match prompt {
        Prompt::Chat(p) => {
            let mut all = p.clone();
            all.extend_from_slice(completion);
            let mut sample = encoder.encode(&Conversation::Chat(all))?;
            keep_last_span(&mut sample.trained);
            Ok(sample)
        }
        Prompt::Text(p) => {
            let text: String = completion.iter().map(|m| m.content.as_str()).collect();
            let (_, eos) = encoder
                .eos()
                .ok_or("plain-text pairs need an eos_token in tokenizer_config.json")?;
            let tok = encoder.tokenizer();
            let mut tokens = tok.encode(p, true).map_err(|e| e.to_string())?;
            let n = tokens.len();
            tokens.extend(tok.encode(&text, false).map_err(|e| e.to_string())?);
            tokens.push(eos);
            let trained = (0..tokens.len()).map(|i| i >= n).collect();
            Ok(EncodedSample { tokens, trained })
        }
    }
}

/// Clears every mark before the last run of marked tokens.
fn keep_last_span(trained: &mut [bool]) {
    let Some(end) = trained.iter().rposition(|&t| t) else {
        return;
    };
    let start = trained[..end]
        .iter()
        .rposition(|&t| !t)
        .map_or(0, |i| i + 1);
    trained[..start].iter_mut().for_each(|t| *t = false);
}

/// `sample` cut to `s` tokens: prompt tokens from the start first (keeping the end of the
/// prompt, next to the completion), then completion tokens from the end. Returns whether it
/// was cut.
fn fit(mut sample: EncodedSample, s: usize) -> (EncodedSample, bool) {
    let n = sample.tokens.len();
    if n <= s {
        return (sample, false);
    }
    let prompt = sample.trained.iter().position(|&t| t).unwrap_or(n);
    let from_prompt = (n - s).min(prompt.saturating_sub(1));
    sample.tokens.drain(..from_prompt);
    sample.trained.drain(..from_prompt);
    sample.tokens.truncate(s);
    sample.trained.truncate(s);
    (sample, true)
}

/// The pairs as a [`Dataset`] of pair samples: sample `k` holds pair `k`'s chosen row then
/// its rejected row (`[2s]` each field), so splits and shuffled epochs move whole pairs;
/// [`DpoRows`] hands the rows out one at a time.
pub struct DpoPairs {
    pairs: Vec<DpoPair>,
    seq_length: usize,
    pad_id: u32,
}

impl DpoPairs {
    /// `pairs` laid out in rows of `seq_length` tokens, padded with `pad_id`.
    pub fn new(pairs: Vec<DpoPair>, seq_length: usize, pad_id: u32) -> DpoPairs {
        DpoPairs {
            pairs,
            seq_length,
            pad_id,
        }
    }
}

impl Dataset for DpoPairs {
    fn len(&self) -> usize {
        self.pairs.len()
    }

    fn get(&self, k: usize) -> Result<GptSample, DatasetError> {
        let pair = self.pairs.get(k).ok_or_else(|| {
            DatasetError::config("index", format!("pair {k} of {}", self.pairs.len()))
        })?;
        let row = |s: &EncodedSample| {
            GptSample::from(build_sequence(
                std::slice::from_ref(s),
                self.seq_length,
                self.pad_id,
            ))
        };
        let (mut c, r) = (row(&pair.chosen), row(&pair.rejected));
        c.tokens.extend(r.tokens);
        c.labels.extend(r.labels);
        c.loss_mask.extend(r.loss_mask);
        c.position_ids.extend(r.position_ids);
        c.segment_ids.extend(r.segment_ids);
        c.margin = pair.margin;
        Ok(c)
    }
}

/// Rows of a dataset of pair samples ([`DpoPairs`], possibly split and shuffled): row `2k`
/// is pair `k`'s chosen side, row `2k + 1` its rejected side.
pub struct DpoRows {
    pairs: Arc<dyn Dataset>,
    seq_length: usize,
}

impl DpoRows {
    /// The rows of `pairs`, each `seq_length` long.
    pub fn new(pairs: Arc<dyn Dataset>, seq_length: usize) -> DpoRows {
        DpoRows { pairs, seq_length }
    }
}

impl Dataset for DpoRows {
    fn len(&self) -> usize {
        2 * self.pairs.len()
    }

    fn get(&self, i: usize) -> Result<GptSample, DatasetError> {
        let pair = self.pairs.get(i / 2)?;
        let s = self.seq_length;
        let half = |v: Vec<u32>| v[(i % 2) * s..(i % 2 + 1) * s].to_vec();
        Ok(GptSample {
            loss_mask: pair.loss_mask[(i % 2) * s..(i % 2 + 1) * s].to_vec(),
            tokens: half(pair.tokens),
            labels: half(pair.labels),
            position_ids: half(pair.position_ids),
            segment_ids: half(pair.segment_ids),
            margin: pair.margin,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_span_is_kept_and_long_sides_lose_prompt_first() {
        let mut t = vec![false, true, true, false, true, true];
        keep_last_span(&mut t);
        assert_eq!(t, [false, false, false, false, true, true]);
        let sample = EncodedSample {
            tokens: (0..8).collect(),
            trained: (0..8).map(|i| i >= 5).collect(),
        };
        let (cut, was) = fit(sample.clone(), 6);
        assert!(was);
        assert_eq!(cut.tokens, [2, 3, 4, 5, 6, 7]);
        let (cut, _) = fit(sample, 3);
        assert_eq!(
            cut.tokens,
            [4, 5, 6],
            "one prompt token stays, the completion is cut"
        );
    }

    #[test]
    fn records_name_what_is_missing() {
        let p = |s: &str| {
            parse_record(&serde_json::from_str(s).unwrap())
                .err()
                .unwrap()
        };
        assert_eq!(
            p(r#"{"prompt": "a", "chosen": "b"}"#),
            "missing field `rejected`"
        );
        assert!(p(r#"{"prompt": 3, "chosen": "b", "rejected": "c"}"#).contains("`prompt`"));
        let implicit = r#"{"chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                          "rejected": [{"role": "user", "content": "z"}, {"role": "assistant", "content": "w"}]}"#;
        assert!(p(implicit).contains("share every message"));
        let margin = |s: &str| record_margin(&serde_json::from_str(s).unwrap());
        assert_eq!(margin(r#"{"margin": 0.5}"#), Ok(0.5));
        assert_eq!(margin(r#"{"margin": null}"#), Ok(0.0));
        assert_eq!(margin("{}"), Ok(0.0));
        assert!(
            margin(r#"{"margin": "big"}"#)
                .unwrap_err()
                .contains("`margin`")
        );
    }
}
