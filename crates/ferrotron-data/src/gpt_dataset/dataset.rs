//! [`GptDataset`]: building / loading the indices and reading samples
//! (Megatron `GPTDataset._build_document_sample_shuffle_indices` and
//! `_query_document_sample_shuffle_indices`).

use super::cache::{IndexCache, NpyArray};
use super::indices::{
    EpochPlan, build_document_index, build_sample_index, build_shuffle_index, plan_epochs,
};
use super::numpy_rng::RandomState;
use super::{CacheStatus, DatasetError, GptDatasetConfig, GptSample, Split, split_range};
use crate::indexed::IndexedDataset;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::ops::Range;
use std::sync::Arc;

/// One split of an indexed dataset cut into `seq_length`-token samples (Megatron `GPTDataset`).
pub struct GptDataset {
    indexed: Arc<IndexedDataset>,
    config: GptDatasetConfig,
    split: Split,
    documents: Range<usize>,
    plan: EpochPlan,
    document_index: Vec<u32>,    // [epochs * documents], sequence ids
    sample_index: Vec<[u32; 2]>, // [samples + 1], (document_index position, token offset)
    shuffle_index: Vec<u32>,     // [samples]
    description: Value,
    cache_status: CacheStatus,
}

const NAMES: [&str; 3] = ["document_index", "sample_index", "shuffle_index"];

/// The sequence ids of `split`: an error when the split has weight 0, is empty, or ends past
/// 2^31 documents.
fn split_documents(
    indexed: &IndexedDataset,
    split: Split,
    config: &GptDatasetConfig,
) -> Result<Range<usize>, DatasetError> {
    let matrix = config.split_matrix()?;
    let n = indexed.len();
    let documents = split_range(&matrix, split, n).ok_or_else(|| {
        DatasetError::config(
            "split",
            format!(
                "the {} split has weight 0 in {:?}",
                split.name(),
                config.split
            ),
        )
    })?;
    if documents.is_empty() {
        return Err(DatasetError::config(
            "split",
            format!(
                "the {} split of {:?} over {n} sequences of {} is empty ({documents:?})",
                split.name(),
                config.split,
                indexed.bin_path().display()
            ),
        ));
    }
    if documents.end > i32::MAX as usize {
        return Err(DatasetError::config("split", "more than 2^31 documents"));
    }
    Ok(documents)
}

impl GptDataset {
    /// Builds (or loads from `config.path_to_cache`) the indices for `split` of `indexed`.
    ///
    /// `num_samples`: samples to draw, repeating the split for as many epochs as needed;
    /// `None` gives exactly one epoch (the dataset may hold slightly more samples than asked,
    /// never fewer). Errors: invalid config, a split of weight 0 or without documents, samples
    /// requested from a split without tokens, cache I/O failures (a stale or corrupt cache is
    /// not an error: it is rebuilt, see [`cache_status`](Self::cache_status)).
    pub fn build(
        indexed: Arc<IndexedDataset>,
        split: Split,
        num_samples: Option<usize>,
        config: &GptDatasetConfig,
    ) -> Result<GptDataset, DatasetError> {
        config.validate()?;
        let documents = split_documents(&indexed, split, config)?;
        let tokens_per_epoch: u64 = indexed.sequence_lengths()[documents.clone()]
            .iter()
            .map(|&l| l as u64)
            .sum();
        let plan = plan_epochs(
            tokens_per_epoch,
            num_samples,
            config.seq_length,
            config.extra(),
        )?;
        let drop_last = split != Split::Valid || config.drop_last_partial_validation_sequence;
        let description = describe(&indexed, split, num_samples, config, &documents, drop_last)?;

        let mut ds = GptDataset {
            indexed,
            config: config.clone(),
            split,
            documents,
            plan,
            document_index: Vec::new(),
            sample_index: Vec::new(),
            shuffle_index: Vec::new(),
            description,
            cache_status: CacheStatus::Disabled,
        };
        ds.load_or_build_indices(tokens_per_epoch, drop_last)?;
        Ok(ds)
    }

    /// Fills the indices from the cache when it holds them, else builds them (and caches them
    /// when a cache directory is set), recording which in `cache_status`.
    fn load_or_build_indices(
        &mut self,
        tokens_per_epoch: u64,
        drop_last: bool,
    ) -> Result<(), DatasetError> {
        let Some(dir) = self.config.path_to_cache.as_deref() else {
            (self.document_index, self.sample_index, self.shuffle_index) =
                self.build_indices(tokens_per_epoch, drop_last)?;
            return Ok(());
        };
        let cache = IndexCache::new(dir, "GptDataset", self.split.name(), &self.description);
        let reason = match cache.load(&NAMES) {
            Ok(Some(arrays)) => match self.adopt(&arrays) {
                Ok(()) => {
                    self.cache_status = CacheStatus::Hit;
                    return Ok(());
                }
                Err(why) => Some(why),
            },
            Ok(None) => None,
            Err(why) => Some(why),
        };
        (self.document_index, self.sample_index, self.shuffle_index) =
            self.build_indices(tokens_per_epoch, drop_last)?;
        let (d, s, sh) = self.to_arrays();
        cache.store(&[(NAMES[0], &d), (NAMES[1], &s), (NAMES[2], &sh)])?;
        self.cache_status = reason.map_or(CacheStatus::Built, CacheStatus::Rebuilt);
        Ok(())
    }

