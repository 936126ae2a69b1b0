//! Megatron-Core's `BlendedMegatronDatasetBuilder.build()` (`blended_megatron_dataset_builder.py`)
//! for a `blend` with a split string: GPT datasets per split, blended by weight when there are
//! several prefixes.

use super::{DatasetError, GptDataset, GptDatasetConfig, GptSample, Split};
use crate::blended::{
    Blend, BlendedDataset, MID_LEVEL_DATASET_SURPLUS, normalize, sizes_per_dataset,
};
use crate::indexed::IndexedDataset;
use crate::loader::Dataset;
use serde_json::Value;
use std::sync::Arc;

impl Dataset for GptDataset {
    fn len(&self) -> usize {
        GptDataset::len(self)
    }

    fn get(&self, i: usize) -> Result<GptSample, DatasetError> {
        GptDataset::get(self, i)
    }

    fn description(&self) -> Value {
        GptDataset::description(self).clone()
    }
}

/// What [`build_gpt_datasets`] returns per split: a plain GPT dataset (one prefix without
/// weights) or a blend. Use it as a [`Dataset`] (`Arc<BuiltDataset>` coerces to
/// `Arc<dyn Dataset>`) or match it to inspect the indices.
pub enum BuiltDataset {
    Gpt(GptDataset),
    Blended(BlendedDataset),
}

impl Dataset for BuiltDataset {
    fn len(&self) -> usize {
        match self {
            BuiltDataset::Gpt(d) => d.len(),
            BuiltDataset::Blended(d) => Dataset::len(d),
        }
    }

    fn get(&self, i: usize) -> Result<GptSample, DatasetError> {
        match self {
            BuiltDataset::Gpt(d) => d.get(i),
            BuiltDataset::Blended(d) => Dataset::get(d, i),
        }
    }

    fn description(&self) -> Value {
        match self {
            BuiltDataset::Gpt(d) => d.description().clone(),
            BuiltDataset::Blended(d) => Dataset::description(d),
        }
    }
}

/// Megatron's `BlendedMegatronDatasetBuilder.build()` for a `blend` with a split string: one
/// dataset (or `None`) per split, `sizes[i]` samples for split `i`.
///
/// * one prefix without weights: the [`GptDataset`] itself;
/// * weights: each prefix's split built with `ceil(ceil(size * w) * 1.005)` samples, blended
///   into `sum(ceil(size * w))` samples (needs a size for every split with weight > 0);
/// * several prefixes without weights: one epoch of each, weighted by their lengths, blended
///   into `min(size, total)` samples, or exhaustively when the size is `None`.
pub fn build_gpt_datasets(
    blend: &Blend,
    sizes: [Option<usize>; 3],
    config: &GptDatasetConfig,
) -> Result<[Option<Arc<BuiltDataset>>; 3], DatasetError> {
    let indexed = blend
        .prefixes
        .iter()
        .map(|p| IndexedDataset::open(p).map(Arc::new))
        .collect::<Result<Vec<_>, _>>()?;
    let matrix = config.split_matrix()?;
    let weights = blend.weights.as_deref().map(normalize);
    if indexed.len() == 1 && weights.is_none() {
        let splits = GptDataset::build_splits(indexed[0].clone(), sizes, config)?;
        return Ok(splits.map(|d| d.map(|d| Arc::new(BuiltDataset::Gpt(d)))));
    }
    let mut out: [Option<Arc<BuiltDataset>>; 3] = [None, None, None];
    for split in Split::ALL {
        let i = split.index();
        if matrix[i].is_none() {
            continue;
        }
        let cache = config.path_to_cache.as_deref();
        let (mids, weights_i, size_i): (Vec<Arc<dyn Dataset>>, Vec<f64>, Option<usize>) =
            match (&weights, sizes[i]) {
                (Some(w), Some(size)) => {
                    let buffer = sizes_per_dataset(w, size, MID_LEVEL_DATASET_SURPLUS);
                    let target: usize = sizes_per_dataset(w, size, 0.0).iter().sum();
                    let mids = indexed
                        .iter()
                        .zip(&buffer)
                        .map(|(ix, &n)| build_mid(ix, split, Some(n), config))
                        .collect::<Result<Vec<_>, _>>()?;
                    (mids, w.clone(), Some(target))
                }
                (Some(_), None) => {
                    return Err(DatasetError::config(
                        "sizes",
                        format!(
                            "a weighted blend needs a sample count for the {} split",
                            split.name()
                        ),
                    ));
                }
                (None, size) => {
                    let mids = indexed
                        .iter()
                        .map(|ix| build_mid(ix, split, None, config))
                        .collect::<Result<Vec<_>, _>>()?;
                    let lens: Vec<f64> = mids.iter().map(|d| d.len() as f64).collect();
                    let total = mids.iter().map(|d| d.len()).sum::<usize>();
                    (mids, lens, size.map(|s| s.min(total)))
                }
            };
        out[i] = Some(Arc::new(BuiltDataset::Blended(BlendedDataset::new(
            mids, &weights_i, size_i, split, cache,
        )?)));
    }
    Ok(out)
}

fn build_mid(
    indexed: &Arc<IndexedDataset>,
    split: Split,
    num_samples: Option<usize>,
    config: &GptDatasetConfig,
) -> Result<Arc<dyn Dataset>, DatasetError> {
    Ok(Arc::new(GptDataset::build(
        indexed.clone(),
        split,
        num_samples,
        config,
    )?))
}
