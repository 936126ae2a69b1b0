//! Tokenizer built from GGUF metadata, against transformers 5.23's GGUF tokenizer conversion.
//!
//! The four vocabularies below were also written as GGUF files with gguf-py and loaded with
//! `AutoTokenizer.from_pretrained(dir, gguf_file=...)`; the expected added tokens and ids are
//! what transformers produced (it agrees with this crate's output on these and on the real
//! SmolLM2 file, whose reference is checked in `smollm2.rs`).

mod common;

use std::str::FromStr;

use common::{GgufBuilder, write};
use ferrotron_checkpoint::gguf::{
    GgufArray, GgufFile, GgufValue, bytes_to_unicode, hf_tokenizer_from_gguf,
};
use serde_json::Value;
use tokenizers::Tokenizer;

const MERGES: [&str; 14] = [
    "h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "1 2", "3 4",
    "12 3", "Ġ Ġ", "Ċ Ċ",
];

/// `prefix`, the 256 byte characters, the merge results, `suffix`; with their token types.
fn vocab(prefix: &[(&str, i32)], suffix: &[(&str, i32)]) -> (Vec<String>, Vec<i32>) {
    let mut toks: Vec<String> = prefix.iter().map(|(t, _)| t.to_string()).collect();
    let mut types: Vec<i32> = prefix.iter().map(|(_, t)| *t).collect();
    toks.extend(bytes_to_unicode().iter().map(|c| c.to_string()));
    types.extend(std::iter::repeat_n(1, 256));
    toks.extend(MERGES.iter().map(|m| m.replace(' ', "")));
    types.extend(std::iter::repeat_n(1, MERGES.len()));
    toks.extend(suffix.iter().map(|(t, _)| t.to_string()));
    types.extend(suffix.iter().map(|(_, t)| *t));
    (toks, types)
}

struct Case {
    prefix: &'static [(&'static str, i32)],
    suffix: &'static [(&'static str, i32)],
    with_types: bool,
    ids: &'static [(&'static str, u32)],
    flags: &'static [(&'static str, bool)],
    pre: Option<&'static str>,
}

fn build(case: &Case) -> (tempfile::TempDir, GgufFile) {
    let (toks, types) = vocab(case.prefix, case.suffix);
    let mut b = GgufBuilder::default();
    b.kv("general.architecture", GgufValue::String("llama".into()));
    b.kv("tokenizer.ggml.model", GgufValue::String("gpt2".into()));
    if let Some(p) = case.pre {
        b.kv("tokenizer.ggml.pre", GgufValue::String(p.into()));
    }
    b.kv(
        "tokenizer.ggml.tokens",
        GgufValue::Array(GgufArray::String(toks)),
    );
    if case.with_types {
        b.kv(
            "tokenizer.ggml.token_type",
            GgufValue::Array(GgufArray::I32(types)),
        );
    }
    let merges = MERGES.iter().map(|m| m.to_string()).collect();
    b.kv(
        "tokenizer.ggml.merges",
        GgufValue::Array(GgufArray::String(merges)),
    );
    for (k, v) in case.ids {
        b.kv(&format!("tokenizer.ggml.{k}"), GgufValue::U32(*v));
    }
    for (k, v) in case.flags {
        b.kv(&format!("tokenizer.ggml.{k}"), GgufValue::Bool(*v));
    }
    let dir = tempfile::tempdir().unwrap();
    let f = GgufFile::open(write(dir.path(), "tok.gguf", &b.build())).unwrap();
    (dir, f)
}

fn tokenizer(case: &Case) -> (Tokenizer, Value, Value) {
    let (_d, f) = build(case);
    let files = hf_tokenizer_from_gguf(&f, Some(64)).unwrap();
    let tok = Tokenizer::from_str(&files.tokenizer_json.to_string()).unwrap();
    (tok, files.tokenizer_json, files.tokenizer_config)
}

fn added(json: &Value) -> Vec<(u64, String, bool)> {
    json["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["id"].as_u64().unwrap(),
                t["content"].as_str().unwrap().to_string(),
                t["special"].as_bool().unwrap(),
            )
        })
        .collect()
}

fn ids(tok: &Tokenizer, text: &str) -> Vec<u32> {
    tok.encode(text, true).unwrap().get_ids().to_vec()
}

