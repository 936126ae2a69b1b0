//! HF `tokenizer.json` + `tokenizer_config.json` from a GGUF file's `tokenizer.ggml.*` metadata.
//!
//! Mirrors transformers 5.x `integrations/gguf/gguf_tokenizer_mapping.py` (`get_gguf_tokenizer`,
//! `byte_level_tokenizer`, `add_gguf_special_tokens`, `set_split_regex`) together with what
//! `GPT2Tokenizer` and `TokenizersBackend.__init__` / `update_post_processor`
//! (`tokenization_utils_tokenizers.py`) do to the backend tokenizer, so that encoding with the
//! written `tokenizer.json` is identical to `AutoTokenizer.from_pretrained(.., gguf_file=..)`:
//!
//! - model: byte-level BPE with the file's merges, no unk token, no prefix/suffix;
//!   a token using any character outside GPT-2's byte alphabet is re-spelled from its UTF-8
//!   bytes; with duplicate tokens the last index wins;
//! - pre-tokenizer: `ByteLevel(add_prefix_space=false)` with GPT-2's regex, or, for the
//!   `tokenizer.ggml.pre` values transformers knows (llama-bpe, qwen2, tekken, ...), that split
//!   regex followed by `ByteLevel(use_regex=false)`;
//! - added tokens, in transformers' order: `<|endoftext|>` (GPT2Tokenizer's default special
//!   token), then every CONTROL token (type 3) spelled in the byte alphabet as special, then
//!   every USER_DEFINED token (type 4) present in the vocab as non-special, then the bos, eos,
//!   unk and pad tokens not yet added, as special; ids follow `tokenizers`' AddedVocabulary;
//! - post-processor: `TemplateProcessing` adding bos/eos per `tokenizer.ggml.add_bos_token` /
//!   `add_eos_token` (default false).
//!
//! Only `tokenizer.ggml.model = "gpt2"` is supported.

use std::collections::HashMap;

use serde_json::{Map, Value, json};

use super::reader::GgufFile;
use crate::CheckpointError;

/// The two tokenizer files of an HF model directory.
#[derive(Debug, Clone, PartialEq)]
pub struct HfTokenizerFiles {
    /// Contents of `tokenizer.json` (the `tokenizers` library's serialization).
    pub tokenizer_json: Value,
    /// Contents of `tokenizer_config.json`: bos/eos/unk/pad token strings (or null),
    /// `add_bos_token`, `add_eos_token`, `chat_template` (from `tokenizer.chat_template`),
    /// `model_max_length`, `tokenizer_class`.
    pub tokenizer_config: Value,
    /// Number of entries in `added_tokens`.
    pub added_tokens: usize,
}

impl HfTokenizerFiles {
    /// Writes `tokenizer.json` and `tokenizer_config.json` into `dir` (created if needed);
    /// returns the bytes written.
    ///
    /// # Errors
    /// An I/O failure, naming the path.
    pub fn write(&self, dir: &std::path::Path) -> Result<u64, CheckpointError> {
        std::fs::create_dir_all(dir).map_err(|e| CheckpointError::io(dir, e))?;
        let bytes = crate::staging::write_json(dir, "tokenizer.json", &self.tokenizer_json)?;
        Ok(bytes
            + crate::staging::write_json(dir, "tokenizer_config.json", &self.tokenizer_config)?)
    }
}

/// ggml token types (`enum llama_token_type` in llama.cpp's `include/llama.h`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// `tokenizer.ggml.pre` values with their split regexes, as `GGUF_PRE_TOKENIZER_SPLITS`.
fn pre_tokenizer_split(pre: &str) -> Option<&'static str> {
    const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN35: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    Some(match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" | "dbrx" | "smaug-bpe" => LLAMA3,
        "tekken" => TEKKEN,
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => QWEN2,
        "qwen35" => QWEN35,
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => GPT4O,
        _ => return None,
    })
}

/// GPT-2's reversible byte -> character map (`bytes_to_unicode` in transformers'
/// `convert_slow_tokenizer.py` and the `tokenizers` ByteLevel pre-tokenizer).
pub fn bytes_to_unicode() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        out[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(256 + n).unwrap_or('\u{FFFD}');
            n += 1;
            c
        };
    }
    out
}

/// One entry of the simulated `AddedVocabulary`.
struct Added {
    id: u32,
    content: String,
    special: bool,
}

