//! Which tokens of a sequence each context-parallel rank holds, and moving a rank's rows in
//! and out of its local arrays.
//!
//! **Chunk split** (one document per row; Megatron's `get_batch_on_this_cp_rank`): the `S`
//! positions are cut into `2·C` chunks of `S / (2C)`; rank `r` holds chunks `r` and
//! `2C − 1 − r` of every row.
//!
//! **Document split** (packed rows; Megatron's THD path, Transformer Engine's
//! `thd_get_partitioned_indices`): every document of a row is cut into `2·C` chunks the same
//! way and rank `r` holds chunks `r` and `2C − 1 − r` **of each document**, so every rank
//! does the same causal work on every document, short or long. Megatron pads each document
//! to a multiple of `2C`; our rows are fixed-length packed rows, so instead a document of
//! `L = 2C·q + e` tokens gets chunks of `q` tokens plus one more for `e` of them, the extra
//! tokens dealt round-robin over the row's chunk slots (slot `k mod 2C` → rank `k mod C`,
//! its first chunk for `k mod 2C < C`, else its second). A row's extras add up to a multiple
//! of `2C` (`S` does), so every rank holds exactly `S / C` tokens of every row.
//!
//! A rank's local tokens are its [`Run`]s in order: stretches of consecutive positions of
//! some rows. Local arrays are `[S / C, b, w]` (token-major, as every `[s, b, ...]` tensor).

use std::borrow::Cow;
use std::ops::Range;

use crate::attention::DocumentStarts;
use crate::{NnError, Result};

/// Consecutive positions of some rows held by one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Run {
    /// Rows of the micro-batch the run covers: all `0..b` in the chunk split, one row in the
    /// document split.
    pub rows: Range<usize>,
    /// Global positions `start..start + len`.
    pub start: usize,
    /// Tokens.
    pub len: usize,
    /// First local token index on the rank holding the run.
    pub local: usize,
    /// Position of the first token of the run's document (0 in the chunk split).
    pub document: usize,
}

impl Run {
    /// Global positions of the run.
    pub fn positions(&self) -> Range<usize> {
        self.start..self.start + self.len
    }

    /// Local token indices of the run on its rank.
    pub fn local_tokens(&self) -> Range<usize> {
        self.local..self.local + self.len
    }
}

/// Every rank's runs of a `[S, b]` micro-batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SequenceSplit {
    seq: usize,
    batch: usize,
    ranks: Vec<Vec<Run>>,
}

impl SequenceSplit {
    /// The split of `S = seq` positions of `batch` rows over `c` ranks: by documents when
    /// `documents` (`[S, b]` starts) are given, else by chunks.
    ///
    /// # Errors
    /// [`NnError::BadInput`] naming `seq_length` when `seq` does not divide by `2·c`, or
    /// naming `doc_starts` when they are not `[seq, batch]`.
    pub fn new(
        seq: usize,
        batch: usize,
        c: usize,
        documents: Option<DocumentStarts>,
    ) -> Result<SequenceSplit> {
        if c == 0 || !seq.is_multiple_of(2 * c) {
            return Err(NnError::BadInput {
                field: "seq_length".into(),
                reason: format!(
                    "{seq} tokens do not split into 2 x context_parallel_size = {} equal chunks",
                    2 * c
                ),
            });
        }
        let ranks = match documents {
            None => chunk_runs(seq, batch, c),
            Some(docs) => {
                if docs.seq_len() != seq || docs.batch() != batch {
                    return Err(NnError::BadInput {
                        field: "doc_starts".into(),
                        reason: format!(
                            "[{}, {}], expected the whole sequence's [{seq}, {batch}]",
                            docs.seq_len(),
                            docs.batch()
                        ),
                    });
                }
                document_runs(docs, c)
            }
        };
        Ok(SequenceSplit { seq, batch, ranks })
    }

    /// Tokens per row on every rank: `S / C`.
    pub fn local_seq(&self) -> usize {
        self.seq / self.ranks.len()
    }

    /// Rows `b`.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Rank `p`'s runs in local order.
    pub fn runs(&self, p: usize) -> &[Run] {
        &self.ranks[p]
    }

