//! GptDataset properties on synthetic data: sample lengths, token coverage per epoch,
//! determinism, the cache (hit, corrupt, stale) and errors on bad input.

use ferrotron_data::gpt_dataset::CacheStatus;
use ferrotron_data::indexed::{IndexedDataset, IndexedDatasetBuilder, TokenDtype};
use ferrotron_data::{DatasetError, GptDataset, GptDatasetConfig, Split};
use std::path::Path;
use std::sync::Arc;

const EOD: u32 = 0;

/// `n` documents of pseudo-random lengths 1..=max_len, each ending with EOD; token values encode
/// (document, position) so misplaced tokens are visible.
fn documents(n: usize, max_len: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut state = seed;
    (0..n)
        .map(|d| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let len = 1 + (state >> 33) as usize % max_len;
            let mut doc: Vec<u32> = (1..len).map(|p| (d * 100 + p) as u32 % 60000 + 1).collect();
            doc.push(EOD);
            doc
        })
        .collect()
}

fn write(dir: &Path, name: &str, docs: &[Vec<u32>]) -> Arc<IndexedDataset> {
    let prefix = dir.join(name);
    let mut b = IndexedDatasetBuilder::create(&prefix, TokenDtype::U16).unwrap();
    for d in docs {
        b.add_item(&d[..]).unwrap();
        b.end_document();
    }
    b.finalize().unwrap();
    Arc::new(IndexedDataset::open(&prefix).unwrap())
}

fn config(seq: usize, seed: u32) -> GptDatasetConfig {
    let mut c = GptDatasetConfig::new(seq, seed, EOD);
    c.split = "80,10,10".into();
    c
}

/// Sample tokens in sample-index order (undoing the shuffle), overlap tokens removed.
fn unshuffled_stream(ds: &GptDataset) -> Vec<u32> {
    let mut by_sample = vec![0usize; ds.len()];
    for (i, &k) in ds.shuffle_index().iter().enumerate() {
        by_sample[k as usize] = i;
    }
    let mut stream = Vec::new();
    for (k, &i) in by_sample.iter().enumerate() {
        let (text, real) = ds.text(i).unwrap();
        assert_eq!(real, ds.config().seq_length + 1, "sample {i} is short");
        stream.extend_from_slice(if k == 0 { &text[..] } else { &text[1..] });
    }
    stream
}

#[test]
fn samples_are_full_and_cover_each_epoch_once() {
    let dir = tempfile::tempdir().unwrap();
    let docs = documents(50, 40, 1);
    let indexed = write(dir.path(), "d", &docs);
    let mut separate = 0;
    for (num_samples, seq) in [(None, 16), (Some(100), 16), (Some(37), 7)] {
        let ds =
            GptDataset::build(indexed.clone(), Split::Train, num_samples, &config(seq, 3)).unwrap();
        let plan = ds.epoch_plan();
        assert!(ds.len() >= num_samples.unwrap_or(1));
        // Each document appears exactly once per epoch in the document index.
        let range = ds.documents();
        let mut count = vec![0usize; range.len()];
        for &d in ds.document_index() {
            count[d as usize - range.start] += 1;
        }
        assert!(
            count.iter().all(|&c| c == plan.num_epochs),
            "{num_samples:?}"
        );
        // The samples, in order and minus the shared boundary token, are the documents in
        // document-index order; the leftover is less than one sample.
        let expected: Vec<u32> = ds
            .document_index()
            .iter()
            .flat_map(|&d| docs[d as usize].iter().copied())
            .collect();
        let stream = unshuffled_stream(&ds);
        assert_eq!(stream[..], expected[..stream.len()], "{num_samples:?}");
        assert!(expected.len() - stream.len() < seq, "{num_samples:?}");
        // The shuffle index is a permutation; a separate final epoch keeps its samples last.
        let mut sorted = ds.shuffle_index().to_vec();
        sorted.sort_unstable();
        assert!(sorted.iter().enumerate().all(|(i, &v)| v as usize == i));
        if plan.separate_final_epoch {
            separate += 1;
            let cut = plan.num_samples_sans_final_epoch;
            assert!(
                ds.shuffle_index()[..cut]
                    .iter()
                    .all(|&v| (v as usize) < cut)
            );
        }
        for i in 0..ds.len() {
            let s = ds.get(i).unwrap();
            assert_eq!((s.tokens.len(), s.labels.len()), (seq, seq));
            assert_eq!(s.tokens[1..], s.labels[..seq - 1]);
        }
    }
    assert!(
        separate > 0,
        "no case had a separately shuffled final epoch"
    );
}

