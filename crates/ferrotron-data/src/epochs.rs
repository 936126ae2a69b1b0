//! [`EpochDataset`]: one split (train/valid/test) of a finished dataset — the SFT datasets,
//! whose sequences are already built — repeated over shuffled epochs until a requested number
//! of samples, the way Megatron's GPTDataset walks its documents (one NumPy-seeded shuffle per
//! epoch) and Pai-Megatron-Patch's SFT runs cycle through their data.
//!
//! The split ranges are Megatron's (`--split` weights, round-half-to-even bookends,
//! [`split_range`]); epoch `e` of split `k` is the split's samples shuffled by
//! `numpy.random.RandomState(seed + 1000·k + e)`.

use crate::gpt_dataset::numpy_rng::RandomState;
use crate::gpt_dataset::{DatasetError, GptSample, Split, parse_and_normalize_split};
use crate::gpt_dataset::{split_matrix, split_range};
use crate::loader::Dataset;
use std::sync::Arc;

/// A shuffled, epoch-repeated view of part of another dataset.
pub struct EpochDataset {
    inner: Arc<dyn Dataset>,
    /// Sample `i` of this view is `inner.get(order[i])`.
    order: Vec<u32>,
    split: Split,
}

impl EpochDataset {
    /// Which split this view is.
    pub fn split(&self) -> Split {
        self.split
    }

    /// Index into the underlying dataset of every sample, in order.
    pub fn order(&self) -> &[u32] {
        &self.order
    }
}

impl Dataset for EpochDataset {
    fn len(&self) -> usize {
        self.order.len()
    }

    fn get(&self, i: usize) -> Result<GptSample, DatasetError> {
        let j = *self.order.get(i).ok_or_else(|| {
            DatasetError::config(
                "index",
                format!("sample {i} is out of range ({} samples)", self.order.len()),
            )
        })?;
        self.inner.get(j as usize)
    }
}

/// Splits `inner` by the `split` weights (`"969,30,1"`) and builds each split with at least
/// `sizes[k]` samples (whole shuffled epochs, truncated to `sizes[k]`), or exactly one epoch when
/// `sizes[k]` is `None`. A split of weight 0 is `None`.
///
/// # Errors
/// A malformed `split`, more than `u32::MAX` samples, or a split that is requested
/// (`sizes[k] = Some(n > 0)`) but holds no sample (e.g. too little data for its weight).
pub fn build_epoch_splits(
    inner: Arc<dyn Dataset>,
    split: &str,
    sizes: [Option<usize>; 3],
    seed: u32,
) -> Result<[Option<Arc<EpochDataset>>; 3], DatasetError> {
    let weights = parse_and_normalize_split(split)?;
    let matrix = split_matrix(&weights);
    let n = inner.len();
    if n > u32::MAX as usize {
        return Err(DatasetError::config(
            "data_path",
            format!("{n} samples exceed the 2^32 this index holds"),
        ));
    }
    let mut out: [Option<Arc<EpochDataset>>; 3] = [None, None, None];
    for (k, s) in [Split::Train, Split::Valid, Split::Test]
        .into_iter()
        .enumerate()
    {
        let Some(range) = split_range(&matrix, s, n) else {
            continue;
        };
        let want = sizes[k];
        if range.is_empty() {
            if want.is_some_and(|w| w > 0) {
                return Err(DatasetError::config(
                    "split",
                    format!("{split:?} leaves no {} samples out of {n}", s.name()),
                ));
            }
            continue;
        }
        let target = want.unwrap_or(range.len());
        let mut order = Vec::with_capacity(target.max(range.len()));
        let mut epoch = 0u32;
        while order.len() < target {
            let mut ep: Vec<u32> = (range.start as u32..range.end as u32).collect();
            RandomState::new(seed.wrapping_add(1000 * k as u32).wrapping_add(epoch))
                .shuffle(&mut ep);
            order.extend(ep);
            epoch += 1;
        }
        order.truncate(target);
        out[k] = Some(Arc::new(EpochDataset {
            inner: inner.clone(),
            order,
            split: s,
        }));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Numbers(usize);

    impl Dataset for Numbers {
        fn len(&self) -> usize {
            self.0
        }

        fn get(&self, i: usize) -> Result<GptSample, DatasetError> {
            Ok(GptSample {
                tokens: vec![i as u32],
                labels: vec![0],
                loss_mask: vec![1.0],
                position_ids: vec![0],
                segment_ids: vec![0],
                margin: 0.0,
            })
        }
    }

    #[test]
    fn splits_are_disjoint_and_epochs_cover_each_split() {
        let [train, valid, test] =
            build_epoch_splits(Arc::new(Numbers(100)), "90,10", [Some(250), None, None], 7)
                .unwrap();
        assert!(test.is_none());
        let (train, valid) = (train.unwrap(), valid.unwrap());
        assert_eq!(train.len(), 250);
        assert_eq!(valid.len(), 10);
        assert!(valid.order().iter().all(|&i| (90..100).contains(&i)));
        // Every epoch is a permutation of the train range, and epochs differ.
        let epochs: Vec<Vec<u32>> = train.order()[..180]
            .chunks(90)
            .map(<[u32]>::to_vec)
            .collect();
        for e in &epochs {
            let mut s = e.clone();
            s.sort_unstable();
            assert_eq!(s, (0..90).collect::<Vec<u32>>());
        }
        assert_ne!(epochs[0], epochs[1]);
        assert_eq!(train.get(3).unwrap().tokens[0], train.order()[3]);
        // Deterministic in the seed.
        let again = build_epoch_splits(Arc::new(Numbers(100)), "90,10", [Some(250), None, None], 7)
            .unwrap();
        assert_eq!(again[0].as_ref().unwrap().order(), train.order());
        assert!(train.get(250).is_err());
    }

    #[test]
    fn empty_requested_split_is_an_error() {
        let err = build_epoch_splits(Arc::new(Numbers(10)), "99,1", [Some(5), Some(5), None], 1)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("leaves no valid samples out of 10"), "{err}");
    }
}
