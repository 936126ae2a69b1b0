//! [`TpSplit`]: how a parameter of the full model is divided over the tensor-parallel ranks,
//! and [`ParamBox`]: where a run of a rank's shard lies in the full tensor (the geometry of
//! sharded checkpoints, Megatron `dist_checkpointing`'s `ShardedTensor` boxes).

use std::ops::Range;

/// How one parameter of the full model is divided over the tensor-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpSplit {
    /// Every rank holds all of it (its gradient is all-reduced under sequence parallelism).
    Replicated,
    /// `[R, C]` or `[R]` cut into `parts` equal row blocks, each split evenly over the
    /// ranks; rank `r` holds its piece of every block, in block order.
    Rows {
        /// Packed blocks (2 for `linear_fc1`'s gate and up).
        parts: usize,
    },
    /// `[R, C]` columns split evenly.
    Columns,
    /// A `[v, h]` vocabulary table padded to `padded` rows, split evenly by rows.
    Vocab {
        /// Rows after padding (a multiple of `t`).
        padded: usize,
    },
}

impl TpSplit {
    /// Rank `r`'s shape of a parameter of full `shape` over `t` ranks.
    pub fn local_shape(&self, shape: &[usize], t: usize) -> Vec<usize> {
        let mut s = shape.to_vec();
        match self {
            TpSplit::Replicated => {}
            TpSplit::Rows { .. } => s[0] /= t,
            TpSplit::Columns => s[1] /= t,
            TpSplit::Vocab { padded } => s[0] = padded / t,
        }
        s
    }

    /// Rank `r`'s part (row-major) of the full row-major `full` of `shape` over `t` ranks;
    /// vocabulary padding rows are zeros.
    pub fn shard<E: Copy + Default>(
        &self,
        full: &[E],
        shape: &[usize],
        t: usize,
        r: usize,
    ) -> Vec<E> {
        let cols: usize = shape[1..].iter().product();
        match *self {
            TpSplit::Replicated => full.to_vec(),
            TpSplit::Rows { parts } => {
                let (block, piece) = (shape[0] / parts, shape[0] / parts / t);
                (0..parts)
                    .flat_map(|p| {
                        let start = (p * block + r * piece) * cols;
                        full[start..start + piece * cols].iter().copied()
                    })
                    .collect()
            }
            TpSplit::Columns => {
                let local = cols / t;
                full.chunks_exact(cols)
                    .flat_map(|row| row[r * local..(r + 1) * local].iter().copied())
                    .collect()
            }
            TpSplit::Vocab { padded } => {
                let rows = padded / t;
                let mut out = vec![E::default(); rows * cols];
                let (lo, hi) = ((r * rows).min(shape[0]), ((r + 1) * rows).min(shape[0]));
                out[..(hi - lo) * cols].copy_from_slice(&full[lo * cols..hi * cols]);
                out
            }
        }
    }

    /// The full array of `shape` from every rank's part (`parts[r]`, rank order): the
    /// inverse of [`shard`](Self::shard) (replicated: rank 0's; padding dropped).
    pub fn unshard<E: Copy + Default>(&self, parts: &[&[E]], shape: &[usize]) -> Vec<E> {
        let t = parts.len();
        let cols: usize = shape[1..].iter().product();
        let numel = shape.iter().product();
        match *self {
            TpSplit::Replicated => parts[0].to_vec(),
            TpSplit::Rows { parts: blocks } => {
                let piece = shape[0] / blocks / t * cols;
                (0..blocks)
                    .flat_map(|p| {
                        parts
                            .iter()
                            .flat_map(move |part| &part[p * piece..(p + 1) * piece])
                    })
                    .copied()
                    .collect()
            }
            TpSplit::Columns => {
                let local = cols / t;
                (0..shape[0])
                    .flat_map(|i| {
                        parts
                            .iter()
                            .flat_map(move |part| &part[i * local..(i + 1) * local])
                    })
                    .copied()
                    .collect()
            }
            TpSplit::Vocab { .. } => parts
                .iter()
                .flat_map(|p| p.iter().copied())
                .take(numel)
                .collect(),
        }
    }
}

/// A box of a full parameter that one rank holds as a contiguous run of its local array
/// (row-major in `shape`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamBox {
    /// Offset of the box in each dimension of the full tensor.
    pub global_offset: Vec<usize>,
    /// Shape of the box (the full tensor's rank).
    pub shape: Vec<usize>,
    /// Index in the rank's local array of the box's first element; the rest follow.
    pub local_start: usize,
}

