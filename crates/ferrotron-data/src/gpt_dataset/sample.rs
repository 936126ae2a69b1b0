//! One training sample and Megatron's `_get_ltor_masks_and_position_ids` (gpt_dataset.py).

use super::GptDatasetConfig;

/// One sample of `s = seq_length` positions, ready to batch.
///
/// Megatron returns `tokens`, `labels`, `loss_mask`, `position_ids` and a `[1, s, s]` boolean
/// attention mask. The mask is always causal; with `reset_attention_mask` it is also
/// block-diagonal, a block ending at (and including) each EOD token. We return that as
/// `segment_ids` instead: position `i` may attend to position `j <= i` exactly when
/// `segment_ids[i] == segment_ids[j]`.
#[derive(Clone, Debug, PartialEq)]
pub struct GptSample {
    /// Input token ids, `[s]`.
    pub tokens: Vec<u32>,
    /// Next-token targets, `[s]`: `tokens` shifted left by one (the extra token supplies the last).
    pub labels: Vec<u32>,
    /// `[s]`, 1.0 where the loss counts; 0.0 on padding and (with `eod_mask_loss`) where the
    /// input token is EOD.
    pub loss_mask: Vec<f32>,
    /// `[s]`, `0..s`, restarting at 0 after each EOD with `reset_position_ids`.
    pub position_ids: Vec<u32>,
    /// `[s]`, the attention block of each position: the number of EOD tokens before it with
    /// `reset_attention_mask`, else all 0 (plain causal attention).
    pub segment_ids: Vec<u32>,
    /// TRL's reward `margin` of the preference pair the sample belongs to (a reward model's
    /// data); 0 for every other sample.
    pub margin: f32,
}

impl GptSample {
    /// Builds a sample from `text` (`s + extra` token ids of which the first `real` are data and
    /// the rest are padding), following Megatron's `GPTDataset.__getitem__`: with the extra token,
    /// `tokens = text[..s]`, `labels = text[1..]`; without it `labels` is `text` rolled left with
    /// a pad at the end. Padding (Megatron's pad id -1 when the tokenizer has none) becomes token
    /// and label 0 with loss mask 0, and never counts as EOD.
    pub(crate) fn from_text(text: &[u32], real: usize, config: &GptDatasetConfig) -> GptSample {
        let s = config.seq_length;
        let is_real = |i: usize| i < real;
        let token_at = |i: usize| if is_real(i) { Some(text[i]) } else { None };
        let tokens: Vec<Option<u32>> = (0..s).map(token_at).collect();
        let labels: Vec<Option<u32>> = (0..s)
            .map(|i| {
                if i + 1 < text.len() {
                    token_at(i + 1)
                } else {
                    None
                }
            })
            .collect();
        let eod = config.eod;
        let is_eod = |t: &Option<u32>| *t == Some(eod);

        let mut loss_mask: Vec<f32> = labels
            .iter()
            .map(|l| if l.is_some() { 1.0 } else { 0.0 })
            .collect();
        if config.eod_mask_loss {
            for (m, t) in loss_mask.iter_mut().zip(&tokens) {
                if is_eod(t) {
                    *m = 0.0;
                }
            }
        }
        let mut position_ids = Vec::with_capacity(s);
        let mut segment_ids = Vec::with_capacity(s);
        let (mut start, mut segment) = (0u32, 0u32);
        for (i, t) in tokens.iter().enumerate() {
            position_ids.push(if config.reset_position_ids {
                i as u32 - start
            } else {
                i as u32
            });
            segment_ids.push(if config.reset_attention_mask {
                segment
            } else {
                0
            });
            if is_eod(t) {
                start = i as u32 + 1;
                segment += 1;
            }
        }
        GptSample {
            tokens: tokens.iter().map(|t| t.unwrap_or(0)).collect(),
            labels: labels.iter().map(|t| t.unwrap_or(0)).collect(),
            loss_mask,
            position_ids,
            segment_ids,
            margin: 0.0,
        }
    }

    /// Number of positions `s`.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// True for a zero-length sample.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// For each position, the first position it may attend to (the start of its attention block;
    /// it attends to `first..=i`). Equals Megatron's mask row by row.
    pub fn attention_row_starts(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len());
        let mut start = 0u32;
        for (i, seg) in self.segment_ids.iter().enumerate() {
            if i > 0 && *seg != self.segment_ids[i - 1] {
                start = i as u32;
            }
            out.push(start);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resets_after_eod() {
        let mut c = GptDatasetConfig::new(5, 0, 9);
        c.reset_position_ids = true;
        c.reset_attention_mask = true;
        c.eod_mask_loss = true;
        let s = GptSample::from_text(&[4, 9, 5, 6, 9, 7], 6, &c);
        assert_eq!(s.tokens, [4, 9, 5, 6, 9]);
        assert_eq!(s.labels, [9, 5, 6, 9, 7]);
        assert_eq!(s.loss_mask, [1.0, 0.0, 1.0, 1.0, 0.0]);
        assert_eq!(s.position_ids, [0, 1, 0, 1, 2]);
        assert_eq!(s.segment_ids, [0, 0, 1, 1, 1]);
        assert_eq!(s.attention_row_starts(), [0, 0, 2, 2, 2]);
    }

    #[test]
    fn padding_has_no_loss() {
        let c = GptDatasetConfig::new(4, 0, 9);
        let s = GptSample::from_text(&[4, 5, 6, 0, 0], 3, &c);
        assert_eq!(s.tokens, [4, 5, 6, 0]);
        assert_eq!(s.labels, [5, 6, 0, 0]);
        assert_eq!(s.loss_mask, [1.0, 1.0, 0.0, 0.0]);
    }
}