/// Replays `tokenizers`' `AddedVocabulary::add_tokens` id assignment (normalized = false,
/// no lstrip/rstrip/single_word, as every token transformers adds here).
struct AddedVocab<'a> {
    vocab: &'a HashMap<String, u32>,
    tokens: Vec<Added>,
    by_content: HashMap<String, usize>,
}

impl AddedVocab<'_> {
    /// One `add_tokens` call: ids for new contents start after the largest id so far.
    fn add(&mut self, batch: &[(String, bool)]) {
        let vocab_size = self.vocab.len() as u32;
        let mut next_id = match self.tokens.iter().map(|t| t.id).max() {
            None => vocab_size,
            Some(max) if max >= vocab_size || vocab_size == 0 => max + 1,
            Some(_) => vocab_size,
        };
        for (content, special) in batch {
            if content.is_empty() {
                continue;
            }
            if let Some(&i) = self.by_content.get(content) {
                // Same content again: identical properties are skipped, different ones replace
                // the entry's properties under the same id.
                self.tokens[i].special = *special;
                continue;
            }
            let id = match self.vocab.get(content) {
                Some(&id) => id,
                None => {
                    next_id += 1;
                    next_id - 1
                }
            };
            self.by_content.insert(content.clone(), self.tokens.len());
            self.tokens.push(Added {
                id,
                content: content.clone(),
                special: *special,
            });
        }
    }

    fn id_of(&self, content: &str) -> Option<u32> {
        match self.by_content.get(content) {
            Some(&i) => Some(self.tokens[i].id),
            None => self.vocab.get(content).copied(),
        }
    }
}

/// Builds the HF tokenizer files for `f`. `model_max_length` goes into `tokenizer_config.json`
/// (the converter passes `llama.context_length`).
///
/// # Errors
/// [`CheckpointError::Tokenizer`] if `tokenizer.ggml.model` is missing or not `gpt2`, tokens or
/// merges are missing or not string arrays, a merge is not two space-separated parts, a special
/// token id is out of range or names an empty token; [`CheckpointError::Metadata`] for keys of the
/// wrong type.
pub fn hf_tokenizer_from_gguf(
    f: &GgufFile,
    model_max_length: Option<u64>,
) -> Result<HfTokenizerFiles, CheckpointError> {
    check_tokenizer_model(f)?;
    let tokens = string_array(f, "tokenizer.ggml.tokens")?;
    let merges_raw = string_array(f, "tokenizer.ggml.merges")?;
    let token_types = token_types(f)?;
    if u32::try_from(tokens.len()).is_err() {
        return Err(tokenizer_err(
            f,
            format!("{} tokens do not fit 32-bit ids", tokens.len()),
        ));
    }

    let alphabet = bytes_to_unicode();
    let vocab = build_vocab(tokens, &alphabet);
    let merges = parse_merges(f, merges_raw)?;

    // Added tokens, in the order transformers adds them.
    let mut added = AddedVocab {
        vocab: &vocab,
        tokens: Vec::new(),
        by_content: HashMap::new(),
    };
    add_typed_tokens(&mut added, tokens, &token_types, &alphabet);
    let named = named_special_tokens(f, tokens)?;
    add_missing_named(&mut added, &named);

    let named_token = |n: &str| {
        named
            .iter()
            .find(|(k, _)| *k == n)
            .and_then(|(_, t)| t.clone())
    };
    let (bos, eos) = (named_token("bos_token"), named_token("eos_token"));
    let add_bos = f.opt_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(false) && bos.is_some();
    let add_eos = f.opt_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false) && eos.is_some();
    let post_processor = template_processing(
        add_bos
            .then(|| bos.clone())
            .flatten()
            .map(|t| (added.id_of(&t), t)),
        add_eos
            .then(|| eos.clone())
            .flatten()
            .map(|t| (added.id_of(&t), t)),
    );
    let pre_tokenizer = pre_tokenizer_json(f)?;
    let tokenizer_json = tokenizer_json(&added, merges, pre_tokenizer, post_processor);
    let config = tokenizer_config(f, add_bos, add_eos, &named, model_max_length)?;
    Ok(HfTokenizerFiles {
        tokenizer_json,
        tokenizer_config: config,
        added_tokens: added.tokens.len(),
    })
}

/// A [`CheckpointError::Tokenizer`] for `f` with `detail`.
fn tokenizer_err(f: &GgufFile, detail: String) -> CheckpointError {
    CheckpointError::Tokenizer {
        file: f.file_name().to_string(),
        detail,
    }
}

