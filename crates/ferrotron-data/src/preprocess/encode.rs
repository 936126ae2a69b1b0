//! Turning a batch of raw records into token documents, on a worker thread. Mirrors
//! `Encoder.encode` in Megatron's `tools/preprocess_data.py`: each JSON key's value is a string
//! (one sentence) or a list of strings (sentences, as `--split-sentences` writes them); every
//! sentence with at least one token becomes one sequence; with an EOD id the last sequence of a
//! non-empty document gets it appended.

use super::input::Batch;
use super::{InputFormat, PreprocessError, SkipReason};
use crate::Tokenizer;
use serde_json::Value;
use std::path::Path;

/// The documents of one batch for one output key, back to back.
#[derive(Default)]
pub(crate) struct KeyDocs {
    /// All tokens of all documents.
    pub tokens: Vec<u32>,
    /// Token count of every sequence, in order.
    pub sequence_lengths: Vec<usize>,
    /// Number of sequences of every document, in order.
    pub doc_sequences: Vec<usize>,
}

/// A bad record found by a worker: (1-based line, reason).
pub(crate) type BadRecord = (u64, SkipReason);

/// The result of encoding one batch.
pub(crate) struct Encoded {
    pub seq: u64,
    pub file: usize,
    /// One entry per output key, in the order of the configured keys.
    pub keys: Vec<KeyDocs>,
    pub documents: u64,
    pub tokens: u64,
    pub bad: Vec<BadRecord>,
    pub blank_lines: u64,
    pub text_bytes: u64,
    pub input_pos: u64,
}

/// What the workers share (read-only).
pub(crate) struct EncodeSettings<'a> {
    pub tokenizer: &'a Tokenizer,
    pub keys: &'a [String],
    pub add_special_tokens: bool,
    pub eod: Option<u32>,
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// The sentences of one key of a JSON record, or why the record is bad.
fn sentences<'v>(
    obj: &'v serde_json::Map<String, Value>,
    key: &str,
) -> Result<Vec<&'v str>, SkipReason> {
    let value = obj
        .get(key)
        .ok_or_else(|| SkipReason::MissingKey(key.to_string()))?;
    let not_text = |found: &'static str| SkipReason::NotText {
        key: key.to_string(),
        found,
    };
    match value {
        Value::String(s) => Ok(vec![s.as_str()]),
        Value::Array(items) => items
            .iter()
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| not_text("array with a non-string item"))
            })
            .collect(),
        other => Err(not_text(json_type(other))),
    }
}

impl EncodeSettings<'_> {
    /// Appends one document made of `sentences` to `out`.
    fn encode_document(
        &self,
        sentences: &[&str],
        out: &mut KeyDocs,
        path: &Path,
        line: u64,
    ) -> Result<u64, PreprocessError> {
        let before = out.tokens.len();
        let mut n_seq = 0;
        for s in sentences {
            let ids = self
                .tokenizer
                .encode(s, self.add_special_tokens)
                .map_err(|e| PreprocessError::Tokenize {
                    path: path.to_path_buf(),
                    line,
                    message: e.to_string(),
                })?;
            if !ids.is_empty() {
                out.sequence_lengths.push(ids.len());
                out.tokens.extend_from_slice(&ids);
                n_seq += 1;
            }
        }
        if let (Some(eod), true) = (self.eod, n_seq > 0) {
            out.tokens.push(eod);
            *out.sequence_lengths.last_mut().expect("a sequence") += 1;
        }
        out.doc_sequences.push(n_seq);
        Ok((out.tokens.len() - before) as u64)
    }

    /// Encodes every record of `batch` from file `path` in format `format`.
    pub(crate) fn encode_batch(
        &self,
        batch: Batch,
        path: &Path,
        format: InputFormat,
    ) -> Result<Encoded, PreprocessError> {
        let mut out = Encoded {
            seq: batch.seq,
            file: batch.file,
            keys: (0..self.keys.len()).map(|_| KeyDocs::default()).collect(),
            documents: 0,
            tokens: 0,
            bad: Vec::new(),
            blank_lines: batch.blank_lines,
            text_bytes: batch.text_bytes,
            input_pos: batch.input_pos,
        };
        for rec in &batch.records {
            let Ok(text) = std::str::from_utf8(&batch.data[rec.start..rec.end]) else {
                out.bad.push((rec.line, SkipReason::InvalidUtf8));
                continue;
            };
            match format {
                InputFormat::Text => {
                    out.tokens +=
                        self.encode_document(&[text], &mut out.keys[0], path, rec.line)?;
                }
                InputFormat::Jsonl => {
                    let obj = match serde_json::from_str::<Value>(text) {
                        Ok(Value::Object(obj)) => obj,
                        Ok(other) => {
                            out.bad
                                .push((rec.line, SkipReason::NotObject(json_type(&other))));
                            continue;
                        }
                        Err(e) => {
                            out.bad
                                .push((rec.line, SkipReason::InvalidJson(e.to_string())));
                            continue;
                        }
                    };
                    // Check every key before encoding any, so that all outputs stay aligned.
                    let per_key: Result<Vec<_>, _> =
                        self.keys.iter().map(|k| sentences(&obj, k)).collect();
                    match per_key {
                        Ok(per_key) => {
                            for (docs, sents) in out.keys.iter_mut().zip(&per_key) {
                                out.tokens += self.encode_document(sents, docs, path, rec.line)?;
                            }
                        }
                        Err(reason) => {
                            out.bad.push((rec.line, reason));
                            continue;
                        }
                    }
                }
            }
            out.documents += 1;
        }
        Ok(out)
    }
}
