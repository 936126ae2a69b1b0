//! Preprocessing inputs: JSONL, zstd JSONL, text by lines and by blocks, several JSON keys,
//! sentence lists, special tokens and EOD, bad lines (skipped and reported, or fatal in strict
//! mode). Uses a tiny word-level tokenizer so every expected token is known.

use ferrotron_data::Tokenizer;
use ferrotron_data::indexed::IndexedDataset;
use ferrotron_data::preprocess::{
    PreprocessConfig, PreprocessError, PreprocessReport, SkipReason, TextMode, document_tokens,
    output_prefix_for, preprocess_data,
};
use std::path::{Path, PathBuf};

/// Word-level vocabulary: [UNK]=0 <eod>=1 <s>=2 hello=3 world=4 the=5 cat=6 sat=7 on=8 mat=9
/// .=10 ,=11 !=12 dog=13. The post-processor prepends <s> when special tokens are added.
const TOKENIZER: &str = r#"{
 "version": "1.0", "truncation": null, "padding": null,
 "added_tokens": [
  {"id": 0, "content": "[UNK]", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
  {"id": 1, "content": "<eod>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
  {"id": 2, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
 "normalizer": null,
 "pre_tokenizer": {"type": "Whitespace"},
 "post_processor": {"type": "TemplateProcessing",
  "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
  "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
  "special_tokens": {"<s>": {"id": "<s>", "ids": [2], "tokens": ["<s>"]}}},
 "decoder": null,
 "model": {"type": "WordLevel", "unk_token": "[UNK]", "vocab": {"[UNK]": 0, "<eod>": 1, "<s>": 2,
  "hello": 3, "world": 4, "the": 5, "cat": 6, "sat": 7, "on": 8, "mat": 9, ".": 10, ",": 11,
  "!": 12, "dog": 13}}
}"#;

fn tokenizer(dir: &Path) -> Tokenizer {
    std::fs::write(dir.join("tokenizer.json"), TOKENIZER).unwrap();
    Tokenizer::from_dir(dir).unwrap()
}

/// Runs with `edit` applied to the default config (output prefix `dir/out`).
fn run(
    dir: &Path,
    inputs: &[PathBuf],
    edit: impl FnOnce(&mut PreprocessConfig),
) -> Result<PreprocessReport, PreprocessError> {
    let tok = tokenizer(dir);
    let mut cfg = PreprocessConfig::new(inputs.to_vec(), dir.join("out"));
    edit(&mut cfg);
    preprocess_data(&cfg, &tok, &mut |_| {})
}

/// Every document of output `key` as its token list.
fn docs(dir: &Path, key: &str) -> Vec<Vec<u32>> {
    let ds = IndexedDataset::open(&output_prefix_for(&dir.join("out"), key)).unwrap();
    (0..ds.num_documents())
        .map(|d| document_tokens(&ds, d).unwrap())
        .collect()
}

fn file(dir: &Path, name: &str, content: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, content).unwrap();
    p
}

#[test]
fn jsonl_documents_with_eod() {
    let tmp = tempfile::tempdir().unwrap();
    let input = file(
        tmp.path(),
        "in.jsonl",
        b"{\"text\": \"hello world!\"}\n{\"text\": \"the cat sat on the mat.\", \"id\": 3}\r\n\
          {\"text\": \"\"}\n\n{\"text\": \"the zebra\"}",
    );
    let report = run(tmp.path(), &[input], |c| c.append_eod = Some(1)).unwrap();
    assert_eq!(
        docs(tmp.path(), "text"),
        vec![
            vec![3, 4, 12, 1],
            vec![5, 6, 7, 8, 5, 9, 10, 1],
            vec![], // empty text: an empty document, no EOD (as Megatron)
            vec![5, 0, 1],
        ]
    );
    assert_eq!(report.documents, 4);
    assert_eq!(report.empty_documents, 1);
    assert_eq!(report.blank_lines, 1);
    assert_eq!(report.tokens, 4 + 8 + 3);
    assert_eq!(report.skipped, 0);
    assert_eq!(report.outputs.len(), 1);
    assert_eq!(report.outputs[0].documents, 4);
    assert_eq!(report.outputs[0].sequences, 3);
    assert_eq!(
        report.bytes_read,
        std::fs::metadata(tmp.path().join("in.jsonl"))
            .unwrap()
            .len()
    );
}

#[test]
fn sentence_lists_become_sequences_and_special_tokens_are_optional() {
    let tmp = tempfile::tempdir().unwrap();
    let input = file(
        tmp.path(),
        "in.jsonl",
        br#"{"text": ["hello world", "", "the dog"]}"#,
    );
    run(tmp.path(), std::slice::from_ref(&input), |c| {
        c.append_eod = Some(1)
    })
    .unwrap();
    let ds = IndexedDataset::open(&output_prefix_for(&tmp.path().join("out"), "text")).unwrap();
    // The empty sentence gives no sequence; EOD joins the last one.
    assert_eq!(ds.sequence_lengths(), &[2, 3]);
    assert_eq!(ds.sequence(1).unwrap(), vec![5, 13, 1]);
    run(tmp.path(), &[input], |c| c.add_special_tokens = true).unwrap();
    assert_eq!(docs(tmp.path(), "text"), vec![vec![2, 3, 4, 2, 2, 5, 13]]);
}

#[test]
fn several_keys_write_aligned_outputs() {
    let tmp = tempfile::tempdir().unwrap();
    let input = file(
        tmp.path(),
        "in.jsonl",
        b"{\"text\": \"hello\", \"title\": \"the cat\"}\n\
          {\"text\": \"world\"}\n\
          {\"title\": \"dog\", \"text\": \"mat\"}\n",
    );
    let report = run(tmp.path(), &[input], |c| {
        c.json_keys = vec!["text".into(), "title".into()]
    })
    .unwrap();
    // Line 2 lacks "title": skipped for both keys so the outputs stay aligned.
    assert_eq!(docs(tmp.path(), "text"), vec![vec![3], vec![9]]);
    assert_eq!(docs(tmp.path(), "title"), vec![vec![5, 6], vec![13]]);
    assert_eq!(report.skipped, 1);
    assert_eq!(report.skipped_examples[0].line, 2);
    assert_eq!(
        report.skipped_examples[0].reason,
        SkipReason::MissingKey("title".into())
    );
    let names: Vec<_> = report.outputs.iter().map(|o| o.key.as_str()).collect();
    assert_eq!(names, ["text", "title"]);
    assert!(report.outputs[1].prefix.ends_with("out_title_document"));
}

#[test]
fn zstd_jsonl_reads_like_plain_jsonl() {
    let tmp = tempfile::tempdir().unwrap();
    let text: String = (0..500)
        .map(|i| format!("{{\"text\": \"the cat {i} sat\"}}\n"))
        .collect();
    let compressed = zstd::encode_all(text.as_bytes(), 3).unwrap();
    let plain = file(tmp.path(), "a.jsonl", text.as_bytes());
    let zst = file(tmp.path(), "a.jsonl.zst", &compressed);
    run(tmp.path(), &[plain], |_| {}).unwrap();
    let want = docs(tmp.path(), "text");
    let report = run(tmp.path(), &[zst], |_| {}).unwrap();
    assert_eq!(docs(tmp.path(), "text"), want);
    assert_eq!(want.len(), 500);
    assert_eq!(report.bytes_read, text.len() as u64);
    assert_eq!(report.input_bytes, compressed.len() as u64);
}

#[test]
fn text_by_lines_and_by_blocks() {
    let tmp = tempfile::tempdir().unwrap();
    let content = b"hello world\r\nthe cat\n\n  \nthe dog\nsat\n\n\nmat";
    let input = file(tmp.path(), "in.txt", content);
    let report = run(tmp.path(), std::slice::from_ref(&input), |_| {}).unwrap();
    assert_eq!(
        docs(tmp.path(), "text"),
        vec![vec![3, 4], vec![5, 6], vec![5, 13], vec![7], vec![9]]
    );
    assert_eq!(report.blank_lines, 4);
    let report = run(tmp.path(), std::slice::from_ref(&input), |c| {
        c.text_mode = TextMode::Blocks
    })
    .unwrap();
    assert_eq!(
        docs(tmp.path(), "text"),
        vec![vec![3, 4, 5, 6], vec![5, 13, 7], vec![9]]
    );
    assert_eq!(report.documents, 3);
    // Text inputs name their output after the single key.
    run(tmp.path(), &[input], |c| c.json_keys = vec!["body".into()]).unwrap();
    assert_eq!(docs(tmp.path(), "body").len(), 5);
}

/// Bad lines of every kind, in order: (line, reason).
fn bad_input(dir: &Path) -> PathBuf {
    let mut content = Vec::new();
    content.extend_from_slice(b"{\"text\": \"hello\"}\n"); // 1 ok
    content.extend_from_slice(b"{\"text\": \"unterminated}\n"); // 2
    content.extend_from_slice(b"[\"text\"]\n"); // 3 not an object
    content.extend_from_slice(b"{\"body\": \"x\"}\n"); // 4 missing key
    content.extend_from_slice(b"{\"text\": 42}\n"); // 5 number
    content.extend_from_slice(b"{\"text\": \"caf\xe9\"}\n"); // 6 invalid UTF-8
    content.extend_from_slice(b"{\"text\": [\"a\", 1]}\n"); // 7 list with a number
    content.extend_from_slice(b"{\"text\": \"world\"}\n"); // 8 ok
    file(dir, "bad.jsonl", &content)
}

#[test]
fn bad_lines_are_skipped_counted_and_located() {
    let tmp = tempfile::tempdir().unwrap();
    let input = bad_input(tmp.path());
    let report = run(tmp.path(), std::slice::from_ref(&input), |_| {}).unwrap();
    assert_eq!(docs(tmp.path(), "text"), vec![vec![3], vec![4]]);
    assert_eq!(report.skipped, 6);
    let lines: Vec<u64> = report.skipped_examples.iter().map(|s| s.line).collect();
    assert_eq!(lines, [2, 3, 4, 5, 6, 7]);
    assert!(report.skipped_examples.iter().all(|s| s.path == input));
    let reasons: Vec<String> = report
        .skipped_examples
        .iter()
        .map(|s| s.reason.to_string())
        .collect();
    assert!(reasons[0].starts_with("invalid JSON"), "{}", reasons[0]);
    assert_eq!(reasons[1], "expected a JSON object, found array");
    assert_eq!(reasons[2], "missing key \"text\"");
    assert_eq!(
        reasons[3],
        "key \"text\" holds number, expected a string or a list of strings"
    );
    assert_eq!(reasons[4], "not valid UTF-8");
    assert!(reasons[5].contains("non-string"), "{}", reasons[5]);
}

#[test]
fn strict_mode_stops_at_the_first_bad_line_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let input = bad_input(tmp.path());
    let err = run(tmp.path(), std::slice::from_ref(&input), |c| {
        c.strict = true
    })
    .unwrap_err();
    match &err {
        PreprocessError::BadLine { path, line, .. } => {
            assert_eq!((path, *line), (&input, 2));
        }
        other => panic!("unexpected {other}"),
    }
    assert!(
        err.to_string().contains("bad.jsonl:2: invalid JSON"),
        "{err}"
    );
    let mut names: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["bad.jsonl", "tokenizer.json"]);
}