/// Checks that `tokenizer.ggml.model` is `gpt2` (byte-level BPE), the only supported model.
fn check_tokenizer_model(f: &GgufFile) -> Result<(), CheckpointError> {
    match f.opt_str("tokenizer.ggml.model")? {
        Some("gpt2") => Ok(()),
        Some(other) => Err(tokenizer_err(
            f,
            format!(
                "tokenizer.ggml.model {other:?} is not supported (expected \"gpt2\", byte-level BPE)"
            ),
        )),
        None => Err(tokenizer_err(
            f,
            "tokenizer.ggml.model is missing (expected \"gpt2\")".into(),
        )),
    }
}

/// The required string-array metadata `key`.
fn string_array<'a>(f: &'a GgufFile, key: &str) -> Result<&'a [String], CheckpointError> {
    f.opt_array(key)?
        .ok_or_else(|| tokenizer_err(f, format!("{key} is missing")))?
        .as_strings()
        .ok_or_else(|| tokenizer_err(f, format!("{key}: expected an array of strings")))
}

/// `tokenizer.ggml.token_type` as integers (empty when absent).
fn token_types(f: &GgufFile) -> Result<Vec<i64>, CheckpointError> {
    Ok(match f.opt_array("tokenizer.ggml.token_type")? {
        Some(a) => a.to_i64_vec().ok_or_else(|| {
            tokenizer_err(
                f,
                "tokenizer.ggml.token_type: expected an array of integers".into(),
            )
        })?,
        None => Vec::new(),
    })
}

/// Whether every character of `t` is in GPT-2's byte alphabet.
fn in_alphabet(alphabet: &[char; 256], t: &str) -> bool {
    t.chars().all(|c| alphabet.contains(&c))
}

/// Vocab: tokens in the byte alphabet as they are, others re-spelled; the last duplicate wins.
fn build_vocab(tokens: &[String], alphabet: &[char; 256]) -> HashMap<String, u32> {
    let mut vocab: HashMap<String, u32> = HashMap::with_capacity(tokens.len());
    for (i, t) in tokens.iter().enumerate() {
        let key = if in_alphabet(alphabet, t) {
            t.clone()
        } else {
            t.bytes().map(|b| alphabet[b as usize]).collect()
        };
        vocab.insert(key, i as u32);
    }
    vocab
}

/// The merges as `[left, right]` pairs, each raw merge being two parts separated by one space.
fn parse_merges(f: &GgufFile, merges_raw: &[String]) -> Result<Vec<Value>, CheckpointError> {
    let mut merges = Vec::with_capacity(merges_raw.len());
    for (i, m) in merges_raw.iter().enumerate() {
        let parts: Vec<&str> = m.split(' ').collect();
        if parts.len() != 2 {
            return Err(tokenizer_err(
                f,
                format!(
                    "tokenizer.ggml.merges[{i}] = {m:?}: expected two parts separated by one space"
                ),
            ));
        }
        merges.push(json!([parts[0], parts[1]]));
    }
    Ok(merges)
}

/// Adds `<|endoftext|>`, then the CONTROL tokens in the byte alphabet (special), then the
/// USER_DEFINED tokens already known (non-special), as transformers does.
fn add_typed_tokens(
    added: &mut AddedVocab<'_>,
    tokens: &[String],
    token_types: &[i64],
    alphabet: &[char; 256],
) {
    let typed = |ty: i64| {
        tokens
            .iter()
            .zip(token_types)
            .filter(move |(_, t)| **t == ty)
            .map(|(s, _)| s)
    };
    added.add(&[("<|endoftext|>".to_string(), true)]);
    let control: Vec<_> = typed(TOKEN_TYPE_CONTROL)
        .filter(|s| in_alphabet(alphabet, s))
        .map(|s| (s.clone(), true))
        .collect();
    added.add(&control);
    let user: Vec<_> = typed(TOKEN_TYPE_USER_DEFINED)
        .filter(|s| added.id_of(s).is_some())
        .map(|s| (s.clone(), false))
        .collect();
    added.add(&user);
}

/// The bos/eos/unk/pad token strings named by the `tokenizer.ggml.*_token_id` keys.
fn named_special_tokens(
    f: &GgufFile,
    tokens: &[String],
) -> Result<Vec<(&'static str, Option<String>)>, CheckpointError> {
    let mut named: Vec<(&str, Option<String>)> = Vec::new();
    for (name, key) in [
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ] {
        let token = match f.opt_u64(key)? {
            None => None,
            Some(id) => {
                let t = usize::try_from(id)
                    .ok()
                    .and_then(|i| tokens.get(i))
                    .ok_or_else(|| {
                        tokenizer_err(
                            f,
                            format!("{key} = {id} is out of range ({} tokens)", tokens.len()),
                        )
                    })?;
                if t.is_empty() {
                    return Err(tokenizer_err(
                        f,
                        format!("{key} = {id} names an empty token"),
                    ));
                }
                Some(t.clone())
            }
        };
        named.push((name, token));
    }
    Ok(named)
}

