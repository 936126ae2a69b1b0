//! Raw SFT datasets end to end with the tiny character-level ChatML tokenizer
//! (`fixtures/sft/tiny-chatml`): bad records with line numbers, format detection, padding and
//! packing invariants, truncate/drop counts. The idxmap form is tested in sft_idxmap.rs.

use std::path::{Path, PathBuf};

use ferrotron_data::sft::{
    IGNORE_INDEX, Overlong, RawSftDataset, SftEncoder, SftError, SftFormat, SftOptions, SftSample,
};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/sft")
}

fn tiny() -> SftEncoder {
    SftEncoder::from_model_dir(&fixtures().join("tiny-chatml")).unwrap()
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// Invariants every sequence must satisfy, whatever the options.
fn check_invariants(x: &SftSample, s: usize, pad_id: u32) {
    assert_eq!(
        [
            x.tokens.len(),
            x.labels.len(),
            x.loss_mask.len(),
            x.position_ids.len(),
            x.sample_ids.len()
        ],
        [s; 5]
    );
    let cu = x.cu_seqlens();
    for (seg, w) in cu.windows(2).enumerate() {
        for i in w[0]..w[1] {
            assert_eq!(x.sample_ids[i] as usize, seg);
            assert_eq!(x.position_ids[i] as usize, i - w[0]);
            let last = i + 1 == w[1];
            if last {
                assert_eq!(x.labels[i], IGNORE_INDEX, "no label crosses a sample end");
            } else if x.labels[i] != IGNORE_INDEX {
                assert_eq!(
                    x.labels[i],
                    x.tokens[i + 1] as i32,
                    "labels are shifted tokens"
                );
            }
        }
    }
    for i in 0..s {
        assert_eq!(
            x.loss_mask[i],
            if x.labels[i] == IGNORE_INDEX {
                0.0
            } else {
                1.0
            }
        );
    }
    // Trailing padding (if any): all pad ids, no loss.
    let pad_seg = *x.sample_ids.last().unwrap();
    let first = x.sample_ids.iter().position(|&i| i == pad_seg).unwrap();
    if x.labels[first..].iter().all(|&l| l == IGNORE_INDEX) && first > 0 {
        assert!(x.tokens[first..].iter().all(|&t| t == pad_id));
    }
}

#[test]
fn bad_jsonl_lines_are_skipped_with_line_numbers_or_fatal_when_strict() {
    let dir = tempfile::tempdir().unwrap();
    let text = [
        r#"{"instruction": "a", "input": "", "output": "b"}"#,
        r#"{not json"#,
        "",
        r#"{"instruction": "x"}"#,
        r#"{"instruction": 5, "output": "y"}"#,
        r#"{"instruction": "c", "output": "d"}"#,
        r#"{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]}"#,
        r#"[1, 2]"#,
    ]
    .join("\n");
    let p = write(dir.path(), "bad.jsonl", &text);
    let ds = RawSftDataset::load(&[p.as_path()], &tiny(), &SftOptions::new(256)).unwrap();
    let r = ds.report();
    assert_eq!((r.records, r.bad_records, ds.len()), (2, 5, 2));
    let lines: Vec<&str> = r
        .bad_examples
        .iter()
        .map(|e| e.split(": ").next().unwrap())
        .collect();
    let at = |l: usize| format!("{}:{l}", p.display());
    assert_eq!(lines, [at(2), at(4), at(5), at(7), at(8)]);
    assert!(
        r.bad_examples[0].contains("invalid JSON at column"),
        "{:?}",
        r.bad_examples
    );
    assert!(r.bad_examples[1].contains("missing string field `output`"));
    assert!(r.bad_examples[2].contains("field `instruction`: expected a string, found a number"));
    assert!(r.bad_examples[3].contains("detected as alpaca format at line 1"));
    let mut strict = SftOptions::new(256);
    strict.strict = true;
    match RawSftDataset::load(&[p.as_path()], &tiny(), &strict) {
        Err(SftError::BadRecord { line: 2, path, .. }) => assert_eq!(path, p),
        other => panic!("{other:?}"),
    }
}

#[test]
fn json_array_elements_report_their_start_line() {
    let dir = tempfile::tempdir().unwrap();
    let text = "[\n  {\"messages\": [{\"role\": \"user\", \"content\": \"q\"},\n    {\"role\": \"assistant\", \"content\": \"a\"}]},\n  {\"messages\": [{\"role\": \"user\", \"content\": \"q\"}]},\n  {\"messages\": [{\"role\": \"user\", \"content\": 3}, {\"role\": \"assistant\", \"content\": \"a\"}]}\n]\n";
    let p = write(dir.path(), "chat.json", text);
    let ds = RawSftDataset::load(&[p.as_path()], &tiny(), &SftOptions::new(256)).unwrap();
    let r = ds.report();
    assert_eq!((r.records, r.bad_records), (1, 2));
    let detected = "(file detected as chat format at line 2)";
    assert!(
        r.bad_examples[0].contains(":4: no `assistant` message: nothing to train on"),
        "{:?}",
        r.bad_examples
    );
    assert!(r.bad_examples[0].ends_with(detected));
    assert!(
        r.bad_examples[1].contains(":5: messages[0].content: expected a string, found a number")
    );
    // A syntax error inside an array stops that file at the error's line.
    let p = write(
        dir.path(),
        "broken.json",
        "[\n {\"instruction\": \"a\", \"output\": \"b\"},\n {\"instruction\": \"a\",, \n]",
    );
    let ds = RawSftDataset::load(&[p.as_path()], &tiny(), &SftOptions::new(256)).unwrap();
    assert_eq!((ds.report().records, ds.report().bad_records), (1, 1));
    assert!(
        ds.report().bad_examples[0].contains(":3: invalid JSON"),
        "{:?}",
        ds.report().bad_examples
    );
}

#[test]
fn leading_bom_and_blank_lines_keep_line_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let good = r#"{"instruction": "a", "output": "b"}"#;
    let p = write(
        dir.path(),
        "bom.jsonl",
        &format!("\u{feff}\n\n{good}\n{{oops\n"),
    );
    let ds = RawSftDataset::load(&[p.as_path()], &tiny(), &SftOptions::new(256)).unwrap();
    assert_eq!((ds.report().records, ds.report().bad_records), (1, 1));
    assert!(ds.report().bad_examples[0].contains(":4: invalid JSON"));
    let text = format!("\u{feff}\n[\n{good},\n{{\"instruction\": \"a\"}}]");
    let p = write(dir.path(), "bom.json", &text);
    let ds = RawSftDataset::load(&[p.as_path()], &tiny(), &SftOptions::new(256)).unwrap();
    assert_eq!((ds.report().records, ds.report().bad_records), (1, 1));
    let e = &ds.report().bad_examples[0];
    assert!(e.contains(":4: missing string field `output`"), "{e}");
    let p = write(dir.path(), "empty.json", " \n\n");
    let ds = RawSftDataset::load(&[p.as_path()], &tiny(), &SftOptions::new(256)).unwrap();
    assert_eq!(
        (ds.len(), ds.report().records, ds.report().bad_records),
        (0, 0, 0)
    );
}