    /// Builds every split with weight > 0, like Megatron's builder for a single prefix:
    /// `sizes[i]` is `num_samples` for split `i`. A split that rounds to no documents is `None`
    /// unless samples were requested from it (then an error).
    pub fn build_splits(
        indexed: Arc<IndexedDataset>,
        sizes: [Option<usize>; 3],
        config: &GptDatasetConfig,
    ) -> Result<[Option<GptDataset>; 3], DatasetError> {
        let matrix = config.split_matrix()?;
        let mut out: [Option<GptDataset>; 3] = [None, None, None];
        for split in Split::ALL {
            let i = split.index();
            let Some(range) = split_range(&matrix, split, indexed.len()) else {
                continue;
            };
            if range.is_empty() && sizes[i].is_none_or(|n| n == 0) {
                continue;
            }
            out[i] = Some(GptDataset::build(indexed.clone(), split, sizes[i], config)?);
        }
        Ok(out)
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.shuffle_index.len()
    }

    /// True when the split holds fewer tokens than one sample.
    pub fn is_empty(&self) -> bool {
        self.shuffle_index.is_empty()
    }

    /// Sample `i` (after the shuffle), `[seq_length]` per field.
    pub fn get(&self, i: usize) -> Result<GptSample, DatasetError> {
        let (text, real) = self.text(i)?;
        Ok(GptSample::from_text(&text, real, &self.config))
    }

    /// The `seq_length + extra` token ids of sample `i` (padded with 0 when the kept partial
    /// validation sample is short) and how many of them are real tokens.
    pub fn text(&self, i: usize) -> Result<(Vec<u32>, usize), DatasetError> {
        let corrupt = |d: &str| DatasetError::index("sample index", d.to_string());
        let idx = *self.shuffle_index.get(i).ok_or(DatasetError::OutOfRange {
            index: i,
            len: self.len(),
        })? as usize;
        let (Some(&[b_pos, b_off]), Some(&[e_pos, e_off])) =
            (self.sample_index.get(idx), self.sample_index.get(idx + 1))
        else {
            return Err(corrupt("shuffle index points past the sample index"));
        };
        let want = self.config.seq_length + self.config.extra();
        let mut text = Vec::with_capacity(want);
        for pos in b_pos..=e_pos {
            let doc = *self
                .document_index
                .get(pos as usize)
                .ok_or_else(|| corrupt("sample index points past the document index"))?
                as usize;
            let size = *self.indexed.sequence_lengths().get(doc).unwrap_or(&0) as usize;
            let offset = if pos == b_pos { b_off as usize } else { 0 };
            let length = if pos < e_pos {
                size.saturating_sub(offset)
            } else {
                (e_off as usize + self.config.extra())
                    .saturating_sub(offset)
                    .min(size.saturating_sub(offset))
            };
            self.indexed.read_into(doc, offset, length, &mut text)?;
        }
        let real = text.len();
        if real > want {
            return Err(corrupt("a sample spans more tokens than seq_length + 1"));
        }
        text.resize(want, 0);
        Ok((text, real))
    }

    /// The split this dataset covers.
    pub fn split(&self) -> Split {
        self.split
    }

    /// Sequence ids `start..end` of the split in the indexed dataset.
    pub fn documents(&self) -> Range<usize> {
        self.documents.clone()
    }

    /// The config the dataset was built with.
    pub fn config(&self) -> &GptDatasetConfig {
        &self.config
    }

    /// Epoch count and final-epoch separation.
    pub fn epoch_plan(&self) -> EpochPlan {
        self.plan
    }

    /// Document index, `[epochs * documents]` sequence ids.
    pub fn document_index(&self) -> &[u32] {
        &self.document_index
    }

    /// Sample index, `[samples + 1]` of (document-index position, token offset).
    pub fn sample_index(&self) -> &[[u32; 2]] {
        &self.sample_index
    }

    /// Shuffle index, `[samples]`.
    pub fn shuffle_index(&self) -> &[u32] {
        &self.shuffle_index
    }

    /// Whether the indices came from the cache, were built, or were rebuilt (and why).
    pub fn cache_status(&self) -> &CacheStatus {
        &self.cache_status
    }

    /// The JSON description hashed into the cache key.
    pub fn description(&self) -> &Value {
        &self.description
    }

