//! Blending several datasets by weight: Megatron-Core's `BlendedDataset`
//! (`megatron/core/datasets/blended_dataset.py`), its index builders (`helpers.cpp:
//! build_blending_indices`, `build_exhaustive_blending_indices`) and the `blend` path of
//! `BlendedMegatronDatasetBuilder` (`blended_megatron_dataset_builder.py`,
//! `_get_size_per_split_per_dataset`) with the blend-string parsing of `utils.py:
//! get_blend_from_list`.
//!
//! Sample `i` of the blend is sample `dataset_sample_index[i]` of dataset `dataset_index[i]`.
//! The indices are built greedily: each position goes to the dataset whose count lags its
//! target `weight * max(i, 1)` the most ("largest sampling error"), ties to the lower index, so
//! every prefix of the blend is as close to the weights as integer counts allow. Both indices
//! equal Megatron's exactly (checked against `helpers_cpp` in `tests/gpt_dataset_parity.rs`) and
//! are cached like the GPT indices (`{hash}-BlendedDataset-{split}-dataset_index.npy`, ...).

use crate::gpt_dataset::cache::{IndexCache, NpyArray};
use crate::gpt_dataset::{CacheStatus, DatasetError, GptSample, Split};
use crate::loader::Dataset;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use crate::gpt_dataset::{BuiltDataset, build_gpt_datasets};

/// Megatron's `mid_level_dataset_surplus`: each contributing dataset is built 0.5% larger than
/// its share so the blend never runs past its end.
pub const MID_LEVEL_DATASET_SURPLUS: f64 = 0.005;

/// A parsed blend: prefixes with optional weights (`None`: weight by dataset size).
#[derive(Clone, Debug, PartialEq)]
pub struct Blend {
    pub prefixes: Vec<PathBuf>,
    pub weights: Option<Vec<f64>>,
}

/// Parses `"0.3 prefixA 0.7 prefixB"` (weight/prefix pairs) or `"prefixA prefixB"` (no weights),
/// separated by whitespace. Like Megatron's `get_blend_from_list`, but a mix (some weights
/// missing, an odd count with weights) is an error instead of silently reading weights as
/// paths. Weights must be finite and > 0; they need not sum to 1.
pub fn parse_blend(blend: &str) -> Result<Blend, DatasetError> {
    let items: Vec<&str> = blend.split_whitespace().collect();
    if items.is_empty() {
        return Err(DatasetError::config("blend", "no dataset prefix given"));
    }
    let is_num = |s: &str| s.parse::<f64>().is_ok();
    let weighted = items.len().is_multiple_of(2) && items.iter().step_by(2).all(|s| is_num(s));
    if !weighted {
        if let Some(w) = items.iter().find(|s| is_num(s)) {
            return Err(DatasetError::config(
                "blend",
                format!("{blend:?}: {w:?} looks like a weight; give a weight before every prefix"),
            ));
        }
        return Ok(Blend {
            prefixes: items.iter().map(PathBuf::from).collect(),
            weights: None,
        });
    }
    let mut prefixes = Vec::new();
    let mut weights = Vec::new();
    for pair in items.chunks(2) {
        let w: f64 = pair[0].parse().unwrap_or(f64::NAN);
        if !w.is_finite() || w <= 0.0 {
            return Err(DatasetError::config(
                "blend",
                format!("weight {} of {} must be finite and > 0", pair[0], pair[1]),
            ));
        }
        weights.push(w);
        prefixes.push(PathBuf::from(pair[1]));
    }
    Ok(Blend {
        prefixes,
        weights: Some(weights),
    })
}

/// Megatron's `normalize`: weights divided by their sum.
pub fn normalize(weights: &[f64]) -> Vec<f64> {
    let sum: f64 = weights.iter().sum();
    weights.iter().map(|w| w / sum).collect()
}

/// `_get_size_per_split_per_dataset` for one split: `ceil(ceil(target * w) * (1 + surplus))`
/// samples per dataset (`surplus = 0` gives the targets themselves).
pub fn sizes_per_dataset(normalized_weights: &[f64], target: usize, surplus: f64) -> Vec<usize> {
    normalized_weights
        .iter()
        .map(|w| ((target as f64 * w).ceil() * (1.0 + surplus)).ceil() as usize)
        .collect()
}

/// `build_blending_indices`: `size` positions, each given to the dataset with the largest
/// `weights[d] * max(i, 1) - count[d]` (first maximum wins). Returns `(dataset_index,
/// dataset_sample_index)`, both `[size]` (both empty when there are no weights).
pub fn build_blending_indices(weights: &[f64], size: usize) -> (Vec<u16>, Vec<u64>) {
    if weights.is_empty() {
        return (Vec::new(), Vec::new());
    }
    let mut counts = vec![0u64; weights.len()];
    let mut dataset_index = Vec::with_capacity(size);
    let mut sample_index = Vec::with_capacity(size);
    for i in 0..size {
        let x = (i as f64).max(1.0);
        let mut best = 0;
        let mut best_err = weights[0] * x - counts[0] as f64;
        for (d, w) in weights.iter().enumerate().skip(1) {
            let err = w * x - counts[d] as f64;
            if err > best_err {
                best = d;
                best_err = err;
            }
        }
        dataset_index.push(best as u16);
        sample_index.push(counts[best]);
        counts[best] += 1;
    }
    (dataset_index, sample_index)
}