#[test]
fn formats_are_detected_per_file_and_can_be_forced() {
    let f = fixtures();
    let (json, jsonl, chat) = (
        f.join("alpaca_sample.json"),
        f.join("alpaca_sample.jsonl"),
        f.join("chitchat_sample.jsonl"),
    );
    let files = [json.as_path(), jsonl.as_path(), chat.as_path()];
    let ds = RawSftDataset::load(&files, &tiny(), &SftOptions::new(8192)).unwrap();
    assert_eq!((ds.report().records, ds.report().bad_records), (62, 0));
    let mut forced = SftOptions::new(8192);
    forced.format = SftFormat::Chat;
    let ds = RawSftDataset::load(&files[..2], &tiny(), &forced).unwrap();
    assert_eq!((ds.report().records, ds.report().bad_records), (0, 12));
    assert!(ds.report().bad_examples[0].ends_with(":2: missing field `messages`"));
}

#[test]
fn padding_one_sample_per_sequence() {
    let f = fixtures().join("alpaca_sample.jsonl");
    let enc = tiny();
    let mut opts = SftOptions::new(400);
    let ds = RawSftDataset::load(&[f.as_path()], &enc, &opts).unwrap();
    assert_eq!(ds.len(), 6);
    for i in 0..ds.len() {
        let x = ds.get(i).unwrap();
        check_invariants(&x, 400, 0);
        let n = ds.group(i).unwrap()[0].len();
        assert_eq!(x.cu_seqlens(), [0, n, 400]);
        assert_eq!(x.tokens[..n], ds.group(i).unwrap()[0].tokens[..]);
        // The trained labels decode to exactly the answer and its end token.
        let targets: Vec<u32> = x
            .labels
            .iter()
            .filter(|&&l| l >= 0)
            .map(|&l| l as u32)
            .collect();
        let text = enc.tokenizer().decode(&targets, false).unwrap();
        assert!(text.ends_with("<|im_end|>"), "{text}");
    }
    assert!(matches!(
        ds.get(6),
        Err(SftError::OutOfRange { index: 6, len: 6 })
    ));
    opts.pad_id = Some(7);
    let ds = RawSftDataset::load(&[f.as_path()], &enc, &opts).unwrap();
    check_invariants(&ds.get(0).unwrap(), 400, 7);
    assert_eq!(*ds.get(0).unwrap().tokens.last().unwrap(), 7);
}

