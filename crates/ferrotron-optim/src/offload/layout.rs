//! Which elements of the optimizer state share a chunk: the chunk manager's packing
//! (PatrickStar / Pai-Megatron-Patch's `ChunkManager`): tensors go into chunks in order,
//! next-fit (a tensor that does not fit in the open chunk opens a new one), and the chunk
//! size is the one of a range of candidates that wastes the fewest slot elements.

use std::ops::Range;

/// Default chunk sizes searched, in elements per state array: `[2^23, 2^24]` (32–64 MiB of
/// f32 per array), sixteen steps.
const DEFAULT_SIZES: Range<usize> = (1 << 23)..(1 << 24);

/// Chunks over a flat index space `0..n`: consecutive ranges, each at most `chunk_size`
/// elements (the size of a chunk's slot in either tier).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkLayout {
    chunk_size: usize,
    chunks: Vec<Range<usize>>,
}

impl ChunkLayout {
    /// Next-fit packing of `pieces` (lengths of consecutive tensors covering `0..Σ pieces`)
    /// into chunks of at most `size` elements. A tensor that does not fit in the open chunk
    /// opens the next; one longer than `size` fills whole chunks and its tail opens another
    /// (the state is elementwise, so a tensor may span chunks).
    ///
    /// # Panics
    /// When `size` is 0 (a caller bug).
    pub fn pack(pieces: &[usize], size: usize) -> ChunkLayout {
        assert!(size > 0, "chunk size 0");
        let mut chunks = Vec::new();
        let (mut start, mut at) = (0usize, 0usize);
        for &len in pieces.iter().filter(|&&l| l > 0) {
            if at - start + len > size && at > start {
                chunks.push(start..at);
                start = at;
            }
            let end = at + len;
            while end - start > size {
                chunks.push(start..start + size);
                start += size;
            }
            at = end;
        }
        if at > start {
            chunks.push(start..at);
        }
        ChunkLayout {
            chunk_size: size,
            chunks,
        }
    }

    /// The packing of `pieces` at `size` when given, else at the candidate size with the
    /// least [`waste`](Self::waste) (ties: the larger): sixteen steps over
    /// `[2^23, 2^24]` elements, or one chunk of everything when the total is smaller.
    pub fn plan(pieces: &[usize], size: Option<usize>) -> ChunkLayout {
        let total: usize = pieces.iter().sum();
        if let Some(size) = size {
            return ChunkLayout::pack(pieces, size.max(1));
        }
        if total <= DEFAULT_SIZES.start {
            return ChunkLayout::pack(pieces, total.max(1));
        }
        let step = (DEFAULT_SIZES.end - DEFAULT_SIZES.start) / 16;
        (0..=16)
            .map(|i| ChunkLayout::pack(pieces, DEFAULT_SIZES.start + i * step))
            .min_by_key(|l| (l.waste(), usize::MAX - l.chunk_size))
            .expect("sixteen candidates")
    }

    /// Elements per chunk slot.
    pub fn chunk_size(&self) -> usize {
        self.chunk_size
    }

    /// The chunks' ranges, in order.
    pub fn chunks(&self) -> &[Range<usize>] {
        &self.chunks
    }

    /// Slot elements no state occupies: `Σ (chunk_size − len)` (internal fragmentation).
    pub fn waste(&self) -> usize {
        self.chunks.iter().map(|c| self.chunk_size - c.len()).sum()
    }

    /// Indices of the chunks overlapping `range`.
    pub fn overlapping(&self, range: &Range<usize>) -> Range<usize> {
        let first = self.chunks.partition_point(|c| c.end <= range.start);
        let last = self.chunks.partition_point(|c| c.start < range.end);
        first..last.max(first)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_fit_keeps_tensors_whole_unless_they_are_too_long() {
        let l = ChunkLayout::pack(&[3, 4, 2, 9, 1], 5);
        // [3] (4 does not fit), [4], [2] then 9 opens: [5] [4 + 1]
        assert_eq!(l.chunks(), &[0..3, 3..7, 7..9, 9..14, 14..19]);
        // 2 + 1 + 3 slot elements free in the first three chunks
        assert_eq!(l.waste(), 6);
        assert_eq!(l.overlapping(&(6..10)), 1..4);
        assert_eq!(l.overlapping(&(0..19)), 0..5);
    }

    #[test]
    fn the_planned_size_wastes_least() {
        // Tensors of 5M elements: 8M-element chunks hold one (3M wasted each), a size of
        // 15M holds three exactly.
        let pieces = vec![5 << 20; 12];
        let plan = ChunkLayout::plan(&pieces, None);
        assert_eq!(plan.chunk_size(), 15 << 20);
        assert_eq!(plan.waste(), 0);
        let small = ChunkLayout::plan(&[10, 20], None);
        assert_eq!(small.chunks().len(), 1);
        assert_eq!(small.chunks()[0], 0..30);
    }
}
