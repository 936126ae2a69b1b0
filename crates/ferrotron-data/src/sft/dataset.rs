//! The SFT datasets as loader [`Dataset`]s: an [`SftSample`] becomes a [`GptSample`] (the
//! loader's sample type) with `labels` 0 wherever the loss mask is 0 and `segment_ids` =
//! `sample_ids`, so packed samples never attend to each other.

use serde_json::json;

use super::{IGNORE_INDEX, IdxmapSftDataset, RawSftDataset, SftError, SftSample};
use crate::gpt_dataset::{DatasetError, GptSample};
use crate::loader::Dataset;

impl From<SftSample> for GptSample {
    fn from(x: SftSample) -> GptSample {
        GptSample {
            tokens: x.tokens,
            labels: x
                .labels
                .iter()
                .map(|&l| if l == IGNORE_INDEX { 0 } else { l as u32 })
                .collect(),
            loss_mask: x.loss_mask,
            position_ids: x.position_ids,
            segment_ids: x.sample_ids,
            margin: 0.0,
        }
    }
}

impl From<SftError> for DatasetError {
    fn from(e: SftError) -> DatasetError {
        match e {
            SftError::OutOfRange { index, len } => DatasetError::OutOfRange { index, len },
            SftError::Indexed(e) => DatasetError::Indexed(e),
            SftError::Io { path, source } => DatasetError::Io { path, source },
            other => DatasetError::Index {
                what: "SFT dataset",
                detail: other.to_string(),
            },
        }
    }
}

impl Dataset for RawSftDataset {
    fn len(&self) -> usize {
        RawSftDataset::len(self)
    }

    fn get(&self, i: usize) -> Result<GptSample, DatasetError> {
        Ok(RawSftDataset::get(self, i)?.into())
    }

    /// Files, options and counts: a blend of SFT sets is cached per this identity.
    fn description(&self) -> serde_json::Value {
        let (files, o, r) = (self.files(), self.options(), self.report());
        json!({
            "type": "sft_raw",
            "files": files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
            "max_padding_length": o.max_padding_length,
            "pad_id": self.pad_id(),
            "format": format!("{:?}", o.format),
            "pack": o.pack,
            "overlong": format!("{:?}", o.overlong),
            "records": r.records,
            "sequences": r.sequences,
            "tokens": r.tokens,
        })
    }
}

impl Dataset for IdxmapSftDataset {
    fn len(&self) -> usize {
        IdxmapSftDataset::len(self)
    }

    fn get(&self, i: usize) -> Result<GptSample, DatasetError> {
        Ok(IdxmapSftDataset::get(self, i)?.into())
    }

    /// Prefix, sequence count and length.
    fn description(&self) -> serde_json::Value {
        json!({
            "type": "sft_idxmap",
            "prefix": self.prefix().display().to_string(),
            "sequences": self.len(),
            "seq_length": self.seq_length(),
        })
    }
}