/// Adds the named special tokens not yet added, as special, in one batch.
fn add_missing_named(added: &mut AddedVocab<'_>, named: &[(&str, Option<String>)]) {
    let mut missing: Vec<(String, bool)> = Vec::new();
    for (_, t) in named {
        if let Some(t) = t
            && !added.by_content.contains_key(t)
            && !missing.iter().any(|(m, _)| m == t)
        {
            missing.push((t.clone(), true));
        }
    }
    added.add(&missing);
}

/// The pre-tokenizer: the `tokenizer.ggml.pre` split regex then byte-level, or GPT-2's byte-level.
fn pre_tokenizer_json(f: &GgufFile) -> Result<Value, CheckpointError> {
    Ok(
        match f
            .opt_str("tokenizer.ggml.pre")?
            .and_then(pre_tokenizer_split)
        {
            Some(regex) => json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
            ]}),
            None => {
                json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true})
            }
        },
    )
}

/// The `tokenizer.json` value: added tokens sorted by id, byte-level BPE model over the vocab.
fn tokenizer_json(
    added: &AddedVocab<'_>,
    merges: Vec<Value>,
    pre_tokenizer: Value,
    post_processor: Value,
) -> Value {
    let mut added_sorted: Vec<&Added> = added.tokens.iter().collect();
    added_sorted.sort_by_key(|t| t.id);
    let added_json: Vec<Value> = added_sorted
        .iter()
        .map(|t| {
            json!({"id": t.id, "content": t.content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": t.special})
        })
        .collect();
    let vocab_json: Map<String, Value> = added
        .vocab
        .iter()
        .map(|(k, &v)| (k.clone(), json!(v)))
        .collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_json,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab_json, "merges": merges,
        },
    })
}

/// The `tokenizer_config.json` value: add-bos/eos flags, named tokens, chat template, max length.
fn tokenizer_config(
    f: &GgufFile,
    add_bos: bool,
    add_eos: bool,
    named: &[(&str, Option<String>)],
    model_max_length: Option<u64>,
) -> Result<Value, CheckpointError> {
    let mut config = json!({
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": false,
        "tokenizer_class": "PreTrainedTokenizerFast",
    });
    if let Some(obj) = config.as_object_mut() {
        for (name, t) in named {
            obj.insert(name.to_string(), json!(t));
        }
        if let Some(tpl) = f.opt_str("tokenizer.chat_template")? {
            obj.insert("chat_template".into(), json!(tpl));
        }
        if let Some(n) = model_max_length {
            obj.insert("model_max_length".into(), json!(n));
        }
    }
    Ok(config)
}

/// `update_post_processor`: `"[bos:0 ]$A:0[ eos:0]"` and
/// `"[bos:0 ]$A:0[ eos:0][ bos:1] $B:1[ eos:1]"`, with each special token's id.
fn template_processing(
    bos: Option<(Option<u32>, String)>,
    eos: Option<(Option<u32>, String)>,
) -> Value {
    let special = |t: &str, type_id: u32| json!({"SpecialToken": {"id": t, "type_id": type_id}});
    let seq = |id: &str, type_id: u32| json!({"Sequence": {"id": id, "type_id": type_id}});
    let mut single = Vec::new();
    let mut pair = Vec::new();
    if let Some((_, t)) = &bos {
        single.push(special(t, 0));
    }
    single.push(seq("A", 0));
    if let Some((_, t)) = &eos {
        single.push(special(t, 0));
    }
    pair.extend(single.iter().cloned());
    if let Some((_, t)) = &bos {
        pair.push(special(t, 1));
    }
    pair.push(seq("B", 1));
    if let Some((_, t)) = &eos {
        pair.push(special(t, 1));
    }
    let mut specials = Map::new();
    for (id, t) in [bos, eos].into_iter().flatten() {
        specials.insert(
            t.clone(),
            json!({"id": t, "ids": id.into_iter().collect::<Vec<_>>(), "tokens": [t]}),
        );
    }
    json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials})
}