    /// Rank `p`'s share `[S / C, b, w]` of a per-token array `x: [S, b, w]`.
    ///
    /// # Errors
    /// [`NnError::BadInput`] when `x` is not `S · b · w` long.
    pub fn share<T: Copy>(&self, p: usize, x: &[T], w: usize) -> Result<Vec<T>> {
        if x.len() != self.seq * self.batch * w {
            return Err(NnError::BadInput {
                field: "context-parallel share".into(),
                reason: format!(
                    "{} values are not [{}, {}, {w}]",
                    x.len(),
                    self.seq,
                    self.batch
                ),
            });
        }
        let mut out = vec![x[0]; self.local_seq() * self.batch * w];
        let b = self.batch;
        for run in self.runs(p) {
            let rows = take(x, b, w, &run.rows, run.positions());
            put(&mut out, b, w, &run.rows, run.local_tokens(), &rows);
        }
        Ok(out)
    }
}

fn chunk_runs(seq: usize, batch: usize, c: usize) -> Vec<Vec<Run>> {
    let n = seq / (2 * c);
    (0..c)
        .map(|r| {
            [r, 2 * c - 1 - r]
                .iter()
                .enumerate()
                .map(|(i, &chunk)| Run {
                    rows: 0..batch,
                    start: chunk * n,
                    len: n,
                    local: i * n,
                    document: 0,
                })
                .collect()
        })
        .collect()
}

fn document_runs(docs: DocumentStarts, c: usize) -> Vec<Vec<Run>> {
    let (s, b) = (docs.seq_len(), docs.batch());
    let mut ranks = vec![Vec::new(); c];
    for j in 0..b {
        // The next chunk slot to receive an extra token (restarts every row).
        let mut slot = 0;
        let mut local = vec![0; c];
        let mut start = 0;
        while start < s {
            let end = docs.end(start, j);
            let len = end - start;
            let mut sizes = vec![len / (2 * c); 2 * c];
            for _ in 0..len % (2 * c) {
                let (p, second) = (slot % c, slot % (2 * c) >= c);
                sizes[if second { 2 * c - 1 - p } else { p }] += 1;
                slot += 1;
            }
            let starts: Vec<usize> = sizes
                .iter()
                .scan(start, |at, &n| Some(std::mem::replace(at, *at + n)))
                .collect();
            for (p, runs) in ranks.iter_mut().enumerate() {
                for chunk in [p, 2 * c - 1 - p] {
                    if sizes[chunk] == 0 {
                        continue;
                    }
                    runs.push(Run {
                        rows: j..j + 1,
                        start: starts[chunk],
                        len: sizes[chunk],
                        local: local[p],
                        document: start,
                    });
                    local[p] += sizes[chunk];
                }
            }
            start = end;
        }
        debug_assert!(
            local.iter().all(|&n| n == s / c),
            "unbalanced split {local:?}"
        );
    }
    ranks
}

/// Rows `rows` of tokens `tokens` of `x: [s, b, w]` as `[tokens, rows, w]` (borrowed when they
/// are every row).
pub(super) fn take<'x, T: Clone>(
    x: &'x [T],
    b: usize,
    w: usize,
    rows: &Range<usize>,
    tokens: Range<usize>,
) -> Cow<'x, [T]> {
    if rows.len() == b {
        return Cow::Borrowed(&x[tokens.start * b * w..tokens.end * b * w]);
    }
    let width = rows.len() * w;
    let mut out = Vec::with_capacity(tokens.len() * width);
    for t in tokens {
        out.extend_from_slice(&x[(t * b + rows.start) * w..][..width]);
    }
    Cow::Owned(out)
}

/// Writes `src: [tokens, rows, w]` into rows `rows` of tokens `tokens` of `x: [s, b, w]`.
pub(super) fn put<T: Copy>(
    x: &mut [T],
    b: usize,
    w: usize,
    rows: &Range<usize>,
    tokens: Range<usize>,
    src: &[T],
) {
    for_each_row(x, (b, w), rows, tokens, src, |d, s| d.copy_from_slice(s));
}

/// Adds `src: [tokens, rows, w]` into rows `rows` of tokens `tokens` of `x: [s, b, w]`.
pub(super) fn put_add(
    x: &mut [f32],
    b: usize,
    w: usize,
    rows: &Range<usize>,
    tokens: Range<usize>,
    src: &[f32],
) {
    for_each_row(x, (b, w), rows, tokens, src, |d, s| {
        d.iter_mut().zip(s).for_each(|(a, &v)| *a += v)
    });
}

