//! Turning encoded samples into fixed-length sequences: padding to `max_padding_length` or
//! packing several samples per sequence (Pai's `build_idxmap_sft_dataset.py --sequence-packing`
//! packs the same way: in input order, a new sequence starts when the next sample does not fit).
//!
//! Overlong samples (more than `s = max_padding_length` tokens): [`Overlong::Truncate`] keeps
//! the first `s` tokens (the prompt head; the answer's tail is cut, as Pai does) unless no
//! answer target is left in them, in which case the sample is dropped like Pai's "extreme long
//! user input"; [`Overlong::Drop`] drops it. Both are counted in the [`SftReport`].

use super::encode::EncodedSample;
use super::{IGNORE_INDEX, SftReport, SftSample};

/// What to do with a sample longer than `max_padding_length`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overlong {
    /// Keep the first `max_padding_length` tokens (drop the sample if no answer target remains).
    Truncate,
    /// Drop the sample.
    Drop,
}

impl std::str::FromStr for Overlong {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "truncate" => Ok(Overlong::Truncate),
            "drop" => Ok(Overlong::Drop),
            _ => Err(format!("unknown overlong policy {s:?} (truncate or drop)")),
        }
    }
}

/// Groups encoded samples into sequences of at most `max_padding_length` tokens.
#[derive(Debug)]
pub struct Packer {
    max_len: usize,
    pack: bool,
    overlong: Overlong,
    pending: Vec<EncodedSample>,
    pending_len: usize,
}

impl Packer {
    /// A packer for sequences of `max_padding_length` tokens; `pack = false` gives one sample
    /// per sequence.
    pub fn new(max_padding_length: usize, pack: bool, overlong: Overlong) -> Self {
        Packer {
            max_len: max_padding_length,
            pack,
            overlong,
            pending: Vec::new(),
            pending_len: 0,
        }
    }

    /// Adds a sample (applying the overlong policy and counting into `report`); returns the
    /// group of samples for a finished sequence, if this sample closed one.
    pub fn push(
        &mut self,
        mut sample: EncodedSample,
        report: &mut SftReport,
    ) -> Option<Vec<EncodedSample>> {
        let s = self.max_len;
        if sample.len() > s {
            if self.overlong == Overlong::Drop {
                report.dropped_overlong += 1;
                return None;
            }
            sample.tokens.truncate(s);
            sample.trained.truncate(s);
            if !has_target(&sample) {
                report.dropped_no_answer += 1;
                return None;
            }
            report.truncated += 1;
        }
        if !has_target(&sample) {
            report.dropped_no_answer += 1;
            return None;
        }
        report.samples += 1;
        report.tokens += sample.len();
        report.trained_tokens += sample.trained.iter().skip(1).filter(|&&t| t).count();
        let done = if !self.pack || self.pending_len + sample.len() > s {
            self.finish()
        } else {
            None
        };
        self.pending_len += sample.len();
        self.pending.push(sample);
        if !self.pack {
            return self.finish();
        }
        done
    }

    /// The group still open, if any (call at the end of the input).
    pub fn finish(&mut self) -> Option<Vec<EncodedSample>> {
        self.pending_len = 0;
        if self.pending.is_empty() {
            None
        } else {
            Some(std::mem::take(&mut self.pending))
        }
    }
}

/// A sample can train only if some token after the first is an answer token.
fn has_target(sample: &EncodedSample) -> bool {
    sample.trained.iter().skip(1).any(|&t| t)
}

/// Lays `group` (total length at most `s`) out as one [`SftSample`] of `s` positions: samples back
/// to back, then `pad_id` padding. Labels are shifted within each sample (`labels[i] =
/// tokens[i + 1]` when that is an answer token); a sample's last position and padding get
/// [`IGNORE_INDEX`].
pub fn build_sequence(group: &[EncodedSample], s: usize, pad_id: u32) -> SftSample {
    let mut out = SftSample {
        tokens: Vec::with_capacity(s),
        labels: Vec::with_capacity(s),
        loss_mask: Vec::with_capacity(s),
        position_ids: Vec::with_capacity(s),
        sample_ids: Vec::with_capacity(s),
    };
    for (j, sample) in group.iter().enumerate() {
        let n = sample.len();
        for k in 0..n {
            out.tokens.push(sample.tokens[k]);
            let label = match sample.trained.get(k + 1) {
                Some(true) => sample.tokens[k + 1] as i32,
                _ => IGNORE_INDEX,
            };
            out.labels.push(label);
            out.position_ids.push(k as u32);
            out.sample_ids.push(j as u32);
        }
    }
    let used = out.tokens.len();
    for k in 0..s.saturating_sub(used) {
        out.tokens.push(pad_id);
        out.labels.push(IGNORE_INDEX);
        out.position_ids.push(k as u32);
        out.sample_ids.push(group.len() as u32);
    }
    out.loss_mask = out
        .labels
        .iter()
        .map(|&l| if l == IGNORE_INDEX { 0.0 } else { 1.0 })
        .collect();
    out
}
