//! Byte-for-byte comparison with files written by Megatron-Core's own `IndexedDatasetBuilder`
//! (fixtures/megatron_idx, made by tools/make_megatron_idx_fixture.py): our builder replays the
//! same operations and must produce identical `.bin` and `.idx` bytes, our merge must match
//! Megatron's `add_index` merge, and our reader must read Megatron's files back.

use ferrotron_data::indexed::{
    IndexedDataset, IndexedDatasetBuilder, TokenDtype, data_paths, merge_datasets,
};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/megatron_idx")
}

fn ops() -> Value {
    let text = std::fs::read_to_string(fixture_dir().join("ops.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn tokens(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_i64().unwrap())
        .collect()
}

fn dtype_of(name: &str) -> TokenDtype {
    match name {
        "uint16" => TokenDtype::U16,
        "int32" => TokenDtype::I32,
        other => panic!("fixture dtype {other}"),
    }
}

/// Replays one dataset's ops with our builder at `prefix`; returns the expected sequences.
fn replay(spec: &Value, prefix: &Path) -> Vec<Vec<i64>> {
    let mut b =
        IndexedDatasetBuilder::create(prefix, dtype_of(spec["dtype"].as_str().unwrap())).unwrap();
    let mut seqs = Vec::new();
    for op in spec["ops"].as_array().unwrap() {
        match op["op"].as_str().unwrap() {
            "add_item" => {
                let t = tokens(&op["tokens"]);
                b.add_item(&t).unwrap();
                seqs.push(t);
            }
            "end_document" => b.end_document(),
            "add_document" => {
                let t = tokens(&op["tokens"]);
                let lens: Vec<usize> = tokens(&op["lengths"]).iter().map(|&l| l as usize).collect();
                b.add_document(&t, &lens).unwrap();
                let mut start = 0;
                for l in lens {
                    seqs.push(t[start..start + l].to_vec());
                    start += l;
                }
            }
            other => panic!("unknown op {other}"),
        }
    }
    b.finalize().unwrap();
    seqs
}

fn assert_same_files(ours: &Path, megatron: &Path) {
    let (ob, oi) = data_paths(ours);
    let (mb, mi) = data_paths(megatron);
    assert_eq!(
        std::fs::read(&oi).unwrap(),
        std::fs::read(&mi).unwrap(),
        "{} differs from Megatron's {}",
        oi.display(),
        mi.display()
    );
    assert_eq!(
        std::fs::read(&ob).unwrap(),
        std::fs::read(&mb).unwrap(),
        "{} differs from Megatron's {}",
        ob.display(),
        mb.display()
    );
}

#[test]
fn builder_matches_megatron_bytes() {
    let doc = ops();
    let tmp = tempfile::tempdir().unwrap();
    for name in ["uint16", "int32", "extra"] {
        let ours = tmp.path().join(name);
        replay(&doc["datasets"][name], &ours);
        assert_same_files(&ours, &fixture_dir().join(name));
    }
}

#[test]
fn reader_reads_megatron_files() {
    let doc = ops();
    let tmp = tempfile::tempdir().unwrap();
    for name in ["uint16", "int32", "extra"] {
        let spec = &doc["datasets"][name];
        // Replaying into a scratch prefix yields the expected sequences and documents.
        let expected = replay(spec, &tmp.path().join(name));
        let ds = IndexedDataset::open(&fixture_dir().join(name)).unwrap();
        assert_eq!(ds.dtype(), dtype_of(spec["dtype"].as_str().unwrap()));
        assert_eq!(ds.len(), expected.len());
        for (i, want) in expected.iter().enumerate() {
            let got: Vec<i64> = ds.sequence(i).unwrap().iter().map(|&t| t as i64).collect();
            assert_eq!(&got, want, "{name} sequence {i}");
        }
        let ends = spec["ops"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|o| o["op"] != "add_item")
            .count();
        assert_eq!(ds.num_documents(), ends, "{name} documents");
    }
    // Spot values: the first document of uint16 is [0, 1, 2, 65535]; an empty document follows
    // the second (document indices repeat).
    let ds = IndexedDataset::open(&fixture_dir().join("uint16")).unwrap();
    assert_eq!(ds.sequence(0).unwrap(), vec![0, 1, 2, 65535]);
    assert_eq!(&ds.document_indices()[..4], &[0, 1, 5, 5]);
}

#[test]
fn merge_matches_megatron_add_index() {
    let tmp = tempfile::tempdir().unwrap();
    let inputs: Vec<PathBuf> = ["uint16", "extra"]
        .iter()
        .map(|n| fixture_dir().join(n))
        .collect();
    let out = tmp.path().join("merged");
    let summary = merge_datasets(&inputs, &out).unwrap();
    assert_same_files(&out, &fixture_dir().join("merged"));
    let a = IndexedDataset::open(&inputs[0]).unwrap();
    let b = IndexedDataset::open(&inputs[1]).unwrap();
    assert_eq!(summary.sequences, a.len() + b.len());
    assert_eq!(summary.documents, a.num_documents() + b.num_documents());
}