/// `f(destination, source)` for each token's rows `rows` of `x: [s, b, w]` and its part of
/// `src: [tokens, rows, w]`.
fn for_each_row<T>(
    x: &mut [T],
    (b, w): (usize, usize),
    rows: &Range<usize>,
    tokens: Range<usize>,
    src: &[T],
    f: impl Fn(&mut [T], &[T]),
) {
    let width = rows.len() * w;
    for (i, t) in tokens.enumerate() {
        f(
            &mut x[(t * b + rows.start) * w..][..width],
            &src[i * width..][..width],
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `[s, 1]` starts of documents of the given lengths.
    fn starts(lens: &[usize]) -> Vec<u32> {
        let mut out = Vec::new();
        let mut at = 0;
        for &l in lens {
            out.extend(std::iter::repeat_n(at as u32, l));
            at += l;
        }
        out
    }

    #[test]
    fn chunks_are_megatrons() {
        let split = SequenceSplit::new(16, 2, 2, None).unwrap();
        let starts: Vec<_> = split.runs(0).iter().map(|r| (r.start, r.local)).collect();
        assert_eq!(starts, [(0, 0), (12, 4)]);
        let starts: Vec<_> = split.runs(1).iter().map(|r| (r.start, r.local)).collect();
        assert_eq!(starts, [(4, 0), (8, 4)]);
        let x: Vec<u32> = (0..32).collect(); // [16, 2]: position t row j = 2t + j
        assert_eq!(
            split.share(1, &x, 1).unwrap(),
            [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]
        );
        assert!(SequenceSplit::new(18, 1, 2, None).is_err());
    }

    #[test]
    fn each_document_splits_the_balanced_way() {
        // Documents of 13, 3, 8 tokens (24 = 2·2·6) over cp 2: chunk slots of 4 per document.
        let docs = starts(&[13, 3, 8]);
        let docs = DocumentStarts::new(&docs, 1).unwrap();
        let split = SequenceSplit::new(24, 1, 2, Some(docs)).unwrap();
        let runs = |p: usize| -> Vec<(usize, usize)> {
            split.runs(p).iter().map(|r| (r.start, r.len)).collect()
        };
        // 13 = 4·3 + 1: the extra goes to slot 0 (rank 0's first chunk): [4, 3, 3, 3].
        // 3 = 4·0 + 3: slots 1, 2, 3 -> rank 1 first (chunk 1), rank 0 second (chunk 3),
        // rank 1 second (chunk 2): [0, 1, 1, 1]. 8: [2, 2, 2, 2].
        assert_eq!(runs(0), [(0, 4), (10, 3), (15, 1), (16, 2), (22, 2)]);
        assert_eq!(
            runs(1),
            [(4, 3), (7, 3), (13, 1), (14, 1), (18, 2), (20, 2)]
        );
        for p in 0..2 {
            let total: usize = split.runs(p).iter().map(|r| r.len).sum();
            assert_eq!(total, 12, "rank {p}");
            let locals: Vec<_> = split.runs(p).iter().map(|r| r.local).collect();
            let mut at = 0;
            for (r, l) in split.runs(p).iter().zip(locals) {
                assert_eq!(l, at);
                at += r.len;
            }
        }
        assert_eq!(split.runs(1)[2].document, 13);
    }

    #[test]
    fn rows_move_in_and_out() {
        // x: [3 tokens, 2 rows, w 2].
        let x: Vec<f32> = (0..12).map(|v| v as f32).collect();
        let row1 = take(&x, 2, 2, &(1..2), 1..3);
        assert_eq!(&row1[..], [6.0, 7.0, 10.0, 11.0]);
        let all = take(&x, 2, 2, &(0..2), 2..3);
        assert!(matches!(all, Cow::Borrowed(_)));
        let mut y = vec![0f32; 12];
        put(&mut y, 2, 2, &(1..2), 1..3, &row1);
        put_add(&mut y, 2, 2, &(1..2), 2..3, &[1.0, 1.0]);
        assert_eq!(y[6..8], [6.0, 7.0]);
        assert_eq!(y[10..12], [11.0, 12.0]);
        assert_eq!(y[..6], [0.0; 6]);
    }
}
