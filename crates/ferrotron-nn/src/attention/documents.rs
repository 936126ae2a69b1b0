//! Per-document causal masking of packed training rows: Megatron-Core's `reset_attention_mask`
//! (`megatron/core/datasets/gpt_dataset.py`, `_get_ltor_masks_and_position_ids`). When several
//! documents are packed into one row, a token attends only to earlier tokens of its own
//! document. Documents are contiguous spans split **after** each EOD token: the EOD closes its
//! document (it sees that document's tokens) and the next token starts a new one. Megatron
//! zeroes `attention_mask[(i + 1):, :(i + 1)]` for each EOD index `i`, i.e. query `t` sees key
//! `p` iff `p <= t` and no EOD sits at an index `p <= i < t`.

use crate::NnError;

/// For each token of a packed batch, the position of the first token of its document.
///
/// Layout `[s, b]` (Megatron order): token `t` of sequence `j` at index `t·b + j`. Validated by
/// [`DocumentStarts::new`]: every sequence starts a document at position 0, and each later
/// token either continues the previous token's document or starts a new one at its own
/// position. Query `t` of sequence `j` then sees keys `start(t, j) ..= t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DocumentStarts<'a> {
    starts: &'a [u32],
    batch: usize,
}

impl<'a> DocumentStarts<'a> {
    /// Wraps `starts: [s, b]` for a micro-batch of `batch` sequences.
    ///
    /// # Errors
    /// [`NnError::BadInput`] naming `doc_starts` when `batch` is 0, the length is not a
    /// multiple of `batch`, or a value breaks the contiguous-documents structure above (the
    /// message gives the token and sequence).
    pub fn new(starts: &'a [u32], batch: usize) -> Result<DocumentStarts<'a>, NnError> {
        if batch == 0 || !starts.len().is_multiple_of(batch) {
            return Err(bad(format!(
                "{} entries are not [s, b] with b = {batch}",
                starts.len()
            )));
        }
        for (i, &start) in starts.iter().enumerate() {
            let (t, j) = (i / batch, i % batch);
            let prev = t.checked_sub(1).map(|p| starts[p * batch + j]);
            if prev != Some(start) && start as usize != t {
                let expected = match prev {
                    None => "0".to_string(),
                    Some(p) => format!("{p} (same document) or {t} (a new one)"),
                };
                return Err(bad(format!(
                    "token {t} of sequence {j} has start {start}, expected {expected}"
                )));
            }
        }
        Ok(DocumentStarts { starts, batch })
    }

    /// Tokens `s` per sequence.
    pub fn seq_len(&self) -> usize {
        self.starts.len() / self.batch
    }

    /// Micro-batch `b`.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Position of the first token of the document holding token `pos` of sequence `seq`.
    ///
    /// # Panics
    /// When `pos >= s` or `seq >= b` (caller bugs).
    pub fn start(&self, pos: usize, seq: usize) -> usize {
        assert!(seq < self.batch, "doc_starts: sequence {seq} out of range");
        self.starts[pos * self.batch + seq] as usize
    }

    /// One past the last token of the document holding token `pos` of sequence `seq`: the
    /// first later token whose document starts after `pos` (binary search; starts are
    /// non-decreasing along a sequence), or `s`.
    pub fn end(&self, pos: usize, seq: usize) -> usize {
        let (mut lo, mut hi) = (pos + 1, self.seq_len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.start(mid, seq) <= pos {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }
}

/// Megatron's document starts of input tokens `[s, b]` (token `t` of sequence `j` at `t·b + j`):
/// a new document begins at position 0 and right after every `eod` token, so
/// `start[t] = t` if `t == 0` or `tokens[t − 1] == eod`, else `start[t − 1]`. Pass the model's
/// **input** tokens (Megatron's `tokens = text[:-1]`). Reset position ids
/// (`reset_position_ids`) are `t − start[t]`.
///
/// # Errors
/// [`NnError::BadInput`] naming `tokens` when `batch` is 0, the length is not a multiple of
/// `batch`, or `s` does not fit in `u32`.
pub fn document_starts(tokens: &[u32], batch: usize, eod: u32) -> Result<Vec<u32>, NnError> {
    if batch == 0 || !tokens.len().is_multiple_of(batch) {
        return Err(NnError::BadInput {
            field: "tokens".into(),
            reason: format!("{} tokens are not [s, b] with b = {batch}", tokens.len()),
        });
    }
    let s = tokens.len() / batch;
    if u32::try_from(s).is_err() {
        return Err(NnError::BadInput {
            field: "tokens".into(),
            reason: format!("sequence length {s} does not fit in u32 positions"),
        });
    }
    let mut starts = vec![0u32; tokens.len()];
    for t in 1..s {
        for j in 0..batch {
            let prev = (t - 1) * batch + j;
            starts[t * batch + j] = if tokens[prev] == eod {
                t as u32
            } else {
                starts[prev]
            };
        }
    }
    Ok(starts)
}

fn bad(reason: String) -> NnError {
    NnError::BadInput {
        field: "doc_starts".into(),
        reason,
    }
}