#[test]
fn seeds_are_deterministic_and_distinct() {
    let dir = tempfile::tempdir().unwrap();
    let indexed = write(dir.path(), "d", &documents(40, 30, 2));
    let build = |seed| {
        GptDataset::build(indexed.clone(), Split::Train, Some(80), &config(8, seed)).unwrap()
    };
    let (a, b, c) = (build(1), build(1), build(2));
    assert_eq!(a.document_index(), b.document_index());
    assert_eq!(a.sample_index(), b.sample_index());
    assert_eq!(a.shuffle_index(), b.shuffle_index());
    assert_ne!(a.document_index(), c.document_index());
    assert_ne!(a.shuffle_index(), c.shuffle_index());
}

#[test]
fn cache_hits_and_rebuilds_corrupt_or_stale_files() {
    let dir = tempfile::tempdir().unwrap();
    let indexed = write(dir.path(), "d", &documents(40, 30, 3));
    let mut cfg = config(8, 5);
    cfg.path_to_cache = Some(dir.path().join("cache"));
    let build = |cfg: &GptDatasetConfig| {
        GptDataset::build(indexed.clone(), Split::Train, Some(60), cfg).unwrap()
    };
    let first = build(&cfg);
    assert_eq!(first.cache_status(), &CacheStatus::Built);
    let hit = build(&cfg);
    assert_eq!(hit.cache_status(), &CacheStatus::Hit);
    assert_eq!(hit.document_index(), first.document_index());
    assert_eq!(hit.sample_index(), first.sample_index());
    assert_eq!(hit.shuffle_index(), first.shuffle_index());

    let files: Vec<_> = std::fs::read_dir(dir.path().join("cache"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 4, "{files:?}"); // description + 3 arrays, no temp files left
    let find = |affix: &str| {
        files
            .iter()
            .find(|p| p.to_string_lossy().ends_with(affix))
            .unwrap()
            .clone()
    };

    // Flip one byte of the sample index: rebuilt, same indices.
    let sample = find("-GptDataset-train-sample_index.npy");
    let mut bytes = std::fs::read(&sample).unwrap();
    *bytes.last_mut().unwrap() ^= 1;
    std::fs::write(&sample, &bytes).unwrap();
    let rebuilt = build(&cfg);
    assert!(
        matches!(rebuilt.cache_status(), CacheStatus::Rebuilt(why) if why.contains("sample_index"))
    );
    assert_eq!(rebuilt.sample_index(), first.sample_index());
    assert_eq!(build(&cfg).cache_status(), &CacheStatus::Hit);

    // Truncate the shuffle index, then garble the description: both rebuilt.
    let shuffle = find("-shuffle_index.npy");
    std::fs::write(&shuffle, &std::fs::read(&shuffle).unwrap()[..20]).unwrap();
    assert!(matches!(
        build(&cfg).cache_status(),
        CacheStatus::Rebuilt(_)
    ));
    std::fs::write(find("-description.json"), b"{not json").unwrap();
    assert!(matches!(
        build(&cfg).cache_status(),
        CacheStatus::Rebuilt(_)
    ));
    assert_eq!(build(&cfg).shuffle_index(), first.shuffle_index());

    // Any parameter of the indices changes the key: a different seed is a new cache entry.
    cfg.seed = 6;
    assert_eq!(build(&cfg).cache_status(), &CacheStatus::Built);
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let dir = tempfile::tempdir().unwrap();
    let indexed = write(dir.path(), "d", &documents(3, 10, 4));
    let build =
        |split, n, cfg: &GptDatasetConfig| GptDataset::build(indexed.clone(), split, n, cfg);
    let field = |r: Result<GptDataset, DatasetError>| match r {
        Err(DatasetError::Config { field, .. }) => field,
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("expected an error"),
    };
    let mut c = config(4, 0);
    c.split = "1,x".into();
    assert_eq!(field(build(Split::Train, Some(5), &c)), "split");
    c.split = "1,0,0".into();
    assert_eq!(field(build(Split::Valid, Some(5), &c)), "split"); // weight 0
    c.split = "98,1,1".into();
    assert_eq!(field(build(Split::Valid, Some(5), &c)), "split"); // rounds to no documents
    assert_eq!(
        field(build(Split::Train, Some(5), &config(0, 0))),
        "seq_length"
    );

    // Documents without tokens cannot give samples.
    let empty = write(dir.path(), "empty", &[vec![], vec![]]);
    let r = GptDataset::build(empty, Split::Train, Some(3), &config(4, 0));
    assert!(
        matches!(r, Err(DatasetError::Index { .. })),
        "{:?}",
        r.err()
    );

    let ds = build(Split::Train, None, &config(4, 0)).unwrap();
    assert!(matches!(
        ds.get(ds.len()),
        Err(DatasetError::OutOfRange { .. })
    ));
    // build_splits skips the split that rounds to nothing when no samples are asked of it.
    let mut c = config(4, 0);
    c.split = "98,1,1".into();
    let [train, valid, test] =
        GptDataset::build_splits(indexed.clone(), [Some(4), None, None], &c).unwrap();
    assert!(train.is_some() && valid.is_none() && test.is_none());
}
