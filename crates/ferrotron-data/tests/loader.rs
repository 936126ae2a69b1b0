//! DataLoader / PretrainingSampler: DP sharding, exact resume, prefetching, error delivery,
//! shutdown on drop.

use ferrotron_data::indexed::{IndexedDataset, IndexedDatasetBuilder, TokenDtype};
use ferrotron_data::{
    DataLoader, Dataset, DatasetError, GptDataset, GptDatasetConfig, GptSample, LoaderConfig,
    MicroBatch, PretrainingSampler, Split,
};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// `n` samples of `s` positions whose tokens are all `i`; `get(fail_at)` errors, `get(panic_at)`
/// panics; every `get` is counted.
struct Numbered {
    n: usize,
    s: usize,
    fail_at: Option<usize>,
    panic_at: Option<usize>,
    calls: Arc<AtomicUsize>,
}

impl Numbered {
    fn new(n: usize, s: usize) -> Numbered {
        Numbered {
            n,
            s,
            fail_at: None,
            panic_at: None,
            calls: Arc::new(AtomicUsize::new(0)),
        }
    }
}

impl Dataset for Numbered {
    fn len(&self) -> usize {
        self.n
    }

    fn get(&self, i: usize) -> Result<GptSample, DatasetError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if Some(i) == self.fail_at {
            return Err(DatasetError::OutOfRange { index: i, len: 0 });
        }
        assert!(Some(i) != self.panic_at, "boom at {i}");
        let v = |x: u32| vec![x; self.s];
        Ok(GptSample {
            tokens: v(i as u32),
            labels: v(i as u32 + 1),
            loss_mask: vec![1.0; self.s],
            position_ids: (0..self.s as u32).collect(),
            segment_ids: v(0),
            margin: 0.0,
        })
    }
}

fn rows(batches: &[MicroBatch]) -> Vec<usize> {
    batches
        .iter()
        .flat_map(|b| b.sample_indices.clone())
        .collect()
}

#[test]
fn dp_ranks_split_each_global_batch_disjointly() {
    let (mbs, dp, num_micro) = (2, 3, 4);
    let gbs = mbs * dp * num_micro;
    let ds: Arc<dyn Dataset> = Arc::new(Numbered::new(100, 5));
    let mut union = BTreeSet::new();
    for rank in 0..dp {
        let loader = DataLoader::new(ds.clone(), &LoaderConfig::new(mbs, rank, dp, 0)).unwrap();
        let batches: Vec<MicroBatch> = loader.take(num_micro).map(Result::unwrap).collect();
        for (k, b) in batches.iter().enumerate() {
            assert_eq!(
                (b.micro_batch_size, b.seq_length, b.tokens.len()),
                (mbs, 5, mbs * 5)
            );
            // Megatron's layout: rank r takes slice r of each mbs*dp chunk.
            let start = k * mbs * dp + rank * mbs;
            assert_eq!(b.sample_indices, (start..start + mbs).collect::<Vec<_>>());
            assert_eq!(b.tokens[5..10], [start as u32 + 1; 5]); // row 1, row-major
            assert_eq!(b.consumed_samples, (k + 1) * mbs * dp);
        }
        for i in rows(&batches) {
            assert!(union.insert(i), "sample {i} on two ranks");
        }
    }
    assert_eq!(
        union.into_iter().collect::<Vec<_>>(),
        (0..gbs).collect::<Vec<_>>()
    );
}

