//! Damaged `.idx` / `.bin` files: every case is a `Corrupt` error naming the damaged file, never
//! a panic. Starts from a valid dataset written by our builder and breaks one thing at a time;
//! then truncates the index at every length and flips every header byte.

use ferrotron_data::indexed::{
    IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError, TokenDtype, data_paths,
};
use std::path::{Path, PathBuf};

/// A valid dataset: 3 documents, 4 sequences of uint16. Returns (prefix, bin, idx).
fn valid(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let prefix = dir.join("ds");
    let mut b = IndexedDatasetBuilder::create(&prefix, TokenDtype::U16).unwrap();
    b.add_document(&[1u32, 2, 3, 4, 5], &[2, 3]).unwrap();
    b.add_item(&[6u32]).unwrap();
    b.end_document();
    b.add_document(&[7u32, 8, 9], &[3]).unwrap();
    b.finalize().unwrap();
    let (bin, idx) = data_paths(&prefix);
    (prefix, bin, idx)
}

/// Header size: magic 9 + version 8 + dtype 1 + counts 16.
const HEADER: usize = 34;
const SEQUENCES: usize = 4;
const DOCS: usize = 4; // documents + 1

fn expect_corrupt(prefix: &Path, file: &Path, needle: &str) {
    match IndexedDataset::open(prefix) {
        Err(IndexedDatasetError::Corrupt { path, detail }) => {
            assert_eq!(path, file, "wrong file named: {detail}");
            assert!(detail.contains(needle), "{detail:?} lacks {needle:?}");
        }
        Err(other) => panic!("expected Corrupt({needle}), got {other}"),
        Ok(_) => panic!("expected Corrupt({needle}), opened fine"),
    }
}

fn patch(path: &Path, at: usize, bytes: &[u8]) {
    let mut data = std::fs::read(path).unwrap();
    data[at..at + bytes.len()].copy_from_slice(bytes);
    std::fs::write(path, data).unwrap();
}

#[test]
fn header_damage() {
    let tmp = tempfile::tempdir().unwrap();
    let (prefix, _, idx) = valid(tmp.path());
    let good = std::fs::read(&idx).unwrap();
    let cases: [(usize, &[u8], &str); 5] = [
        (0, b"X", "bad magic"),
        (9, &2u64.to_le_bytes(), "version 2"),
        (17, &[7], "dtype code 7"),
        (18, &1000u64.to_le_bytes(), "truncated"),
        (26, &u64::MAX.to_le_bytes(), "overflows"),
    ];
    for (at, bytes, needle) in cases {
        std::fs::write(&idx, &good).unwrap();
        patch(&idx, at, bytes);
        expect_corrupt(&prefix, &idx, needle);
    }
}

#[test]
fn document_indices_damage() {
    let tmp = tempfile::tempdir().unwrap();
    let (prefix, _, idx) = valid(tmp.path());
    let docs_at = HEADER + 12 * SEQUENCES;
    let good = std::fs::read(&idx).unwrap();
    // Not starting at 0, not monotone, not ending at the sequence count, negative.
    for (slot, value) in [(0, 1i64), (1, 4), (DOCS - 1, 3), (2, -1)] {
        std::fs::write(&idx, &good).unwrap();
        patch(&idx, docs_at + 8 * slot, &value.to_le_bytes());
        expect_corrupt(&prefix, &idx, "document_indices");
    }
    // Trailing bytes that are not per-sequence modes.
    let mut longer = good.clone();
    longer.extend_from_slice(&[0; 3]);
    std::fs::write(&idx, &longer).unwrap();
    expect_corrupt(&prefix, &idx, "trailing");
}

#[test]
fn bin_too_short_or_pointers_outside() {
    let tmp = tempfile::tempdir().unwrap();
    let (prefix, bin, idx) = valid(tmp.path());
    let good_bin = std::fs::read(&bin).unwrap();
    // Truncated .bin: the last sequence no longer fits.
    std::fs::write(&bin, &good_bin[..good_bin.len() - 1]).unwrap();
    expect_corrupt(&prefix, &bin, "outside");
    std::fs::write(&bin, b"").unwrap();
    expect_corrupt(&prefix, &bin, "outside");
    std::fs::write(&bin, &good_bin).unwrap();
    // A pointer past the end, a negative pointer, a negative length.
    let good_idx = std::fs::read(&idx).unwrap();
    let lengths_at = HEADER;
    let pointers_at = HEADER + 4 * SEQUENCES;
    let cases: [(usize, Vec<u8>); 3] = [
        (pointers_at + 8, 1_000_000i64.to_le_bytes().to_vec()),
        (pointers_at, (-2i64).to_le_bytes().to_vec()),
        (lengths_at, (-1i32).to_le_bytes().to_vec()),
    ];
    for (at, bytes) in cases {
        std::fs::write(&idx, &good_idx).unwrap();
        patch(&idx, at, &bytes);
        expect_corrupt(&prefix, &bin, "outside");
    }
}

#[test]
fn every_truncation_of_the_index_is_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let (prefix, _, idx) = valid(tmp.path());
    let good = std::fs::read(&idx).unwrap();
    for len in 0..good.len() {
        std::fs::write(&idx, &good[..len]).unwrap();
        match IndexedDataset::open(&prefix) {
            Err(IndexedDatasetError::Corrupt { path, .. }) => assert_eq!(path, idx),
            Err(other) => panic!("length {len}: {other}"),
            Ok(_) => panic!("length {len}: opened a truncated index"),
        }
    }
}

#[test]
fn flipping_any_header_or_index_byte_never_panics() {
    let tmp = tempfile::tempdir().unwrap();
    let (prefix, _, idx) = valid(tmp.path());
    let good = std::fs::read(&idx).unwrap();
    for at in 0..good.len() {
        for flip in [0x01u8, 0x80, 0xFF] {
            let mut data = good.clone();
            data[at] ^= flip;
            std::fs::write(&idx, &data).unwrap();
            // Either a clean error or a dataset whose every sequence reads.
            if let Ok(ds) = IndexedDataset::open(&prefix) {
                for i in 0..ds.len() {
                    ds.sequence(i).unwrap();
                }
            }
        }
    }
}

#[test]
fn missing_files_are_io_errors_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let (prefix, bin, idx) = valid(tmp.path());
    std::fs::remove_file(&bin).unwrap();
    let err = IndexedDataset::open(&prefix).err().unwrap();
    assert!(
        matches!(&err, IndexedDatasetError::Io { path, .. } if *path == bin),
        "{err}"
    );
    std::fs::remove_file(&idx).unwrap();
    let err = IndexedDataset::open(&prefix).err().unwrap();
    assert!(
        matches!(&err, IndexedDatasetError::Io { path, .. } if *path == idx),
        "{err}"
    );
}