fn owned(v: &[(u64, &str, bool)]) -> Vec<(u64, String, bool)> {
    v.iter().map(|(i, s, b)| (*i, s.to_string(), *b)).collect()
}

#[test]
fn control_user_defined_duplicates_and_llama3_split() {
    // A control token outside the byte alphabet is skipped, so is a user-defined one; a control
    // duplicate of a byte token ("h") becomes special with the later id; a normal bos is added.
    let case = Case {
        prefix: &[
            ("<s>", 1),
            ("<|eot|>", 3),
            ("<｜begin▁of▁sentence｜>", 3),
            ("<think>", 4),
            ("</think>", 4),
            ("user def", 4),
            ("h", 3),
        ],
        suffix: &[],
        with_types: true,
        ids: &[
            ("bos_token_id", 0),
            ("eos_token_id", 1),
            ("padding_token_id", 3),
        ],
        flags: &[("add_bos_token", true), ("add_eos_token", true)],
        pre: Some("llama-bpe"),
    };
    let (tok, json, config) = tokenizer(&case);
    let want = [
        (0, "<s>", true),
        (1, "<|eot|>", true),
        (3, "<think>", false),
        (4, "</think>", false),
        (111, "h", true),
        (276, "<|endoftext|>", true),
    ];
    assert_eq!(added(&json), owned(&want));
    assert_eq!(ids(&tok, "hello world"), [0, 111, 108, 264, 118, 271, 1]);
    assert_eq!(
        ids(&tok, "Hello  World\n\n12345"),
        [
            0, 79, 108, 264, 118, 39, 39, 94, 268, 115, 107, 276, 274, 59, 60, 1
        ]
    );
    assert_eq!(
        ids(&tok, "<s>hello</s>"),
        [0, 0, 111, 108, 264, 118, 67, 54, 122, 69, 1]
    );
    assert_eq!(
        ids(&tok, "<think>hi</think> <|eot|>"),
        [0, 3, 111, 112, 4, 39, 1, 1]
    );
    assert_eq!(
        ids(&tok, "user def"),
        [0, 124, 122, 108, 121, 39, 107, 108, 109, 1]
    );
    assert_eq!(config["add_bos_token"], true);
    assert_eq!(config["add_eos_token"], true);
    assert_eq!(config["bos_token"], "<s>");
    assert_eq!(config["pad_token"], "<think>");
    assert_eq!(config["unk_token"], Value::Null);
    assert_eq!(config["model_max_length"], 64);
}

#[test]
fn special_token_outside_alphabet_gets_a_new_id_and_qwen2_split() {
    let case = Case {
        prefix: &[("<｜begin▁of▁sentence｜>", 3), ("<|im_end|>", 3)],
        suffix: &[],
        with_types: false,
        ids: &[
            ("bos_token_id", 0),
            ("eos_token_id", 1),
            ("unknown_token_id", 1),
        ],
        flags: &[("add_bos_token", true)],
        pre: Some("qwen2"),
    };
    let (tok, json, _) = tokenizer(&case);
    let want = [
        (1, "<|im_end|>", true),
        (272, "<|endoftext|>", true),
        (273, "<｜begin▁of▁sentence｜>", true),
    ];
    assert_eq!(added(&json), owned(&want));
    assert_eq!(ids(&tok, "hello world"), [273, 261, 266]);
    assert_eq!(
        ids(&tok, "Hello  World\n\n12345"),
        [
            273, 74, 103, 259, 113, 34, 34, 89, 263, 110, 102, 271, 51, 52, 53, 54, 55
        ]
    );
    assert_eq!(ids(&tok, "<｜begin▁of▁sentence｜>hello"), [273, 273, 261]);
    assert_eq!(
        ids(&tok, "<|endoftext|>x<|endoftext|>"),
        [273, 272, 122, 272]
    );
}