#[test]
fn resume_continues_at_the_next_sample() {
    let ds: Arc<dyn Dataset> = Arc::new(Numbered::new(90, 3));
    for rank in 0..2 {
        let all: Vec<MicroBatch> = DataLoader::new(ds.clone(), &LoaderConfig::new(3, rank, 2, 0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(all.len(), 15); // 90 / (3 * 2)
        let consumed = all[6].consumed_samples;
        let resumed: Vec<MicroBatch> =
            DataLoader::new(ds.clone(), &LoaderConfig::new(3, rank, 2, consumed))
                .unwrap()
                .map(Result::unwrap)
                .collect();
        assert_eq!(resumed[..], all[7..]);
    }
}

#[test]
fn sampler_checks_and_partial_last_chunk() {
    assert!(PretrainingSampler::new(10, 10, 2, 0, 1, true).is_err());
    assert!(PretrainingSampler::new(0, 0, 2, 0, 1, true).is_err());
    assert!(PretrainingSampler::new(10, 0, 2, 2, 2, true).is_err());
    assert!(PretrainingSampler::new(10, 0, 0, 0, 1, true).is_err());
    // 11 samples, chunks of 4: two full chunks; the partial chunk [8, 11) only without drop_last.
    let dropped: Vec<_> = PretrainingSampler::new(11, 0, 2, 1, 2, true)
        .unwrap()
        .collect();
    assert_eq!(dropped, [vec![2, 3], vec![6, 7]]);
    let kept: Vec<_> = PretrainingSampler::new(11, 0, 2, 1, 2, false)
        .unwrap()
        .collect();
    assert_eq!(kept, [vec![2, 3], vec![6, 7], vec![10]]);
}

#[test]
fn prefetches_ahead_and_stops_when_dropped() {
    let ds = Numbered::new(1000, 4);
    let calls = ds.calls.clone();
    let mut cfg = LoaderConfig::new(2, 0, 1, 0);
    cfg.prefetch = 3;
    let mut loader = DataLoader::new(Arc::new(ds), &cfg).unwrap();
    let t = Instant::now();
    // The worker fills the channel (3 batches) and builds one more while blocked: 8 reads.
    while calls.load(Ordering::SeqCst) < 8 && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        calls.load(Ordering::SeqCst),
        8,
        "read ahead bounded by prefetch"
    );
    assert_eq!(loader.next().unwrap().unwrap().sample_indices, [0, 1]);
    let t = Instant::now();
    drop(loader);
    assert!(t.elapsed() < Duration::from_secs(1));
    let after = calls.load(Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        calls.load(Ordering::SeqCst),
        after,
        "worker kept reading after drop"
    );
}

#[test]
fn worker_errors_and_panics_reach_the_consumer() {
    let mut ds = Numbered::new(100, 2);
    ds.fail_at = Some(5);
    let items: Vec<_> = DataLoader::new(Arc::new(ds), &LoaderConfig::new(2, 0, 1, 0))
        .unwrap()
        .collect();
    assert_eq!(items.len(), 3); // [0,1] [2,3] then the error for [4,5], then the end
    assert!(items[..2].iter().all(Result::is_ok));
    assert!(matches!(
        items[2],
        Err(DatasetError::OutOfRange { index: 5, .. })
    ));

    let mut ds = Numbered::new(100, 2);
    ds.panic_at = Some(2);
    let items: Vec<_> = DataLoader::new(Arc::new(ds), &LoaderConfig::new(2, 0, 1, 0))
        .unwrap()
        .collect();
    assert_eq!(items.len(), 2);
    assert!(matches!(&items[1], Err(DatasetError::Loader(m)) if m.contains("boom at 2")));
}

#[test]
fn loads_gpt_micro_batches() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("d");
    let mut b = IndexedDatasetBuilder::create(&prefix, TokenDtype::U16).unwrap();
    for d in 0..30u32 {
        let doc: Vec<u32> = (0..10 + d % 7)
            .map(|p| if p == 9 + d % 7 { 0 } else { d + 1 })
            .collect();
        b.add_item(&doc[..]).unwrap();
        b.end_document();
    }
    b.finalize().unwrap();
    let indexed = Arc::new(IndexedDataset::open(&prefix).unwrap());
    let mut cfg = GptDatasetConfig::new(8, 1, 0);
    cfg.reset_position_ids = true;
    cfg.reset_attention_mask = true;
    let gpt = Arc::new(GptDataset::build(indexed, Split::Train, Some(40), &cfg).unwrap());
    let loader = DataLoader::new(gpt.clone(), &LoaderConfig::new(4, 1, 2, 8)).unwrap();
    for batch in loader.take(3) {
        let batch = batch.unwrap();
        for (row, &i) in batch.sample_indices.iter().enumerate() {
            let s = gpt.get(i).unwrap();
            let r = row * 8..(row + 1) * 8;
            assert_eq!(batch.tokens[r.clone()], s.tokens[..]);
            assert_eq!(batch.labels[r.clone()], s.labels[..]);
            assert_eq!(batch.position_ids[r.clone()], s.position_ids[..]);
            assert_eq!(batch.segment_ids[r.clone()], s.segment_ids[..]);
            assert_eq!(batch.loss_mask[r], s.loss_mask[..]);
        }
    }
}
