//! `GptDatasetConfig` and the train/valid/test split arithmetic of Megatron-Core
//! (`blended_megatron_dataset_config.py`: `parse_and_normalize_split`,
//! `convert_split_vector_to_split_matrix`; `blended_megatron_dataset_builder.py`: the split
//! bookends `int(round(bookend * num_elements))`).

use super::DatasetError;
use std::ops::Range;
use std::path::PathBuf;

/// Megatron's default `--split`.
pub const DEFAULT_SPLIT: &str = "969,30,1";

/// A dataset split (Megatron's `Split` enum; `name()` is its `.name`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Split {
    Train,
    Valid,
    Test,
}

impl Split {
    /// All splits in Megatron's order (train 0, valid 1, test 2).
    pub const ALL: [Split; 3] = [Split::Train, Split::Valid, Split::Test];

    /// `"train"`, `"valid"` or `"test"` (used in cache file names and descriptions).
    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Valid => "valid",
            Split::Test => "test",
        }
    }

    /// Position in [`Split::ALL`] and in split vectors / matrices.
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Configuration of a [`GptDataset`](super::GptDataset) (Megatron's `GPTDatasetConfig`, the fields
/// that matter without a tokenizer object).
#[derive(Clone, Debug, PartialEq)]
pub struct GptDatasetConfig {
    /// Tokens per sample `s` (`sequence_length`); each sample reads `s + 1` tokens when
    /// `add_extra_token_to_sequence`.
    pub seq_length: usize,
    /// Seed of the NumPy `RandomState` that shuffles the document and shuffle indices
    /// (`random_seed`).
    pub seed: u32,
    /// Split weights, e.g. `"969,30,1"` (train, valid, test; missing entries are 0).
    pub split: String,
    /// Restart position ids after every EOD token.
    pub reset_position_ids: bool,
    /// Block attention across EOD tokens (see [`GptSample::segment_ids`](super::GptSample)).
    pub reset_attention_mask: bool,
    /// Zero the loss where the input token is EOD.
    pub eod_mask_loss: bool,
    /// The tokenizer's end-of-document id (`tokenizer.eod`).
    pub eod: u32,
    /// Folder for the cached indices; `None` builds them in memory on every run (Megatron defaults
    /// to `<dataset dir>/cache/GPTDataset_indices`; ours never writes next to data unasked).
    pub path_to_cache: Option<PathBuf>,
    /// Read `s + 1` tokens per sample so inputs and shifted labels both have `s` tokens.
    pub add_extra_token_to_sequence: bool,
    /// For the valid split only: drop the last partial sample (else pad it; pads have loss 0).
    pub drop_last_partial_validation_sequence: bool,
}

impl GptDatasetConfig {
    /// A config with Megatron's defaults for everything but `seq_length`, `seed` and `eod`:
    /// split `"969,30,1"`, no resets, no EOD loss masking, no cache, extra token on.
    pub fn new(seq_length: usize, seed: u32, eod: u32) -> GptDatasetConfig {
        GptDatasetConfig {
            seq_length,
            seed,
            split: DEFAULT_SPLIT.to_string(),
            reset_position_ids: false,
            reset_attention_mask: false,
            eod_mask_loss: false,
            eod,
            path_to_cache: None,
            add_extra_token_to_sequence: true,
            drop_last_partial_validation_sequence: true,
        }
    }

    /// Checks `seq_length` and the split string.
    pub fn validate(&self) -> Result<(), DatasetError> {
        if self.seq_length == 0 || self.seq_length > i32::MAX as usize - 1 {
            return Err(DatasetError::config(
                "seq_length",
                format!("{} (must be 1..2^31-2)", self.seq_length),
            ));
        }
        parse_and_normalize_split(&self.split).map(|_| ())
    }

    /// `split_matrix`: the `[start, end)` fraction of the documents for each split, or `None`
    /// for a split of weight 0.
    pub fn split_matrix(&self) -> Result<[Option<(f64, f64)>; 3], DatasetError> {
        Ok(split_matrix(&parse_and_normalize_split(&self.split)?))
    }

    /// `1` when the extra token is on, else `0` (Megatron adds the bool as an int).
    pub(crate) fn extra(&self) -> usize {
        self.add_extra_token_to_sequence as usize
    }
}

/// Megatron's `parse_and_normalize_split`: up to three non-negative numbers separated by commas
/// (or whitespace), padded with zeros and divided by their sum, e.g. `"969,30,1"` ->
/// `[0.969, 0.03, 0.001]`.
///
/// Stricter than Megatron (which keeps whatever matches `[.0-9]+`, so `"1,x"` silently means
/// `"1"` and `"-1"` means `"1"`): every field must be a finite number >= 0 and the sum > 0.
pub fn parse_and_normalize_split(split: &str) -> Result<[f64; 3], DatasetError> {
    let fields: Vec<&str> = split
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|f| !f.is_empty())
        .collect();
    if fields.is_empty() || fields.len() > 3 {
        return Err(DatasetError::config(
            "split",
            format!("{split:?}: expected 1 to 3 comma-separated weights (train,valid,test)"),
        ));
    }
    let mut v = [0.0f64; 3];
    for (slot, field) in v.iter_mut().zip(&fields) {
        let x: f64 = field.parse().map_err(|_| {
            DatasetError::config("split", format!("{split:?}: {field:?} is not a number"))
        })?;
        if !x.is_finite() || x < 0.0 {
            return Err(DatasetError::config(
                "split",
                format!("{split:?}: weight {field} must be finite and >= 0"),
            ));
        }
        *slot = x;
    }
    // numpy.sum over 3 values adds left to right; then element-wise division.
    let sum = v[0] + v[1] + v[2];
    if sum <= 0.0 {
        return Err(DatasetError::config(
            "split",
            format!("{split:?}: the weights sum to 0"),
        ));
    }
    Ok(v.map(|x| x / sum))
}

