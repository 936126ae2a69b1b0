//! Builder -> reader round trips on random documents (uint16 and int32), range and length
//! checks, and the builder's temp-file discipline (nothing under the final names until
//! `finalize`, no leftovers after a drop).

use ferrotron_data::indexed::{
    BuilderError, IndexedDataset, IndexedDatasetBuilder, TokenDtype, data_paths,
};
use std::path::Path;

/// xorshift64*: deterministic test data without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Random documents of 0-4 sequences of 0-300 tokens below `max`.
fn random_docs(rng: &mut Rng, n: usize, max: u64) -> Vec<Vec<Vec<u32>>> {
    (0..n)
        .map(|_| {
            (0..rng.below(5))
                .map(|_| (0..rng.below(301)).map(|_| rng.below(max) as u32).collect())
                .collect()
        })
        .collect()
}

fn dir_entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn round_trip(dtype: TokenDtype, max: u64, seed: u64) {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tmp.path().join("ds");
    let mut rng = Rng(seed);
    let docs = random_docs(&mut rng, 200, max);
    let mut b = IndexedDatasetBuilder::create(&prefix, dtype).unwrap();
    for (i, doc) in docs.iter().enumerate() {
        if i % 2 == 0 {
            for seq in doc {
                b.add_item(seq).unwrap();
            }
            b.end_document();
        } else {
            let flat: Vec<u32> = doc.concat();
            let lens: Vec<usize> = doc.iter().map(Vec::len).collect();
            b.add_document(&flat, &lens).unwrap();
        }
    }
    // Nothing under the final names before finalize.
    assert!(!data_paths(&prefix).0.exists() && !data_paths(&prefix).1.exists());
    let summary = b.finalize().unwrap();
    assert_eq!(dir_entries(tmp.path()), ["ds.bin", "ds.idx"]);

    let ds = IndexedDataset::open(&prefix).unwrap();
    assert_eq!(ds.dtype(), dtype);
    let seqs: Vec<&Vec<u32>> = docs.iter().flatten().collect();
    assert_eq!(ds.len(), seqs.len());
    assert_eq!(summary.sequences, seqs.len());
    assert_eq!(ds.num_documents(), docs.len());
    assert_eq!(summary.documents, docs.len());
    let total: usize = seqs.iter().map(|s| s.len()).sum();
    assert_eq!(ds.num_tokens(), total as u64);
    assert_eq!(summary.tokens, total as u64);
    for (i, want) in seqs.iter().enumerate() {
        assert_eq!(&&ds.sequence(i).unwrap(), want, "sequence {i}");
    }
    let mut start = 0u64;
    for (d, doc) in docs.iter().enumerate() {
        assert_eq!(ds.document_indices()[d], start);
        start += doc.len() as u64;
    }
    let bin_len = std::fs::metadata(data_paths(&prefix).0).unwrap().len();
    assert_eq!(bin_len, total as u64 * dtype.size() as u64);
}

#[test]
fn round_trip_uint16() {
    round_trip(TokenDtype::U16, 65536, 7);
}

#[test]
fn round_trip_int32() {
    round_trip(TokenDtype::I32, 1 << 31, 11);
}

#[test]
fn empty_dataset_round_trips() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tmp.path().join("empty");
    IndexedDatasetBuilder::create(&prefix, TokenDtype::U16)
        .unwrap()
        .finalize()
        .unwrap();
    let ds = IndexedDataset::open(&prefix).unwrap();
    assert!(ds.is_empty());
    assert_eq!(ds.num_documents(), 0);
}

#[test]
fn out_of_range_token_is_an_error_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tmp.path().join("r");
    let mut b = IndexedDatasetBuilder::create(&prefix, TokenDtype::U16).unwrap();
    b.add_item(&[1u32, 2]).unwrap();
    let err = b.add_item(&[3u32, 65536, 4]).unwrap_err();
    match &err {
        BuilderError::TokenOutOfRange {
            path,
            sequence,
            position,
            token,
            dtype,
        } => {
            assert_eq!(
                (*sequence, *position, *token, *dtype),
                (1, 1, 65536, "uint16")
            );
            assert!(path.ends_with("r.bin"));
        }
        other => panic!("unexpected {other}"),
    }
    assert!(err.to_string().contains("65536"), "{err}");
    assert!(b.add_item(&[-1i64]).is_err());
    assert!(b.add_document(&[1u32, 70000], &[2]).is_err());
    // The rejected calls left the builder as it was.
    b.end_document();
    b.finalize().unwrap();
    let ds = IndexedDataset::open(&prefix).unwrap();
    assert_eq!(ds.len(), 1);
    assert_eq!(ds.sequence(0).unwrap(), vec![1, 2]);

    let mut b = IndexedDatasetBuilder::create(&tmp.path().join("i32"), TokenDtype::I32).unwrap();
    assert!(b.add_item(&[i64::from(i32::MAX) + 1]).is_err());
    assert!(b.add_item(&[i32::MIN, i32::MAX]).is_ok());
}

#[test]
fn add_document_lengths_must_add_up() {
    let tmp = tempfile::tempdir().unwrap();
    let mut b = IndexedDatasetBuilder::create(&tmp.path().join("l"), TokenDtype::U16).unwrap();
    let err = b.add_document(&[1u32, 2, 3], &[1, 1]).unwrap_err();
    assert!(matches!(err, BuilderError::BadLengths { .. }), "{err}");
    assert!(err.to_string().contains("do not add up"), "{err}");
    assert_eq!(
        (b.num_sequences(), b.num_documents(), b.num_tokens()),
        (0, 0, 0)
    );
}

#[test]
fn dropping_an_unfinalized_builder_leaves_no_file() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tmp.path().join("gone");
    let mut b = IndexedDatasetBuilder::create(&prefix, TokenDtype::U16).unwrap();
    b.add_item(&vec![7u32; 100_000]).unwrap();
    b.end_document();
    assert_eq!(
        dir_entries(tmp.path()).len(),
        1,
        "one temp .bin while writing"
    );
    drop(b);
    assert!(dir_entries(tmp.path()).is_empty());

    // finish() without commit(): the temp files go away too.
    let mut b = IndexedDatasetBuilder::create(&prefix, TokenDtype::U16).unwrap();
    b.add_document(&[1u32], &[1]).unwrap();
    let finished = b.finish().unwrap();
    assert_eq!(finished.summary().documents, 1);
    assert_eq!(dir_entries(tmp.path()).len(), 2);
    drop(finished);
    assert!(dir_entries(tmp.path()).is_empty());
}

#[test]
fn finalize_replaces_an_existing_dataset() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tmp.path().join("x");
    for n in [3usize, 5] {
        let mut b = IndexedDatasetBuilder::create(&prefix, TokenDtype::U16).unwrap();
        b.add_document(&vec![1u32; n], &[n]).unwrap();
        b.finalize().unwrap();
        assert_eq!(
            IndexedDataset::open(&prefix).unwrap().num_tokens(),
            n as u64
        );
    }
    assert_eq!(dir_entries(tmp.path()), ["x.bin", "x.idx"]);
}

#[test]
fn create_in_a_missing_directory_names_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tmp.path().join("no/such/dir/ds");
    let err = IndexedDatasetBuilder::create(&prefix, TokenDtype::U16)
        .err()
        .unwrap();
    assert!(err.to_string().contains("no/such/dir/ds.bin"), "{err}");
}