#[test]
fn config_and_input_errors_name_the_problem() {
    let tmp = tempfile::tempdir().unwrap();
    let txt = file(tmp.path(), "a.txt", b"hello\n");
    let err = run(tmp.path(), &[], |_| {}).unwrap_err();
    assert!(matches!(err, PreprocessError::Config(_)), "{err}");
    let err = run(tmp.path(), &[txt], |c| {
        c.json_keys = vec!["a".into(), "b".into()]
    })
    .unwrap_err();
    assert!(err.to_string().contains("a.txt"), "{err}");
    let missing = tmp.path().join("missing.jsonl");
    let err = run(tmp.path(), &[missing], |_| {}).unwrap_err();
    assert!(
        matches!(&err, PreprocessError::Io { path, .. } if path.ends_with("missing.jsonl")),
        "{err}"
    );
    let truncated = zstd::encode_all(&b"{\"text\": \"hello\"}\n".repeat(100)[..], 3).unwrap();
    let zst = file(tmp.path(), "t.jsonl.zst", &truncated[..truncated.len() / 2]);
    let err = run(tmp.path(), &[zst], |_| {}).unwrap_err();
    assert!(err.to_string().contains("t.jsonl.zst"), "{err}");
    assert!(!tmp.path().join("out_text_document.bin").exists());
}

#[test]
fn several_inputs_concatenate_in_order_with_per_file_line_numbers() {
    let tmp = tempfile::tempdir().unwrap();
    let a = file(tmp.path(), "a.jsonl", b"{\"text\": \"hello\"}\n{oops\n");
    let b = file(tmp.path(), "b.txt", b"the cat\n\nthe dog\n");
    let c = file(
        tmp.path(),
        "c.jsonl.zst",
        &zstd::encode_all(&b"{\"text\": \"mat\"}\n{\"text\": 1}\n"[..], 1).unwrap(),
    );
    let report = run(tmp.path(), &[a.clone(), b, c.clone()], |_| {}).unwrap();
    assert_eq!(
        docs(tmp.path(), "text"),
        vec![vec![3], vec![5, 6], vec![5, 13], vec![9]]
    );
    let located: Vec<(&Path, u64)> = report
        .skipped_examples
        .iter()
        .map(|s| (s.path.as_path(), s.line))
        .collect();
    assert_eq!(located, [(a.as_path(), 2), (c.as_path(), 2)]);
}
