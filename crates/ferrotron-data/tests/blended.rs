//! BlendedDataset: achieved ratios, blend-string parsing, routing, oversampling, caching.

use ferrotron_data::blended::{BuiltDataset, sizes_per_dataset};
use ferrotron_data::gpt_dataset::CacheStatus;
use ferrotron_data::indexed::{IndexedDatasetBuilder, TokenDtype};
use ferrotron_data::{
    BlendedDataset, Dataset, DatasetError, GptDatasetConfig, GptSample, Split, build_gpt_datasets,
    parse_blend,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A dataset of `n` samples whose tokens are `[tag, i]`.
struct Tagged {
    tag: u32,
    n: usize,
}

impl Dataset for Tagged {
    fn len(&self) -> usize {
        self.n
    }

    fn get(&self, i: usize) -> Result<GptSample, DatasetError> {
        if i >= self.n {
            return Err(DatasetError::OutOfRange {
                index: i,
                len: self.n,
            });
        }
        Ok(GptSample {
            tokens: vec![self.tag, i as u32],
            labels: vec![0, 0],
            loss_mask: vec![1.0, 1.0],
            position_ids: vec![0, 1],
            segment_ids: vec![0, 0],
            margin: 0.0,
        })
    }
}

fn write(dir: &Path, name: &str, docs: usize, tag: u32) -> PathBuf {
    let prefix = dir.join(name);
    let mut b = IndexedDatasetBuilder::create(&prefix, TokenDtype::U16).unwrap();
    for d in 0..docs {
        let len = 5 + d % 17;
        let doc: Vec<u32> = (0..len)
            .map(|p| if p + 1 == len { 0 } else { tag })
            .collect();
        b.add_item(&doc[..]).unwrap();
        b.end_document();
    }
    b.finalize().unwrap();
    prefix
}

#[test]
fn achieved_ratios_match_weights_within_one_percent() {
    let dir = tempfile::tempdir().unwrap();
    let prefixes: Vec<PathBuf> = (1..=3)
        .map(|t| write(dir.path(), &format!("p{t}"), 60, t))
        .collect();
    let spec = format!(
        "0.2 {} 0.3 {} 0.5 {}",
        prefixes[0].display(),
        prefixes[1].display(),
        prefixes[2].display()
    );
    let blend = parse_blend(&spec).unwrap();
    let mut cfg = GptDatasetConfig::new(16, 1234, 0);
    cfg.split = "90,10,0".into();
    let [train, valid, test] =
        build_gpt_datasets(&blend, [Some(3000), Some(100), None], &cfg).unwrap();
    assert!(test.is_none() && valid.is_some());
    let train = train.unwrap();
    let BuiltDataset::Blended(b) = &*train else {
        panic!("expected a blend")
    };
    // Megatron's size: sum of ceil(size * w) (3000 here, exact products).
    assert_eq!(Dataset::len(b), 3000);
    for (got, want) in b.achieved_ratios().iter().zip([0.2, 0.3, 0.5]) {
        assert!((got - want).abs() < 0.01, "{got} vs {want}");
    }
    // Every prefix of the blend stays within 1% once it is 100 samples long.
    let mut counts = [0usize; 3];
    for (n, &d) in b.dataset_index().iter().enumerate() {
        counts[d as usize] += 1;
        if n + 1 >= 100 {
            for (c, w) in counts.iter().zip([0.2, 0.3, 0.5]) {
                assert!(
                    (*c as f64 / (n + 1) as f64 - w).abs() < 0.01,
                    "prefix {}",
                    n + 1
                );
            }
        }
    }
    // Samples come from the dataset the index names (token = the prefix's tag or EOD).
    for i in (0..3000).step_by(97) {
        let (d, _) = b.locate(i).unwrap();
        let s = train.get(i).unwrap();
        assert!(
            s.tokens.iter().all(|&t| t == 0 || t == d as u32 + 1),
            "sample {i}"
        );
    }
    // Mid-level datasets carry the 0.5% surplus.
    let lens: Vec<usize> = b.datasets().iter().map(|d| d.len()).collect();
    let buffer = sizes_per_dataset(&[0.2, 0.3, 0.5], 3000, 0.005);
    assert!(
        lens.iter().zip(&buffer).all(|(l, n)| l >= n),
        "{lens:?} {buffer:?}"
    );
}

#[test]
fn parse_blend_accepts_pairs_or_prefixes_only() {
    let b = parse_blend("0.3 data/a  0.7 data/b").unwrap();
    assert_eq!(
        b.prefixes,
        [PathBuf::from("data/a"), PathBuf::from("data/b")]
    );
    assert_eq!(b.weights, Some(vec![0.3, 0.7]));
    let b = parse_blend("data/a data/b data/c").unwrap();
    assert_eq!((b.prefixes.len(), b.weights), (3, None));
    for bad in [
        "",
        "0.3 a 0.7",
        "a 0.7 b",
        "0 a 1 b",
        "-1 a 2 b",
        "nan a 1 b",
    ] {
        assert!(
            matches!(
                parse_blend(bad),
                Err(DatasetError::Config { field: "blend", .. })
            ),
            "{bad:?}"
        );
    }
}

#[test]
fn routes_samples_and_rejects_oversampling() {
    let ds = |tag, n| Arc::new(Tagged { tag, n }) as Arc<dyn Dataset>;
    let b = BlendedDataset::new(
        vec![ds(7, 40), ds(9, 70)],
        &[3.0, 7.0],
        Some(100),
        Split::Train,
        None,
    )
    .unwrap();
    assert_eq!(b.weights(), [0.3, 0.7]);
    for i in 0..100 {
        let (d, s) = b.locate(i).unwrap();
        let got = b.get(i).unwrap();
        assert_eq!(got.tokens, [[7, 9][d], s as u32]);
    }
    assert!(matches!(b.get(100), Err(DatasetError::OutOfRange { .. })));
    // 0.3 * 100 = 30 samples from a dataset of 20: Megatron's oversampling error.
    let r = BlendedDataset::new(
        vec![ds(7, 20), ds(9, 70)],
        &[0.3, 0.7],
        Some(100),
        Split::Train,
        None,
    );
    assert!(matches!(r, Err(DatasetError::Index { what: "blend", .. })));
    // Exhaustive: exactly the whole-number weights.
    let e = BlendedDataset::new(
        vec![ds(1, 3), ds(2, 5)],
        &[3.0, 5.0],
        None,
        Split::Valid,
        None,
    )
    .unwrap();
    assert_eq!(e.achieved_ratios(), [3.0 / 8.0, 5.0 / 8.0]);
    assert!(BlendedDataset::new(vec![ds(1, 3)], &[1.5], None, Split::Valid, None).is_err());
    assert!(BlendedDataset::new(vec![ds(1, 3)], &[1.0, 2.0], Some(2), Split::Valid, None).is_err());
}

#[test]
fn blend_indices_are_cached() {
    let dir = tempfile::tempdir().unwrap();
    let ds = |tag, n| Arc::new(Tagged { tag, n }) as Arc<dyn Dataset>;
    let cache = dir.path().join("cache");
    let make = || {
        BlendedDataset::new(
            vec![ds(1, 500), ds(2, 500)],
            &[0.25, 0.75],
            Some(400),
            Split::Train,
            Some(&cache),
        )
        .unwrap()
    };
    let a = make();
    assert_eq!(a.cache_status(), &CacheStatus::Built);
    let b = make();
    assert_eq!(b.cache_status(), &CacheStatus::Hit);
    assert_eq!(
        (a.dataset_index(), a.dataset_sample_index()),
        (b.dataset_index(), b.dataset_sample_index())
    );
    let index = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.to_string_lossy()
                .ends_with("-BlendedDataset-train-dataset_index.npy")
        })
        .unwrap();
    let mut bytes = std::fs::read(&index).unwrap();
    let n = bytes.len();
    bytes[n - 2] = 0x7f; // a dataset id that does not exist
    std::fs::write(&index, bytes).unwrap();
    let c = make();
    assert!(matches!(c.cache_status(), CacheStatus::Rebuilt(_)));
    assert_eq!(c.dataset_index(), a.dataset_index());
}