/// `build_exhaustive_blending_indices`: exactly `sizes[d]` samples of each dataset, interleaved
/// by the same largest-error rule over the datasets not yet exhausted.
pub fn build_exhaustive_blending_indices(sizes: &[usize]) -> (Vec<u16>, Vec<u64>) {
    let total: usize = sizes.iter().sum();
    let weights: Vec<f64> = sizes.iter().map(|&s| s as f64 / total as f64).collect();
    let mut counts = vec![0u64; sizes.len()];
    let mut dataset_index = Vec::with_capacity(total);
    let mut sample_index = Vec::with_capacity(total);
    for i in 0..total {
        let x = (i as f64).max(1.0);
        let best = (0..sizes.len())
            .filter(|&d| (counts[d] as usize) < sizes[d])
            .fold(None, |acc: Option<(usize, f64)>, d| {
                let err = weights[d] * x - counts[d] as f64;
                match acc {
                    Some((_, e)) if e >= err => acc,
                    _ => Some((d, err)),
                }
            });
        let Some((d, _)) = best else { break };
        dataset_index.push(d as u16);
        sample_index.push(counts[d]);
        counts[d] += 1;
    }
    (dataset_index, sample_index)
}

/// Several datasets mixed by weight (Megatron `BlendedDataset`).
pub struct BlendedDataset {
    datasets: Vec<Arc<dyn Dataset>>,
    weights: Vec<f64>,
    dataset_index: Vec<u16>,        // [len]
    dataset_sample_index: Vec<u64>, // [len]
    description: Value,
    cache_status: CacheStatus,
}

impl BlendedDataset {
    /// Blends `datasets` by `weights` (normalized here when `size` is given) into `size`
    /// samples; `size = None` takes exactly `weights[d]` samples of dataset `d` (weights must
    /// then be whole numbers). Indices are cached under `path_to_cache` when given.
    ///
    /// Errors: no datasets, more than 32767, lengths of `datasets` and `weights` differ, a
    /// weight <= 0 or non-finite, or the blend would read past a dataset's end (Megatron's
    /// oversampling `IndexError`).
    pub fn new(
        datasets: Vec<Arc<dyn Dataset>>,
        weights: &[f64],
        size: Option<usize>,
        split: Split,
        path_to_cache: Option<&Path>,
    ) -> Result<BlendedDataset, DatasetError> {
        check_blend(datasets.len(), weights, size)?;
        let weights = if size.is_some() {
            normalize(weights)
        } else {
            weights.to_vec()
        };
        let description = json!({
            "class": "BlendedDataset",
            "datasets": datasets.iter().map(|d| d.description()).collect::<Vec<_>>(),
            "split": split.name(),
            "weights": weights,
            "size": size,
        });
        let cache = path_to_cache
            .map(|dir| IndexCache::new(dir, "BlendedDataset", split.name(), &description));
        let (status, indices) = match &cache {
            Some(cache) => load_cached(cache, datasets.len()),
            None => (CacheStatus::Disabled, None),
        };
        let (dataset_index, dataset_sample_index) = match indices {
            Some(i) => i,
            None => build_and_store(&datasets, &weights, size, split, cache.as_ref())?,
        };
        check_oversampling(&datasets, &dataset_index, split)?;
        Ok(BlendedDataset {
            datasets,
            weights,
            dataset_index,
            dataset_sample_index,
            description,
            cache_status: status,
        })
    }

    /// `(dataset, sample in that dataset)` for blend sample `i`.
    pub fn locate(&self, i: usize) -> Option<(usize, usize)> {
        Some((
            *self.dataset_index.get(i)? as usize,
            *self.dataset_sample_index.get(i)? as usize,
        ))
    }

    /// Dataset of each sample, `[len]`.
    pub fn dataset_index(&self) -> &[u16] {
        &self.dataset_index
    }

    /// Sample within its dataset of each sample, `[len]`.
    pub fn dataset_sample_index(&self) -> &[u64] {
        &self.dataset_sample_index
    }

    /// The weights used (normalized unless exhaustive).
    pub fn weights(&self) -> &[f64] {
        &self.weights
    }

    /// The blended datasets.
    pub fn datasets(&self) -> &[Arc<dyn Dataset>] {
        &self.datasets
    }

    /// Fraction of the samples taken from each dataset.
    pub fn achieved_ratios(&self) -> Vec<f64> {
        let mut counts = vec![0usize; self.datasets.len()];
        for &d in &self.dataset_index {
            counts[d as usize] += 1;
        }
        let n = self.dataset_index.len().max(1) as f64;
        counts.iter().map(|&c| c as f64 / n).collect()
    }