impl ParamBox {
    /// Element count.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

impl TpSplit {
    /// The boxes of the full 1-D or 2-D tensor of `shape` covered by the local elements
    /// `range` of rank `r`'s shard over `t` ranks, in local order. A range is cut into a
    /// partial first row, whole rows and a partial last row, and each run of rows is mapped
    /// to the full tensor (`linear_fc1`'s gate and up blocks become separate boxes, a column
    /// shard is offset by `r · C/t`); vocabulary padding rows are in no box. This is how a
    /// distributed optimizer's flat range of a tensor-parallel shard is stored in model
    /// space (Megatron `dist_checkpointing`'s `fully_sharded_model_space`).
    pub fn boxes(&self, shape: &[usize], t: usize, r: usize, range: Range<usize>) -> Vec<ParamBox> {
        debug_assert!(matches!(shape.len(), 1 | 2), "parameters are 1-D or 2-D");
        let local = self.local_shape(shape, t);
        let cols: usize = local[1..].iter().product();
        let mut out = Vec::new();
        let mut pos = range.start;
        while pos < range.end {
            let (row, col) = (pos / cols, pos % cols);
            let (rows, width) = if col != 0 || range.end - pos < cols {
                (1, (cols - col).min(range.end - pos))
            } else {
                ((range.end - pos) / cols, cols)
            };
            for (local_row, global_row, n) in self.row_runs(shape[0], t, r, row, rows) {
                let global_col = match self {
                    TpSplit::Columns => r * cols + col,
                    _ => col,
                };
                let (global_offset, box_shape) = if shape.len() == 1 {
                    (vec![global_row], vec![n])
                } else {
                    (vec![global_row, global_col], vec![n, width])
                };
                out.push(ParamBox {
                    global_offset,
                    shape: box_shape,
                    local_start: local_row * cols + col,
                });
            }
            pos += rows * width;
        }
        out
    }

    /// The local rows `row .. row + n` of rank `r` as runs `(local row, full-tensor row,
    /// length)` that are contiguous in the full tensor of `full_rows` rows.
    fn row_runs(
        &self,
        full_rows: usize,
        t: usize,
        r: usize,
        row: usize,
        n: usize,
    ) -> Vec<(usize, usize, usize)> {
        match *self {
            TpSplit::Replicated | TpSplit::Columns => vec![(row, row, n)],
            TpSplit::Rows { parts } => {
                let (block, piece) = (full_rows / parts, full_rows / parts / t);
                let mut runs = Vec::new();
                let mut lr = row;
                while lr < row + n {
                    let (p, within) = (lr / piece, lr % piece);
                    let take = (piece - within).min(row + n - lr);
                    let global = p * block + r * piece + within;
                    match runs.last_mut() {
                        // With one rank the blocks are adjacent: one run.
                        Some((_, g, len)) if *g + *len == global => *len += take,
                        _ => runs.push((lr, global, take)),
                    }
                    lr += take;
                }
                runs
            }
            TpSplit::Vocab { padded } => {
                let global = r * (padded / t) + row;
                let take = full_rows.saturating_sub(global).min(n);
                if take == 0 {
                    vec![]
                } else {
                    vec![(row, global, take)]
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every box's values, read from the full tensor, equal the local shard's run.
    fn check(split: TpSplit, shape: &[usize], t: usize, ranges: &[Range<usize>]) {
        let full: Vec<u32> = (0..shape.iter().product::<usize>() as u32).collect();
        let cols: usize = shape[1..].iter().product();
        for r in 0..t {
            let local = split.shard(&full, shape, t, r);
            for range in ranges {
                let range = range.start.min(local.len())..range.end.min(local.len());
                let boxes = split.boxes(shape, t, r, range.clone());
                let mut covered = 0;
                for b in &boxes {
                    let width = if shape.len() == 1 { 1 } else { b.shape[1] };
                    let col0 = if shape.len() == 1 {
                        0
                    } else {
                        b.global_offset[1]
                    };
                    for i in 0..b.shape[0] {
                        for j in 0..width {
                            let g = (b.global_offset[0] + i) * cols + col0 + j;
                            assert_eq!(local[b.local_start + i * width + j], full[g]);
                        }
                    }
                    covered += b.numel();
                }
                let padding = match split {
                    TpSplit::Vocab { .. } => {
                        let valid = (shape[0] * cols).saturating_sub(r * local.len());
                        range.len() - range.end.min(valid).saturating_sub(range.start)
                    }
                    _ => 0,
                };
                assert_eq!(
                    covered + padding,
                    range.len(),
                    "{split:?} rank {r} {range:?}"
                );
            }
        }
    }

    #[test]
    fn boxes_map_local_runs_into_the_full_tensor() {
        let ranges = [0..usize::MAX, 3..17, 5..6, 0..8, 7..40, 13..29];
        check(TpSplit::Replicated, &[6, 4], 2, &ranges);
        check(TpSplit::Replicated, &[10], 3, &ranges);
        check(TpSplit::Rows { parts: 1 }, &[8, 3], 2, &ranges);
        check(TpSplit::Rows { parts: 2 }, &[12, 3], 3, &ranges);
        check(TpSplit::Rows { parts: 2 }, &[8], 2, &ranges);
        check(TpSplit::Columns, &[5, 6], 3, &ranges);
        check(TpSplit::Vocab { padded: 12 }, &[10, 3], 3, &ranges);
        check(TpSplit::Vocab { padded: 8 }, &[5, 2], 2, &ranges);
    }
}