#[test]
fn packing_keeps_samples_whole_and_in_order() {
    let f = fixtures();
    let files = [f.join("alpaca_sample.json"), f.join("alpaca_sample.jsonl")];
    let files: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    let enc = tiny();
    let padded = RawSftDataset::load(&files, &enc, &SftOptions::new(700)).unwrap();
    let mut opts = SftOptions::new(700);
    opts.pack = true;
    let packed = RawSftDataset::load(&files, &enc, &opts).unwrap();
    assert!(
        packed.len() < padded.len() && packed.len() > 1,
        "{} vs {}",
        packed.len(),
        padded.len()
    );
    assert_eq!(
        packed.report().trained_tokens,
        padded.report().trained_tokens
    );
    let mut next = 0;
    for i in 0..packed.len() {
        let x = packed.get(i).unwrap();
        check_invariants(&x, 700, 0);
        let group = packed.group(i).unwrap();
        let cu = x.cu_seqlens();
        for (j, sample) in group.iter().enumerate() {
            assert_eq!(sample, &padded.group(next).unwrap()[0], "order kept");
            assert_eq!(x.tokens[cu[j]..cu[j + 1]], sample.tokens[..]);
            let alone = padded.get(next).unwrap();
            assert_eq!(x.labels[cu[j]..cu[j + 1]], alone.labels[..sample.len()]);
            next += 1;
        }
        // Greedy: the next sample would not have fit.
        if let Some(n) = padded.group(next) {
            assert!(cu[group.len()] + n[0].len() > 700);
        }
    }
    assert_eq!(next, padded.len());
}

fn long_records(dir: &Path) -> PathBuf {
    // Tiny ChatML prompt = 50 tokens + instruction; answer = output + <|im_end|>; then "\n".
    let rec = |i: usize, o: usize| {
        format!(
            "{{\"instruction\": \"{}\", \"output\": \"{}\"}}\n",
            "x".repeat(i),
            "y".repeat(o)
        )
    };
    let text = [
        rec(10, 10),
        rec(10, 100),
        rec(100, 10),
        rec(49, 10),
        rec(50, 10),
    ]
    .concat();
    write(dir, "long.jsonl", &text)
}

#[test]
fn overlong_samples_truncate_or_drop_with_counts() {
    let dir = tempfile::tempdir().unwrap();
    let p = long_records(dir.path());
    let enc = tiny();
    let mut opts = SftOptions::new(100);
    let ds = RawSftDataset::load(&[p.as_path()], &enc, &opts).unwrap();
    let r = ds.report();
    assert_eq!(
        (
            r.records,
            r.truncated,
            r.dropped_no_answer,
            r.dropped_overlong
        ),
        (5, 2, 2, 0)
    );
    assert_eq!((r.samples, ds.len()), (3, 3));
    assert_eq!(ds.group(0).unwrap()[0].len(), 72);
    // Truncated: head kept, 100 tokens, answer tail cut.
    let x = ds.get(1).unwrap();
    check_invariants(&x, 100, 0);
    assert_eq!(x.cu_seqlens(), [0, 100]);
    assert_eq!(x.loss_mask.iter().sum::<f32>(), 40.0);
    // Prompt of exactly 99 tokens: one answer target survives.
    let x = ds.get(2).unwrap();
    assert_eq!(x.loss_mask.iter().sum::<f32>(), 1.0);
    assert_eq!(
        x.labels[98],
        enc.tokenizer().token_to_id("y").unwrap() as i32
    );
    opts.overlong = Overlong::Drop;
    let ds = RawSftDataset::load(&[p.as_path()], &enc, &opts).unwrap();
    let r = ds.report();
    assert_eq!(
        (
            r.truncated,
            r.dropped_no_answer,
            r.dropped_overlong,
            ds.len()
        ),
        (0, 0, 4, 1)
    );
}

#[test]
fn options_are_validated() {
    let f = fixtures().join("alpaca_sample.jsonl");
    let e = RawSftDataset::load(&[f.as_path()], &tiny(), &SftOptions::new(1)).unwrap_err();
    assert!(
        e.to_string()
            .contains("max_padding_length must be at least 2")
    );
    let missing = fixtures().join("no_such_file.jsonl");
    let e = RawSftDataset::load(&[missing.as_path()], &tiny(), &SftOptions::new(64)).unwrap_err();
    assert!(
        e.to_string().starts_with(&missing.display().to_string()),
        "{e}"
    );
    assert_eq!(
        "mmap".parse(),
        Ok(ferrotron_data::sft::SftDatasetType::Mmap)
    );
    assert_eq!("drop".parse(), Ok(Overlong::Drop));
    assert!("x".parse::<SftFormat>().is_err());
}
