//! The flat ranges of a param buffer an optimizer owns, and their local offsets.
//!
//! On one rank the optimizer owns `0..numel`. Megatron's distributed optimizer
//! (megatron/core/optimizer/distrib_optimizer.py) gives data-parallel rank `r` the `r`-th of
//! `dp` equal shards of every bucket; its optimizer state is stored contiguously, shard after
//! shard. [`OwnedRanges`] maps between the two index spaces: global (buffer) and local (state).

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::buffer::ParamAndGradBuffer;
use crate::error::{OptimError, Result};

/// Sorted, disjoint global ranges plus where each starts in the local state arrays.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnedRanges {
    ranges: Vec<Range<usize>>,
    local_starts: Vec<usize>,
    local_len: usize,
}

impl OwnedRanges {
    /// Validates `ranges` against a buffer of `numel` elements. Empty ranges are dropped.
    ///
    /// # Errors
    /// [`OptimError::Range`] for an unsorted / overlapping range or one past `numel`.
    pub fn new(ranges: Vec<Range<usize>>, numel: usize) -> Result<Self> {
        let mut out = OwnedRanges {
            ranges: Vec::new(),
            local_starts: Vec::new(),
            local_len: 0,
        };
        let mut prev_end = 0;
        for r in ranges {
            if r.start > r.end || r.end > numel || r.start < prev_end {
                return Err(OptimError::Range {
                    start: r.start,
                    end: r.end,
                    reason: format!(
                        "owned ranges must be sorted, disjoint and inside the buffer of {numel} \
                         elements (previous range ended at {prev_end})"
                    ),
                });
            }
            prev_end = r.end;
            if r.is_empty() {
                continue;
            }
            out.local_starts.push(out.local_len);
            out.local_len += r.len();
            out.ranges.push(r);
        }
        Ok(out)
    }

    /// The ranges data-parallel rank `dp_rank` of `dp_size` owns under Megatron's distributed
    /// optimizer: its shard of every bucket ([`BucketInfo::shard_range`](crate::BucketInfo)).
    ///
    /// # Errors
    /// [`OptimError::Range`] when a bucket does not split evenly over `dp_size` (build the
    /// buffer with that `data_parallel_size` and `pad_for_sharding`) or `dp_rank >= dp_size`.
    pub fn distributed_shard(
        buffer: &ParamAndGradBuffer,
        dp_rank: usize,
        dp_size: usize,
    ) -> Result<Self> {
        OwnedRanges::distributed_shard_by(buffer, |_| (dp_rank, dp_size))
    }

    /// [`OwnedRanges::distributed_shard`] with each bucket's own `(rank, size)` of the group
    /// that shards it (under expert parallelism the expert buckets are sharded over the
    /// expert-data-parallel group).
    ///
    /// # Errors
    /// As [`OwnedRanges::distributed_shard`].
    pub fn distributed_shard_by(
        buffer: &ParamAndGradBuffer,
        group: impl Fn(&crate::BucketInfo) -> (usize, usize),
    ) -> Result<Self> {
        let mut ranges = Vec::with_capacity(buffer.buckets().len());
        for b in buffer.buckets() {
            let (dp_rank, dp_size) = group(b);
            if dp_rank >= dp_size || !(b.end - b.start).is_multiple_of(dp_size) {
                return Err(OptimError::Range {
                    start: b.start,
                    end: b.end,
                    reason: format!(
                        "bucket {} cannot be sharded for dp rank {dp_rank} of {dp_size}",
                        b.id
                    ),
                });
            }
            ranges.push(b.shard_range(dp_rank, dp_size));
        }
        OwnedRanges::new(ranges, buffer.numel())
    }

    /// The global ranges, ascending.
    pub fn ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }
    /// Total owned elements = length of each local state array.
    pub fn local_len(&self) -> usize {
        self.local_len
    }
    /// (global range, local start) pairs.
    pub fn iter(&self) -> impl Iterator<Item = (&Range<usize>, usize)> {
        self.ranges.iter().zip(self.local_starts.iter().copied())
    }
    /// The local index range of global `range`, which must lie inside one owned range.
    ///
    /// # Errors
    /// [`OptimError::Range`] otherwise.
    pub fn local_range(&self, range: &Range<usize>) -> Result<Range<usize>> {
        let i = self.ranges.partition_point(|r| r.end <= range.start);
        match self.ranges.get(i) {
            Some(r) if r.start <= range.start && range.end <= r.end => {
                let start = self.local_starts[i] + (range.start - r.start);
                Ok(start..start + range.len())
            }
            _ if range.is_empty() => Ok(0..0),
            _ => Err(OptimError::Range {
                start: range.start,
                end: range.end,
                reason: "not inside one range owned by this optimizer".into(),
            }),
        }
    }
}
