//! The preprocessed SFT form (idxmap) against the raw form with the tiny character-level ChatML
//! tokenizer (`fixtures/sft/tiny-chatml`): identical samples padded and packed, the stored
//! layout, corrupt files, and both forms feeding the data loader.

use std::path::{Path, PathBuf};

use ferrotron_data::indexed::{IndexedDataset, IndexedDatasetBuilder, TokenDtype};
use ferrotron_data::sft::{
    IdxmapSftDataset, RawSftDataset, SftEncoder, SftError, SftOptions, idxmap_prefix, write_idxmap,
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

/// Same records as in sft_dataset.rs: two of five samples need truncation at s = 100..300.
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

fn assert_same(raw: &RawSftDataset, mmap: &IdxmapSftDataset) {
    assert_eq!(raw.len(), mmap.len());
    assert_eq!(raw.seq_length(), mmap.seq_length());
    for i in 0..raw.len() {
        assert_eq!(raw.get(i).unwrap(), mmap.get(i).unwrap(), "sequence {i}");
    }
}

#[test]
fn raw_and_preprocessed_forms_give_identical_samples() {
    let dir = tempfile::tempdir().unwrap();
    let f = fixtures();
    let long = long_records(dir.path());
    let files = [
        f.join("alpaca_sample.json"),
        f.join("chitchat_sample.jsonl"),
        long,
    ];
    let files: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    let enc = tiny();
    for (pack, s) in [(false, 300), (true, 300), (true, 1024)] {
        let mut opts = SftOptions::new(s);
        opts.pack = pack;
        let raw = RawSftDataset::load(&files, &enc, &opts).unwrap();
        let out = dir.path().join(format!("sft_{pack}_{s}"));
        opts.workers = 3; // same output for any worker count
        let report = write_idxmap(&files, &enc, &opts, &out).unwrap();
        assert_eq!(&report, raw.report());
        let mmap = IdxmapSftDataset::open(&idxmap_prefix(&out)).unwrap();
        assert_same(&raw, &mmap);
        assert!(raw.report().truncated > 0);
    }
}

#[test]
fn idxmap_layout_is_tokens_with_end_markers_then_labels() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(
        dir.path(),
        "two.jsonl",
        "{\"instruction\": \"a\", \"output\": \"b\"}\n{\"instruction\": \"c\", \"output\": \"d\"}\n",
    );
    let mut opts = SftOptions::new(128);
    opts.pack = true;
    let enc = tiny();
    write_idxmap(&[p.as_path()], &enc, &opts, &dir.path().join("out")).unwrap();
    let prefix = dir.path().join("out_text_document");
    let data = IndexedDataset::open(&prefix).unwrap();
    assert_eq!(
        (data.dtype(), data.len(), data.num_documents()),
        (TokenDtype::I32, 1, 1)
    );
    let values: Vec<i32> = data
        .sequence(0)
        .unwrap()
        .into_iter()
        .map(|v| v as i32)
        .collect();
    let raw = RawSftDataset::load(&[p.as_path()], &enc, &opts).unwrap();
    let x = raw.get(0).unwrap();
    let n = raw.group(0).unwrap()[0].len();
    let newline = enc.tokenizer().token_to_id("\n").unwrap() as i32;
    assert_eq!(
        (values[n - 1], values[2 * n - 1]),
        (-1 - newline, -1 - newline)
    );
    assert_eq!(values.iter().take(128).filter(|&&v| v < 0).count(), 2);
    assert_eq!(
        values[2 * n..128],
        vec![0; 128 - 2 * n][..],
        "padding stored as is"
    );
    assert_eq!(values[128..], x.labels[..]);
}

#[test]
fn corrupt_idxmap_sequences_are_errors_naming_the_sequence() {
    let dir = tempfile::tempdir().unwrap();
    let build = |name: &str, dtype, seqs: &[Vec<i32>]| {
        let prefix = dir.path().join(name);
        let mut b = IndexedDatasetBuilder::create(&prefix, dtype).unwrap();
        for s in seqs {
            b.add_document(s, &[s.len()]).unwrap();
        }
        b.finalize().unwrap();
        prefix
    };
    let err = |r: Result<IdxmapSftDataset, SftError>| r.err().unwrap().to_string();
    let p = build("u16", TokenDtype::U16, &[vec![1, 2, 3, 4]]);
    assert!(err(IdxmapSftDataset::open(&p)).contains("dtype uint16"));
    let p = build("odd", TokenDtype::I32, &[vec![1, 2, 3]]);
    assert!(err(IdxmapSftDataset::open(&p)).contains("sequence 0: length 3"));
    let p = build(
        "ragged",
        TokenDtype::I32,
        &[vec![5, -7, 7, -100], vec![1, 2]],
    );
    assert!(err(IdxmapSftDataset::open(&p)).contains("sequence 1: length 2 differs"));
    // Sequence 1: label 9 is not the next token (6).
    let p = build(
        "labels",
        TokenDtype::I32,
        &[
            vec![5, -7, 6, -1, -100, -100, -100, -100],
            vec![5, 6, -8, 0, 9, -100, -100, -100],
        ],
    );
    let ds = IdxmapSftDataset::open(&p).unwrap();
    assert_eq!(ds.get(0).unwrap().sample_ids, [0, 0, 1, 1]);
    let e = ds.get(1).unwrap_err().to_string();
    assert!(e.contains("sequence 1: label 9 at position 0"), "{e}");
    let p = build("nomarker", TokenDtype::I32, &[vec![1, 2, -100, -100]]);
    let e = IdxmapSftDataset::open(&p)
        .unwrap()
        .get(0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("no sample-end marker"), "{e}");
}

#[test]
fn sft_datasets_feed_the_data_loader() {
    use ferrotron_data::{DataLoader, Dataset, LoaderConfig};
    use std::sync::Arc;
    let dir = tempfile::tempdir().unwrap();
    let f = fixtures().join("alpaca_sample.jsonl");
    let mut opts = SftOptions::new(512);
    opts.pack = true;
    let enc = tiny();
    let raw = RawSftDataset::load(&[f.as_path()], &enc, &opts).unwrap();
    write_idxmap(&[f.as_path()], &enc, &opts, &dir.path().join("a")).unwrap();
    let mmap = IdxmapSftDataset::open(&idxmap_prefix(&dir.path().join("a"))).unwrap();
    let x = raw.get(0).unwrap();
    let g = Dataset::get(&raw, 0).unwrap();
    assert_eq!(g, Dataset::get(&mmap, 0).unwrap());
    assert_eq!(
        (g.tokens, g.position_ids, g.segment_ids),
        (x.tokens, x.position_ids, x.sample_ids)
    );
    for i in 0..512 {
        let want = if x.loss_mask[i] == 0.0 {
            0
        } else {
            x.labels[i] as u32
        };
        assert_eq!(g.labels[i], want);
    }
    assert!(matches!(
        Dataset::get(&mmap, 99),
        Err(ferrotron_data::DatasetError::OutOfRange { .. })
    ));
    assert_eq!(Dataset::description(&raw)["type"], "sft_raw");
    let n = Dataset::len(&raw);
    let loader = DataLoader::new(Arc::new(raw), &LoaderConfig::new(1, 0, 1, 0)).unwrap();
    let batches: Vec<_> = loader.map(Result::unwrap).collect();
    assert_eq!(batches.len(), n);
    assert_eq!(
        (batches[0].micro_batch_size, batches[0].seq_length),
        (1, 512)
    );
}