    /// Document, sample and shuffle index from scratch, drawing both shuffles from one
    /// `RandomState(seed)` in Megatron's order.
    #[allow(clippy::type_complexity)]
    fn build_indices(
        &self,
        tokens_per_epoch: u64,
        drop_last: bool,
    ) -> Result<(Vec<u32>, Vec<[u32; 2]>, Vec<u32>), DatasetError> {
        let (config, plan) = (&self.config, self.plan);
        let mut rng = RandomState::new(config.seed);
        let docs = self.documents.start as u32..self.documents.end as u32;
        let doc_index =
            build_document_index(docs, plan.num_epochs, &mut rng, plan.separate_final_epoch)?;
        let sample_index = build_sample_index(
            self.indexed.sequence_lengths(),
            &doc_index,
            config.seq_length,
            plan.num_epochs,
            tokens_per_epoch,
            drop_last,
            config.extra(),
        )?;
        let total = sample_index.len() - 1;
        let first = if plan.separate_final_epoch {
            plan.num_samples_sans_final_epoch
        } else {
            total
        };
        let shuffle = build_shuffle_index(first, total, &mut rng)?;
        Ok((doc_index, sample_index, shuffle))
    }

    fn to_arrays(&self) -> (NpyArray, NpyArray, NpyArray) {
        let doc = NpyArray::from_i64(
            "<i4",
            vec![self.document_index.len()],
            self.document_index.iter().map(|&d| d as i64),
        );
        let max = self
            .sample_index
            .iter()
            .flatten()
            .copied()
            .max()
            .unwrap_or(0);
        let sample = NpyArray::from_i64(
            if max <= i32::MAX as u32 { "<i4" } else { "<i8" },
            vec![self.sample_index.len(), 2],
            self.sample_index.iter().flatten().map(|&v| v as i64),
        );
        let shuffle = NpyArray::from_i64(
            "<u4",
            vec![self.shuffle_index.len()],
            self.shuffle_index.iter().map(|&v| v as i64),
        );
        (doc, sample, shuffle)
    }

    /// Takes loaded arrays after checking shapes and bounds (so `get` cannot misbehave).
    fn adopt(&mut self, arrays: &[NpyArray]) -> Result<(), String> {
        let u32s = |a: &NpyArray, what: &str| -> Result<Vec<u32>, String> {
            a.to_i64()
                .into_iter()
                .map(|v| u32::try_from(v).map_err(|_| format!("{what}: value {v} out of range")))
                .collect()
        };
        let [d, s, sh] = arrays else {
            return Err("expected 3 arrays".into());
        };
        let doc = u32s(d, "document_index")?;
        let flat = u32s(s, "sample_index")?;
        let shuffle = u32s(sh, "shuffle_index")?;
        let docs = self.documents.start as u32..self.documents.end as u32;
        if doc.len() != self.plan.num_epochs * self.documents.len()
            || doc.iter().any(|x| !docs.contains(x))
        {
            return Err("document_index does not fit the split".into());
        }
        if s.shape.len() != 2 || s.shape[1] != 2 || flat.is_empty() {
            return Err(format!("sample_index has shape {:?}", s.shape));
        }
        let sample: Vec<[u32; 2]> = flat.chunks_exact(2).map(|c| [c[0], c[1]]).collect();
        let sizes = self.indexed.sequence_lengths();
        let ok = sample.windows(2).all(|w| w[0] <= w[1])
            && sample.iter().all(|&[p, o]| {
                doc.get(p as usize)
                    .is_some_and(|&dd| o <= sizes[dd as usize])
            });
        if !ok || shuffle.len() != sample.len() - 1 {
            return Err("sample_index is inconsistent with the dataset".into());
        }
        let mut seen = vec![false; shuffle.len()];
        for &v in &shuffle {
            match seen.get_mut(v as usize) {
                Some(slot) if !*slot => *slot = true,
                _ => return Err("shuffle_index is not a permutation".into()),
            }
        }
        (self.document_index, self.sample_index, self.shuffle_index) = (doc, sample, shuffle);
        Ok(())
    }
}

/// The identity of a dataset's indices (Megatron's `unique_identifiers`, plus the dataset's
/// sequence count, token count and sequence-length hash so a changed dataset is detected).
fn describe(
    indexed: &IndexedDataset,
    split: Split,
    num_samples: Option<usize>,
    config: &GptDatasetConfig,
    documents: &Range<usize>,
    drop_last: bool,
) -> Result<Value, DatasetError> {
    let mut h = Sha256::new();
    for chunk in indexed.sequence_lengths().chunks(4096) {
        let bytes: Vec<u8> = chunk.iter().flat_map(|l| l.to_le_bytes()).collect();
        h.update(&bytes);
    }
    let lengths_hash: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    let path = indexed.bin_path().with_extension("");
    let matrix = config.split_matrix()?;
    Ok(json!({
        "class": "GptDataset",
        "dataset_path": path.to_string_lossy(),
        "dataset": {
            "sequences": indexed.len(),
            "tokens": indexed.num_tokens(),
            "sequence_lengths_sha256": lengths_hash,
        },
        "num_samples": num_samples,
        "index_split": split.name(),
        "random_seed": config.seed,
        "sequence_length": config.seq_length,
        "split": config.split,
        "split_matrix": matrix.iter().map(|m| m.map(|(a, b)| [a, b])).collect::<Vec<_>>(),
        "documents": [documents.start, documents.end],
        "add_extra_token_to_sequence": config.add_extra_token_to_sequence,
        "drop_last_partial_sequence": drop_last,
    }))
}
