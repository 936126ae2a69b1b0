//! Preprocessing runs as a whole: output independent of the worker count, atomic outputs when
//! a run fails or is cancelled midway, progress reports, EOD resolution, dataset_info.

use ferrotron_data::Tokenizer;
use ferrotron_data::indexed::{IndexedDataset, TokenDtype, data_paths};
use ferrotron_data::preprocess::{
    EodToken, PreprocessConfig, PreprocessError, Progress, dataset_info, megatron_eod_id,
    output_prefix_for, preprocess_data, resolve_eod,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Word-level vocabulary of 300 words `w0`..`w299` (ids 2..302) plus [UNK]=0 and <eod>=1.
fn tokenizer(dir: &Path) -> Tokenizer {
    let mut vocab = serde_json::Map::new();
    vocab.insert("[UNK]".into(), 0.into());
    vocab.insert("<eod>".into(), 1.into());
    for i in 0..300 {
        vocab.insert(format!("w{i}"), (i + 2).into());
    }
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "unk_token": "[UNK]", "vocab": vocab}
    });
    std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
    Tokenizer::from_dir(dir).unwrap()
}

/// A JSONL corpus of `n` documents of 0-40 words, about 100 bytes each (several batches).
fn corpus(dir: &Path, n: usize, bad_at: Option<usize>) -> PathBuf {
    let mut s = String::new();
    let mut x = 12345u64;
    for i in 0..n {
        if Some(i) == bad_at {
            s.push_str("{not json\n");
            continue;
        }
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let words: Vec<String> = (0..(x >> 59) as usize + (x >> 40) as usize % 10)
            .map(|k| format!("w{}", (x >> (k % 32)) % 300))
            .collect();
        s.push_str(&serde_json::json!({ "text": words.join(" ") }).to_string());
        s.push('\n');
    }
    let p = dir.join("corpus.jsonl");
    std::fs::write(&p, s).unwrap();
    p
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

#[test]
fn output_does_not_depend_on_the_worker_count() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = tokenizer(tmp.path());
    let input = corpus(tmp.path(), 12_000, None);
    let mut outputs = Vec::new();
    for workers in [1, 3] {
        let mut cfg =
            PreprocessConfig::new(vec![input.clone()], tmp.path().join(format!("w{workers}")));
        cfg.workers = workers;
        cfg.append_eod = Some(1);
        let report = preprocess_data(&cfg, &tok, &mut |_| {}).unwrap();
        assert_eq!(report.documents, 12_000);
        let (bin, idx) = data_paths(&report.outputs[0].prefix);
        outputs.push((std::fs::read(bin).unwrap(), std::fs::read(idx).unwrap()));
    }
    assert!(
        outputs[0].0.len() > 128 << 10,
        "input spans several batches"
    );
    assert!(
        outputs[0] == outputs[1],
        "1 and 3 workers wrote different bytes"
    );
}

#[test]
fn progress_is_monotone_and_ends_at_the_report() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = tokenizer(tmp.path());
    let input = corpus(tmp.path(), 6_000, Some(10));
    let mut cfg = PreprocessConfig::new(vec![input.clone()], tmp.path().join("out"));
    cfg.workers = 2;
    let mut seen: Vec<Progress> = Vec::new();
    let report = preprocess_data(&cfg, &tok, &mut |p| seen.push(p.clone())).unwrap();
    assert!(seen.len() > 1);
    for w in seen.windows(2) {
        assert!(w[0].documents <= w[1].documents && w[0].tokens <= w[1].tokens);
        assert!(w[0].bytes <= w[1].bytes && w[0].input_bytes <= w[1].input_bytes);
    }
    let last = seen.last().unwrap();
    let size = std::fs::metadata(&input).unwrap().len();
    assert_eq!(last.input_bytes_total, size);
    assert_eq!(last.input_bytes, size);
    assert_eq!(
        (last.documents, last.tokens, last.bytes, last.skipped),
        (
            report.documents,
            report.tokens,
            report.bytes_read,
            report.skipped
        )
    );
    assert_eq!((report.documents, report.skipped), (5_999, 1));
}