    /// Cache hit / built / rebuilt.
    pub fn cache_status(&self) -> &CacheStatus {
        &self.cache_status
    }
}

/// Names of the two cached blend indices.
const INDEX_NAMES: [&str; 2] = ["dataset_index", "dataset_sample_index"];

/// The blend indices: `(dataset_index, dataset_sample_index)`.
type BlendIndices = (Vec<u16>, Vec<u64>);

/// Checks `BlendedDataset::new`'s arguments: dataset and weight counts, weight values.
fn check_blend(
    num_datasets: usize,
    weights: &[f64],
    size: Option<usize>,
) -> Result<(), DatasetError> {
    if num_datasets == 0 || num_datasets != weights.len() || num_datasets >= 32767 {
        return Err(DatasetError::config(
            "blend",
            format!("{} datasets with {} weights", num_datasets, weights.len()),
        ));
    }
    if weights.iter().any(|w| !w.is_finite() || *w <= 0.0) {
        return Err(DatasetError::config(
            "blend",
            format!("weights {weights:?} must be > 0"),
        ));
    }
    if size.is_none() && weights.iter().any(|w| w.fract() != 0.0) {
        return Err(DatasetError::config(
            "blend",
            "exhaustive blending needs whole-number weights",
        ));
    }
    Ok(())
}

/// Loads the blend indices from `cache`; the status says why they are missing when they are.
fn load_cached(cache: &IndexCache, num_datasets: usize) -> (CacheStatus, Option<BlendIndices>) {
    match cache.load(&INDEX_NAMES) {
        Ok(Some(a)) => match adopt(&a, num_datasets) {
            Ok(i) => (CacheStatus::Hit, Some(i)),
            Err(why) => (CacheStatus::Rebuilt(why), None),
        },
        Ok(None) => (CacheStatus::Built, None),
        Err(why) => (CacheStatus::Rebuilt(why), None),
    }
}

/// Builds the blend indices (exhaustive when `size` is `None`), checks them against the
/// dataset lengths, and stores them in `cache` when given.
fn build_and_store(
    datasets: &[Arc<dyn Dataset>],
    weights: &[f64],
    size: Option<usize>,
    split: Split,
    cache: Option<&IndexCache>,
) -> Result<BlendIndices, DatasetError> {
    let (di, dsi) = match size {
        Some(n) => build_blending_indices(weights, n),
        None => build_exhaustive_blending_indices(
            &weights.iter().map(|&w| w as usize).collect::<Vec<_>>(),
        ),
    };
    check_oversampling(datasets, &di, split)?;
    if let Some(cache) = cache {
        let a = NpyArray::from_i64("<i2", vec![di.len()], di.iter().map(|&v| v as i64));
        let b = NpyArray::from_i64("<i8", vec![dsi.len()], dsi.iter().map(|&v| v as i64));
        cache.store(&[(INDEX_NAMES[0], &a), (INDEX_NAMES[1], &b)])?;
    }
    Ok((di, dsi))
}

fn adopt(arrays: &[NpyArray], num_datasets: usize) -> Result<(Vec<u16>, Vec<u64>), String> {
    let [a, b] = arrays else {
        return Err("expected 2 arrays".into());
    };
    let di: Vec<u16> = a
        .to_i64()
        .into_iter()
        .map(|v| {
            u16::try_from(v)
                .ok()
                .filter(|&d| (d as usize) < num_datasets)
        })
        .collect::<Option<_>>()
        .ok_or("dataset_index names a dataset that does not exist")?;
    let dsi: Vec<u64> = b
        .to_i64()
        .into_iter()
        .map(|v| u64::try_from(v).ok())
        .collect::<Option<_>>()
        .ok_or("negative dataset_sample_index")?;
    if di.len() != dsi.len() {
        return Err("dataset_index and dataset_sample_index differ in length".into());
    }
    Ok((di, dsi))
}

fn check_oversampling(
    datasets: &[Arc<dyn Dataset>],
    index: &[u16],
    split: Split,
) -> Result<(), DatasetError> {
    let mut counts = vec![0usize; datasets.len()];
    for &d in index {
        if let Some(c) = counts.get_mut(d as usize) {
            *c += 1;
        }
    }
    for (d, (&c, ds)) in counts.iter().zip(datasets).enumerate() {
        if c > ds.len() {
            return Err(DatasetError::index(
                "blend",
                format!(
                    "the {} blend requests {c} samples from dataset {d}, which has {}; \
                     raise the surplus (Megatron's mid_level_dataset_surplus)",
                    split.name(),
                    ds.len()
                ),
            ));
        }
    }
    Ok(())
}

impl Dataset for BlendedDataset {
    fn len(&self) -> usize {
        self.dataset_index.len()
    }

    fn get(&self, i: usize) -> Result<GptSample, DatasetError> {
        let (d, s) = self.locate(i).ok_or(DatasetError::OutOfRange {
            index: i,
            len: self.len(),
        })?;
        self.datasets[d].get(s)
    }

    fn description(&self) -> Value {
        self.description.clone()
    }
}