/// Megatron's `convert_split_vector_to_split_matrix(v)` (one vector): cumulative bookends
/// `[(0, v0), (v0, v0+v1), (v0+v1, v0+v1+v2)]`, `None` where a split is empty.
pub fn split_matrix(v: &[f64; 3]) -> [Option<(f64, f64)>; 3] {
    let e = [0.0, v[0], v[0] + v[1], v[0] + v[1] + v[2]];
    std::array::from_fn(|i| (e[i + 1] > e[i]).then_some((e[i], e[i + 1])))
}

/// The element (sequence) range of one split: `int(round(bookend * num_elements))` at both
/// ends, with Python's round-half-to-even. `None` when the split has weight 0.
pub fn split_range(
    matrix: &[Option<(f64, f64)>; 3],
    split: Split,
    num_elements: usize,
) -> Option<Range<usize>> {
    let (a, b) = matrix[split.index()]?;
    let n = num_elements as f64;
    let at = |x: f64| ((x * n).round_ties_even().max(0.0) as usize).min(num_elements);
    Some(at(a)..at(b).max(at(a)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_parse_like_megatron_and_reject_garbage() {
        assert_eq!(parse_and_normalize_split("2,2").unwrap(), [0.5, 0.5, 0.0]);
        assert_eq!(
            parse_and_normalize_split("98, 2").unwrap(),
            [0.98, 0.02, 0.0]
        );
        for bad in ["1,x", "", "1,2,3,4", "-1,2", "0,0", "nan", "inf,1"] {
            assert!(parse_and_normalize_split(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn ranges_round_half_to_even() {
        let m = split_matrix(&[0.5, 0.5, 0.0]);
        assert_eq!(m[2], None);
        // 0.5 * 5 = 2.5 rounds to 2 (Python round), not 3.
        assert_eq!(split_range(&m, Split::Train, 5), Some(0..2));
        assert_eq!(split_range(&m, Split::Valid, 5), Some(2..5));
        assert_eq!(split_range(&m, Split::Test, 5), None);
    }
}