#[test]
fn a_failure_midway_leaves_nothing_under_the_final_names() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = tokenizer(tmp.path());
    // Strict mode with a bad line after many batches were written.
    let input = corpus(tmp.path(), 12_000, Some(11_000));
    let before = names(tmp.path());
    let mut cfg = PreprocessConfig::new(vec![input.clone()], tmp.path().join("out"));
    cfg.strict = true;
    cfg.workers = 2;
    cfg.json_keys = vec!["text".into()];
    let mut batches = 0;
    let err = preprocess_data(&cfg, &tok, &mut |_| batches += 1).unwrap_err();
    assert!(
        matches!(err, PreprocessError::BadLine { line: 11_001, .. }),
        "{err}"
    );
    assert!(batches > 3, "failed after {batches} batches");
    assert_eq!(names(tmp.path()), before);

    // A token that does not fit the dtype (uint8 holds ids up to 255).
    cfg.strict = false;
    cfg.dtype = Some(TokenDtype::U8);
    let err = preprocess_data(&cfg, &tok, &mut |_| {}).unwrap_err();
    assert!(err.to_string().contains("does not fit uint8"), "{err}");
    assert!(err.to_string().contains("out_text_document.bin"), "{err}");
    assert_eq!(names(tmp.path()), before);
}

#[test]
fn cancelling_midway_leaves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = tokenizer(tmp.path());
    let input = corpus(tmp.path(), 12_000, None);
    let before = names(tmp.path());
    let flag = Arc::new(AtomicBool::new(false));
    let mut cfg = PreprocessConfig::new(vec![input], tmp.path().join("out"));
    cfg.cancel = Some(flag.clone());
    cfg.workers = 2;
    let err =
        preprocess_data(&cfg, &tok, &mut |_| flag.store(true, Ordering::Relaxed)).unwrap_err();
    assert!(matches!(err, PreprocessError::Cancelled), "{err}");
    assert_eq!(names(tmp.path()), before);
}

#[test]
fn eod_resolution() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = tokenizer(tmp.path());
    let dir = tmp.path();
    let err = megatron_eod_id(dir, &tok).unwrap_err();
    assert!(err.to_string().contains("no eos_token"), "{err}");
    std::fs::write(
        dir.join("special_tokens_map.json"),
        r#"{"eos_token": "w5"}"#,
    )
    .unwrap();
    assert_eq!(megatron_eod_id(dir, &tok).unwrap(), 7);
    // tokenizer_config.json wins; AddedToken objects are understood.
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"eos_token": {"content": "<eod>", "special": true}}"#,
    )
    .unwrap();
    assert_eq!(resolve_eod(&EodToken::TokenizerEos, &tok, dir).unwrap(), 1);
    assert_eq!(
        resolve_eod(&EodToken::Token("w0".into()), &tok, dir).unwrap(),
        2
    );
    assert_eq!(resolve_eod(&EodToken::Id(301), &tok, dir).unwrap(), 301);
    assert!(resolve_eod(&EodToken::Id(302), &tok, dir).is_err());
    assert!(resolve_eod(&EodToken::Token("nope".into()), &tok, dir).is_err());
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"eos_token": "zzz"}"#).unwrap();
    let err = megatron_eod_id(dir, &tok).unwrap_err();
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
}

#[test]
fn dataset_info_summarizes_the_output() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = tokenizer(tmp.path());
    let input = tmp.path().join("in.jsonl");
    std::fs::write(
        &input,
        "{\"text\": \"w1 w2 w3\"}\n{\"text\": \"\"}\n{\"text\": [\"w1\", \"w2 w3 w4 w5\"]}\n",
    )
    .unwrap();
    let cfg = PreprocessConfig::new(vec![input], tmp.path().join("out"));
    preprocess_data(&cfg, &tok, &mut |_| {}).unwrap();
    let prefix = output_prefix_for(&tmp.path().join("out"), "text");
    let info = dataset_info(&prefix).unwrap();
    assert_eq!(info.dtype, TokenDtype::U16);
    assert_eq!((info.documents, info.sequences, info.tokens), (3, 3, 8));
    assert_eq!(info.empty_documents, 1);
    assert_eq!((info.sequence_length.min, info.sequence_length.max), (1, 4));
    assert!((info.sequence_length.mean - 8.0 / 3.0).abs() < 1e-12);
    assert_eq!((info.document_length.min, info.document_length.max), (0, 5));
    assert_eq!(info.bin_bytes, 16);
    assert_eq!(info.idx_bytes, 34 + 3 * 12 + 4 * 8);
    let ds = IndexedDataset::open(&prefix).unwrap();
    assert_eq!(info.sequences, ds.len());
    assert!(dataset_info(&tmp.path().join("missing")).is_err());
}
