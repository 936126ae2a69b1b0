//! The train and validation datasets of a run: Megatron GPT datasets (blends of `.bin/.idx`)
//! for pretraining, SFT sequences (raw chat/alpaca JSONL or Pai's idxmap form) split and
//! repeated over shuffled epochs for fine-tuning, or DPO's preference pairs (split and
//! shuffled as pairs, handed out as rows).

use super::{Context, NoteSink, RunError, RunNote};
use crate::config::{DatasetType, RunConfig};
use ferrotron_data::dpo::{DpoPairs, DpoRows, load_dpo_jsonl};
use ferrotron_data::sft::{IdxmapSftDataset, RawSftDataset, SftEncoder, SftOptions};
use ferrotron_data::{Blend, Dataset, GptDatasetConfig, build_epoch_splits, build_gpt_datasets};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Train, validation and test datasets (each when the split has it).
type Splits = [Option<Arc<dyn Dataset>>; 3];

/// The datasets of one run.
pub struct RunData {
    /// Training samples (at least `train_iters · global_batch_size`, fewer if the data ends).
    pub train: Arc<dyn Dataset>,
    /// Validation samples, when the split has a validation part.
    pub valid: Option<Arc<dyn Dataset>>,
    /// The token id preference rows are padded with (DPO and reward data: the tokenizer's
    /// pad token, else its EOS).
    pub pad_id: Option<u32>,
}

/// Builds the datasets for `rc`. `samples` is `[train, valid]` sample counts wanted;
/// `eod` the end-of-document id; `model_dir` the tokenizer's fallback location for SFT;
/// `notes` hears how the `sft_raw` data encoded.
///
/// # Errors
/// Unreadable or unsuitable data (naming `data.data_path` / `data.split` / the tokenizer).
pub(super) fn build_datasets(
    rc: &RunConfig,
    samples: [usize; 2],
    eod: Option<u32>,
    model_dir: Option<&Path>,
    notes: &mut NoteSink<'_>,
) -> Result<RunData, RunError> {
    let r = &rc.resolved;
    let sizes = [
        Some(samples[0]),
        (samples[1] > 0).then_some(samples[1]),
        None,
    ];
    let mut pad_id = None;
    let [train, valid, _] = match rc.dataset_type {
        DatasetType::Gpt => {
            let mut dcfg =
                GptDatasetConfig::new(rc.seq_length, r.data.seed as u32, eod.unwrap_or(0));
            dcfg.split = r.data.split.clone();
            dcfg.eod_mask_loss = r.data.eod_mask_loss;
            dcfg.reset_position_ids = r.data.reset_position_ids;
            dcfg.reset_attention_mask = r.data.reset_attention_mask;
            dcfg.path_to_cache = r.data.data_cache_path.clone();
            let blend = Blend {
                prefixes: rc.blend.iter().map(|(_, p)| p.clone()).collect(),
                weights: (rc.blend.len() > 1).then(|| rc.blend.iter().map(|(w, _)| *w).collect()),
            };
            let [t, v, x] =
                build_gpt_datasets(&blend, sizes, &dcfg).context("building GPT datasets")?;
            [
                t.map(|d| d as Arc<dyn Dataset>),
                v.map(|d| d as Arc<dyn Dataset>),
                x.map(|d| d as Arc<dyn Dataset>),
            ]
        }
        DatasetType::Dpo | DatasetType::Reward => {
            let (sets, pad) = dpo_datasets(rc, sizes, model_dir, notes)?;
            pad_id = Some(pad);
            sets
        }
        DatasetType::SftRaw | DatasetType::SftMmap => {
            let all = sft_dataset(rc, model_dir, notes)?;
            let [t, v, x] = build_epoch_splits(all, &r.data.split, sizes, r.data.seed as u32)
                .context("splitting the SFT data")?;
            [
                t.map(|d| d as Arc<dyn Dataset>),
                v.map(|d| d as Arc<dyn Dataset>),
                x.map(|d| d as Arc<dyn Dataset>),
            ]
        }
    };
    let train = train.ok_or_else(|| {
        RunError::Config(format!(
            "data.split `{}` leaves no training data",
            r.data.split
        ))
    })?;
    Ok(RunData {
        train,
        valid,
        pad_id,
    })
}

/// The tokenizer directory of `sft_raw` / `dpo`: `data.tokenizer_model`, else `model_dir`.
fn tokenizer_dir(rc: &RunConfig, model_dir: Option<&Path>) -> Result<PathBuf, RunError> {
    rc.resolved
        .data
        .tokenizer_model
        .clone()
        .or_else(|| model_dir.map(Path::to_path_buf))
        .ok_or_else(|| {
            RunError::Config(
                "data.tokenizer_model is required without model.load (to tokenize the JSONL)"
                    .into(),
            )
        })
}

