//! Merging datasets (Megatron's tools/merge_datasets.py): contents and document boundaries are
//! preserved in order, pointers are rebased, dtypes must agree, the output is atomic, and a
//! directory is listed like merge_datasets.py lists it.

use ferrotron_data::indexed::{
    BuilderError, IndexedDataset, IndexedDatasetBuilder, TokenDtype, data_paths,
    dataset_prefixes_in_dir, merge_datasets,
};
use std::path::{Path, PathBuf};

/// Writes `docs` (documents of sequences) at `dir/name`.
fn write(dir: &Path, name: &str, dtype: TokenDtype, docs: &[Vec<Vec<u32>>]) -> PathBuf {
    let prefix = dir.join(name);
    let mut b = IndexedDatasetBuilder::create(&prefix, dtype).unwrap();
    for doc in docs {
        for seq in doc {
            b.add_item(seq).unwrap();
        }
        b.end_document();
    }
    b.finalize().unwrap();
    prefix
}

fn docs_of(ds: &IndexedDataset) -> Vec<Vec<Vec<u32>>> {
    ds.document_indices()
        .windows(2)
        .map(|w| {
            (w[0] as usize..w[1] as usize)
                .map(|i| ds.sequence(i).unwrap())
                .collect()
        })
        .collect()
}

#[test]
fn merge_concatenates_documents_in_order() {
    let tmp = tempfile::tempdir().unwrap();
    let a = vec![vec![vec![1, 2], vec![3]], vec![], vec![vec![4, 5, 6]]];
    let b = vec![vec![vec![7]], vec![vec![8, 9], vec![], vec![10]]];
    let c: Vec<Vec<Vec<u32>>> = vec![];
    let inputs = [
        write(tmp.path(), "a", TokenDtype::I32, &a),
        write(tmp.path(), "b", TokenDtype::I32, &b),
        write(tmp.path(), "c", TokenDtype::I32, &c),
    ];
    let out = tmp.path().join("out/merged");
    std::fs::create_dir(tmp.path().join("out")).unwrap();
    let summary = merge_datasets(&inputs, &out).unwrap();
    let ds = IndexedDataset::open(&out).unwrap();
    assert_eq!(ds.dtype(), TokenDtype::I32);
    let want: Vec<_> = a.iter().chain(&b).cloned().collect();
    assert_eq!(docs_of(&ds), want);
    assert_eq!(summary.documents, 5);
    assert_eq!(summary.sequences, 7);
    assert_eq!(summary.tokens, 10);
    // Pointers are the running byte offsets in the merged file.
    let mut ptr = 0;
    for (i, &l) in ds.sequence_lengths().iter().enumerate() {
        assert_eq!(ds.sequence_pointers()[i], ptr);
        ptr += l as u64 * 4;
    }
    assert_eq!(ds.document_indices(), &[0, 2, 2, 3, 4, 7]);
}

#[test]
fn merge_ignores_trailing_bytes_of_an_input_bin() {
    let tmp = tempfile::tempdir().unwrap();
    let a = write(tmp.path(), "a", TokenDtype::U16, &[vec![vec![1, 2]]]);
    let b = write(tmp.path(), "b", TokenDtype::U16, &[vec![vec![3]]]);
    // Megatron copies whole .bin files; extra bytes would shift every later pointer.
    let bin = data_paths(&a).0;
    let mut bytes = std::fs::read(&bin).unwrap();
    bytes.extend_from_slice(&[0xAA; 5]);
    std::fs::write(&bin, bytes).unwrap();
    let out = tmp.path().join("m");
    merge_datasets(&[a, b], &out).unwrap();
    let ds = IndexedDataset::open(&out).unwrap();
    assert_eq!(docs_of(&ds), vec![vec![vec![1, 2]], vec![vec![3]]]);
    assert_eq!(std::fs::metadata(data_paths(&out).0).unwrap().len(), 6);
}

#[test]
fn dtype_mismatch_fails_and_leaves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let a = write(tmp.path(), "a", TokenDtype::U16, &[vec![vec![1]]]);
    let b = write(tmp.path(), "b", TokenDtype::I32, &[vec![vec![2]]]);
    let out = tmp.path().join("m");
    let err = merge_datasets(&[a, b.clone()], &out).unwrap_err();
    match &err {
        BuilderError::DtypeMismatch {
            path,
            expected,
            found,
        } => {
            assert_eq!(path, &data_paths(&b).1);
            assert_eq!((*expected, *found), ("uint16", "int32"));
        }
        other => panic!("unexpected {other}"),
    }
    let mut names: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["a.bin", "a.idx", "b.bin", "b.idx"],
        "no output, no temp"
    );
}

#[test]
fn corrupt_or_missing_input_fails_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let a = write(tmp.path(), "a", TokenDtype::U16, &[vec![vec![1]]]);
    let b = write(tmp.path(), "b", TokenDtype::U16, &[vec![vec![2, 3]]]);
    let idx = data_paths(&b).1;
    let bytes = std::fs::read(&idx).unwrap();
    std::fs::write(&idx, &bytes[..bytes.len() - 4]).unwrap();
    let out = tmp.path().join("m");
    let err = merge_datasets(&[a.clone(), b], &out).unwrap_err();
    assert!(err.to_string().contains("b.idx"), "{err}");
    assert!(!data_paths(&out).0.exists() && !data_paths(&out).1.exists());
    let err = merge_datasets(&[a, tmp.path().join("nope")], &out).unwrap_err();
    assert!(err.to_string().contains("nope"), "{err}");
    let none: [PathBuf; 0] = [];
    assert!(matches!(
        merge_datasets(&none, &out),
        Err(BuilderError::NoInputs(_))
    ));
}

#[test]
fn prefixes_in_dir_are_sorted_pairs() {
    let tmp = tempfile::tempdir().unwrap();
    let docs = [vec![vec![1]]];
    write(tmp.path(), "b_text_document", TokenDtype::U16, &docs);
    write(tmp.path(), "a.part", TokenDtype::U16, &docs);
    std::fs::write(tmp.path().join("README.txt"), "ignored").unwrap();
    std::fs::create_dir(tmp.path().join("sub.bin")).unwrap();
    let found = dataset_prefixes_in_dir(tmp.path()).unwrap();
    assert_eq!(
        found,
        [
            tmp.path().join("a.part"),
            tmp.path().join("b_text_document")
        ]
    );
    std::fs::write(tmp.path().join("orphan.idx"), b"").unwrap();
    let err = dataset_prefixes_in_dir(tmp.path()).unwrap_err();
    assert!(err.to_string().contains("orphan.bin"), "{err}");
}