#[test]
fn endoftext_added_and_eos_appended_with_gpt2_regex() {
    let case = Case {
        prefix: &[("<eos>", 3), ("<pad>", 3)],
        suffix: &[("<|endoftext|>x", 4)],
        with_types: true,
        ids: &[("eos_token_id", 0), ("padding_token_id", 1)],
        flags: &[("add_eos_token", true)],
        pre: None,
    };
    let (tok, json, config) = tokenizer(&case);
    let want = [
        (0, "<eos>", true),
        (1, "<pad>", true),
        (272, "<|endoftext|>x", false),
        (273, "<|endoftext|>", true),
    ];
    assert_eq!(added(&json), owned(&want));
    assert_eq!(ids(&tok, "hello world"), [261, 266, 0]);
    assert_eq!(
        ids(&tok, "Hello  World\n\n12345"),
        [
            74, 103, 259, 113, 34, 34, 89, 263, 110, 102, 12, 12, 267, 268, 55, 0
        ]
    );
    assert_eq!(ids(&tok, "<|endoftext|>x<|endoftext|>"), [272, 273, 0]);
    assert_eq!(ids(&tok, "<eos><pad> hello"), [0, 1, 34, 261, 0]);
    assert_eq!(config["add_bos_token"], false);
    assert_eq!(config["bos_token"], Value::Null);
}

#[test]
fn user_defined_endoftext_stays_non_special_and_tekken_split() {
    let case = Case {
        prefix: &[("<|endoftext|>", 4), ("<bos>", 3)],
        suffix: &[],
        with_types: true,
        ids: &[("bos_token_id", 1), ("eos_token_id", 1)],
        flags: &[("add_bos_token", true), ("add_eos_token", true)],
        pre: Some("tekken"),
    };
    let (tok, json, _) = tokenizer(&case);
    assert_eq!(
        added(&json),
        owned(&[(0, "<|endoftext|>", false), (1, "<bos>", true)])
    );
    assert_eq!(ids(&tok, "hello world"), [1, 261, 266, 1]);
    assert_eq!(
        ids(&tok, "Hello  World\n\n12345"),
        [
            1, 74, 103, 259, 113, 34, 34, 89, 263, 110, 102, 271, 51, 52, 53, 54, 55, 1
        ]
    );
    assert_eq!(ids(&tok, "<bos>x<bos>"), [1, 1, 122, 1, 1]);
    assert_eq!(ids(&tok, "<|endoftext|>x<|endoftext|>"), [1, 0, 122, 0, 1]);
}

#[test]
fn tokenizer_metadata_errors() {
    let base = Case {
        prefix: &[],
        suffix: &[],
        with_types: true,
        ids: &[],
        flags: &[],
        pre: None,
    };
    let (_d, f) = build(&base);
    assert!(hf_tokenizer_from_gguf(&f, None).is_ok());

    let mut b = GgufBuilder::default();
    b.kv("tokenizer.ggml.model", GgufValue::String("gpt2".into()));
    b.kv(
        "tokenizer.ggml.tokens",
        GgufValue::Array(GgufArray::String(vec!["a".into(), "b".into()])),
    );
    let dir = tempfile::tempdir().unwrap();
    let f = GgufFile::open(write(dir.path(), "t.gguf", &b.build())).unwrap();
    let e = hf_tokenizer_from_gguf(&f, None).unwrap_err().to_string();
    assert_eq!(e, "t.gguf: tokenizer: tokenizer.ggml.merges is missing");

    b.kv(
        "tokenizer.ggml.merges",
        GgufValue::Array(GgufArray::String(vec!["a b c".into()])),
    );
    let f = GgufFile::open(write(dir.path(), "t.gguf", &b.build())).unwrap();
    let e = hf_tokenizer_from_gguf(&f, None).unwrap_err().to_string();
    assert!(
        e.contains("tokenizer.ggml.merges[0] = \"a b c\": expected two parts"),
        "{e}"
    );

    b.kv(
        "tokenizer.ggml.merges",
        GgufValue::Array(GgufArray::U8(vec![1])),
    );
    let f = GgufFile::open(write(dir.path(), "t.gguf", &b.build())).unwrap();
    let e = hf_tokenizer_from_gguf(&f, None).unwrap_err().to_string();
    assert!(
        e.contains("tokenizer.ggml.merges: expected an array of strings"),
        "{e}"
    );

    b.kv("tokenizer.ggml.model", GgufValue::String("t5".into()));
    let f = GgufFile::open(write(dir.path(), "t.gguf", &b.build())).unwrap();
    let e = hf_tokenizer_from_gguf(&f, None).unwrap_err().to_string();
    assert!(
        e.contains("tokenizer.ggml.model \"t5\" is not supported"),
        "{e}"
    );
}