/// `dpo`: the preference pairs of the JSONL `data.data_path`, split and repeated over
/// shuffled epochs **as pairs** (`sizes` count rows, two per pair), each split handed out as
/// rows (`DpoRows`: chosen then rejected), with the id the rows are padded with; `notes`
/// hears the encoding report.
fn dpo_datasets(
    rc: &RunConfig,
    sizes: [Option<usize>; 3],
    model_dir: Option<&Path>,
    notes: &mut NoteSink<'_>,
) -> Result<(Splits, u32), RunError> {
    let [(_, path)] = rc.blend.as_slice() else {
        return Err(RunError::Config(format!(
            "data.data_path: DPO takes one JSONL file, got a blend of {}",
            rc.blend.len()
        )));
    };
    let tok = tokenizer_dir(rc, model_dir)?;
    let encoder =
        SftEncoder::from_model_dir(&tok).with_context(|| format!("tokenizer {}", tok.display()))?;
    let (pairs, report) = load_dpo_jsonl(path, &encoder, rc.seq_length)
        .with_context(|| format!("data.data_path {}", path.display()))?;
    if pairs.is_empty() {
        return Err(RunError::Config(format!(
            "data.data_path {}: no preference pairs",
            path.display()
        )));
    }
    notes(&RunNote::PairsEncoded {
        pairs: report.pairs,
        truncated: report.truncated,
        seq_length: rc.seq_length,
    });
    let pad_id = encoder.default_pad_id();
    let all = Arc::new(DpoPairs::new(pairs, rc.seq_length, pad_id));
    let pair_sizes = sizes.map(|n| n.map(|rows| rows.div_ceil(2)));
    let r = &rc.resolved.data;
    let splits = build_epoch_splits(all, &r.split, pair_sizes, r.seed as u32)
        .context("splitting the DPO pairs")?;
    let rows = splits
        .map(|s| s.map(|pairs| Arc::new(DpoRows::new(pairs, rc.seq_length)) as Arc<dyn Dataset>));
    Ok((rows, pad_id))
}

/// All SFT sequences of `data.data_path` (one file or prefix; blends are not supported for SFT).
fn sft_dataset(
    rc: &RunConfig,
    model_dir: Option<&Path>,
    notes: &mut NoteSink<'_>,
) -> Result<Arc<dyn Dataset>, RunError> {
    if rc.blend.len() != 1 {
        return Err(RunError::Config(format!(
            "data.data_path: SFT takes one file or prefix, got a blend of {}",
            rc.blend.len()
        )));
    }
    let path = &rc.blend[0].1;
    let ds: Arc<dyn Dataset> = match rc.dataset_type {
        DatasetType::SftMmap => {
            let ds = IdxmapSftDataset::open(path)
                .with_context(|| format!("data.data_path {}", path.display()))?;
            if ds.seq_length() != rc.seq_length {
                return Err(RunError::Config(format!(
                    "data.data_path {}: sequences are {} tokens, model.seq_length is {}",
                    path.display(),
                    ds.seq_length(),
                    rc.seq_length
                )));
            }
            Arc::new(ds)
        }
        _ => raw_sft_dataset(rc, path, model_dir, notes)?,
    };
    if ds.is_empty() {
        return Err(RunError::Config(format!(
            "data.data_path {}: no SFT sequences",
            path.display()
        )));
    }
    Ok(ds)
}

/// `sft_raw`: the chat / alpaca JSONL `path` encoded with the tokenizer of
/// `data.tokenizer_model` (or `model_dir`); `notes` hears the encoding report.
fn raw_sft_dataset(
    rc: &RunConfig,
    path: &Path,
    model_dir: Option<&Path>,
    notes: &mut NoteSink<'_>,
) -> Result<Arc<dyn Dataset>, RunError> {
    let tok = tokenizer_dir(rc, model_dir)?;
    let encoder =
        SftEncoder::from_model_dir(&tok).with_context(|| format!("tokenizer {}", tok.display()))?;
    let opts = SftOptions::new(rc.seq_length);
    let ds = RawSftDataset::load(&[path], &encoder, &opts)
        .with_context(|| format!("data.data_path {}", path.display()))?;
    notes(&RunNote::SftRawEncoded {
        report: ds.report().clone(),
        seq_length: rc.seq_length,
    });
    Ok(Arc::new(ds))
}
