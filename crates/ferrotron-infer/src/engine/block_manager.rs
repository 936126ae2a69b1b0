//! Which KV blocks hold which sequence's tokens, and automatic prefix caching (vLLM's
//! `KVCacheManager` / `BlockPool`): blocks are reference-counted, every *full* block is keyed
//! by a hash chain of its tokens (`hash(parent_hash, block_tokens)`), a new sequence reuses the
//! longest run of cached full blocks of its prompt, and blocks nobody references stay cached
//! until a new allocation evicts them, least recently used first. Each LoRA adapter's blocks
//! chain from a root of their own ([`CacheNamespace`]).

use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};

/// A block's position in the chain of a token sequence: 128 bits of SHA-256 over the parent's
/// hash and the block's token ids. Hits are also checked token by token, so a collision
/// cannot serve another prompt's keys.
type BlockHash = u128;

/// Which chains of the prefix cache a sequence's blocks belong to: the same tokens under
/// another LoRA adapter have other keys and values, so the blocks of each adapter chain from
/// a root of their own (vLLM puts the adapter's id into every block hash's extra keys). 0:
/// the base model.
pub type CacheNamespace = u64;

fn chain_hash(parent: BlockHash, tokens: &[u32]) -> BlockHash {
    let mut h = Sha256::new();
    h.update(parent.to_le_bytes());
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    u128::from_le_bytes(h.finalize()[..16].try_into().expect("16 bytes"))
}

/// What a cached full block holds.
#[derive(Clone, Debug)]
struct CachedBlock {
    hash: BlockHash,
    /// The previous block's hash (the namespace's root for a first block).
    parent: BlockHash,
    tokens: Vec<u32>,
    /// While no sequence references it: when it was released (its key in
    /// [`BlockManager::evictable`]).
    released_at: Option<u64>,
}

/// The blocks of one sequence: `table[i]` holds positions `i·block_size..`, and the first
/// `hashes.len()` blocks are full and registered in the prefix cache (or were hits), in the
/// chains of `namespace`.
#[derive(Clone, Debug, Default)]
pub struct SeqBlocks {
    pub table: Vec<u32>,
    hashes: Vec<BlockHash>,
    namespace: CacheNamespace,
}

impl SeqBlocks {
    /// No blocks yet, to be registered in the chains of `namespace`.
    pub fn new(namespace: CacheNamespace) -> SeqBlocks {
        SeqBlocks {
            namespace,
            ..SeqBlocks::default()
        }
    }

    /// The hash the block after the registered ones chains from.
    fn parent(&self) -> BlockHash {
        match self.hashes.last() {
            Some(&h) => h,
            None => self.namespace as BlockHash,
        }
    }
}

/// Allocation, reference counts and the prefix cache over a pool of `num_blocks` blocks.
#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    ref_counts: Vec<u32>,
    /// Never-used or evicted blocks, popped from the back.
    free: Vec<u32>,
    /// Full blocks registered in the prefix cache, by hash.
    cached: HashMap<BlockHash, u32>,
    /// What each registered block holds.
    contents: HashMap<u32, CachedBlock>,
    /// Registered blocks with no reference, by the tick they were released: the eviction
    /// order (oldest first).
    evictable: BTreeMap<u64, u32>,
    tick: u64,
    enable_prefix_caching: bool,
}

impl BlockManager {
    /// A pool of `num_blocks` free blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize, enable_prefix_caching: bool) -> Self {
        BlockManager {
            block_size,
            ref_counts: vec![0; num_blocks],
            free: (0..num_blocks as u32).rev().collect(),
            cached: HashMap::new(),
            contents: HashMap::new(),
            evictable: BTreeMap::new(),
            tick: 0,
            enable_prefix_caching,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    /// Blocks a new allocation can take now (free, or cached with no reference).
    pub fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Fraction of the pool referenced by sequences (vLLM's `kv_cache_usage_perc`).
    pub fn usage(&self) -> f64 {
        1.0 - self.available() as f64 / self.num_blocks() as f64
    }

    /// The longest run of cached full blocks of `namespace` that starts `prompt`, limited
    /// to `prompt[..prompt.len() - 1]` so the last token is always computed (its logits start
    /// the generation): takes a reference on each and returns them as a sequence's first
    /// blocks; the hit is `blocks.table.len() · block_size` tokens.
    pub fn lookup_prefix(&mut self, prompt: &[u32], namespace: CacheNamespace) -> SeqBlocks {
        let mut blocks = SeqBlocks::new(namespace);
        if !self.enable_prefix_caching || prompt.is_empty() {
            return blocks;
        }
        for chunk in prompt[..prompt.len() - 1].chunks_exact(self.block_size) {
            let parent = blocks.parent();
            let hash = chain_hash(parent, chunk);
            let Some(&block) = self.cached.get(&hash) else {
                break;
            };
            let c = &self.contents[&block];
            if c.parent != parent || c.tokens != chunk {
                break;
            }
            self.take_ref(block);
            blocks.table.push(block);
            blocks.hashes.push(hash);
        }
        blocks
    }

    /// Grows `blocks` to hold `num_tokens` tokens. Returns false, changing nothing, when the
    /// pool cannot supply the blocks (the caller preempts or waits).
    pub fn allocate(&mut self, blocks: &mut SeqBlocks, num_tokens: usize) -> bool {
        let need = num_tokens
            .div_ceil(self.block_size)
            .saturating_sub(blocks.table.len());
        if need > self.available() {
            return false;
        }
        for _ in 0..need {
            let block = match self.free.pop() {
                Some(b) => b,
                None => self.evict_oldest(),
            };
            self.ref_counts[block as usize] = 1;
            blocks.table.push(block);
        }
        true
    }

    /// Registers the blocks of `blocks` that `tokens` (the sequence's computed tokens) now
    /// fills, so later prompts can hit them. A block whose content is already cached under
    /// another block stays private.
    pub fn commit_full_blocks(&mut self, blocks: &mut SeqBlocks, tokens: &[u32]) {
        if !self.enable_prefix_caching {
            return;
        }
        let full = tokens.len() / self.block_size;
        while blocks.hashes.len() < full {
            let i = blocks.hashes.len();
            let parent = blocks.parent();
            let chunk = &tokens[i * self.block_size..(i + 1) * self.block_size];
            let hash = chain_hash(parent, chunk);
            let block = blocks.table[i];
            if let std::collections::hash_map::Entry::Vacant(e) = self.cached.entry(hash) {
                e.insert(block);
                let tokens = chunk.to_vec();
                self.contents.insert(
                    block,
                    CachedBlock {
                        hash,
                        parent,
                        tokens,
                        released_at: None,
                    },
                );
            }
            blocks.hashes.push(hash);
        }
    }

    /// Releases a finished or preempted sequence's blocks: registered ones stay cached
    /// (evictable, the sequence's last blocks first, as vLLM frees in reverse so a shared
    /// prefix outlives its tails), the others return to the free list.
    pub fn free(&mut self, blocks: SeqBlocks) {
        for &block in blocks.table.iter().rev() {
            let rc = &mut self.ref_counts[block as usize];
            *rc -= 1;
            if *rc > 0 {
                continue;
            }
            if let Some(c) = self.contents.get_mut(&block) {
                self.tick += 1;
                self.evictable.insert(self.tick, block);
                c.released_at = Some(self.tick);
            } else {
                self.free.push(block);
            }
        }
    }

    /// Takes a reference on `block` (a prefix hit), removing it from the eviction order.
    fn take_ref(&mut self, block: u32) {
        if let Some(at) = self
            .contents
            .get_mut(&block)
            .and_then(|c| c.released_at.take())
        {
            self.evictable.remove(&at);
        }
        self.ref_counts[block as usize] += 1;
    }

    /// Drops the least recently released cached block from the cache and returns it.
    fn evict_oldest(&mut self) -> u32 {
        let (_, block) = self.evictable.pop_first().expect("checked available()");
        let c = self
            .contents
            .remove(&block)
            .expect("evictable blocks are registered");
        self.cached.remove(&c.hash);
        block
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_prompt_hits_its_full_blocks_but_never_its_last_token() {
        let mut m = BlockManager::new(8, 4, true);
        let prompt: Vec<u32> = (0..9).collect();
        let mut a = m.lookup_prefix(&prompt, 0);
        assert!(a.table.is_empty());
        assert!(m.allocate(&mut a, 9));
        m.commit_full_blocks(&mut a, &prompt);
        let table = a.table.clone();
        m.free(a);
        assert_eq!(m.available(), 8);
        // 9 tokens: the hit stops at 8 = two full blocks of the first 8 of `prompt[..8]`.
        let b = m.lookup_prefix(&prompt, 0);
        assert_eq!(b.table, table[..2]);
        // 8 tokens: only `prompt[..7]` may hit: one block.
        let c = m.lookup_prefix(&prompt[..8], 0);
        assert_eq!(c.table, table[..1]);
        // Another continuation of the first block shares only it.
        let mut other = prompt[..4].to_vec();
        other.extend([50, 51, 52, 53, 54]);
        let d = m.lookup_prefix(&other, 0);
        assert_eq!(d.table, table[..1]);
        assert_eq!(m.available(), 6);
    }

    #[test]
    fn each_namespace_hits_only_its_own_blocks() {
        let mut m = BlockManager::new(8, 4, true);
        let prompt: Vec<u32> = (0..9).collect();
        let mut a = m.lookup_prefix(&prompt, 7);
        assert!(m.allocate(&mut a, 9));
        m.commit_full_blocks(&mut a, &prompt);
        let table = a.table.clone();
        m.free(a);
        assert!(m.lookup_prefix(&prompt, 0).table.is_empty());
        assert!(m.lookup_prefix(&prompt, 8).table.is_empty());
        assert_eq!(m.lookup_prefix(&prompt, 7).table, table[..2]);
        // A sequence without a lookup still registers in its own namespace.
        let mut b = SeqBlocks::new(9);
        assert!(m.allocate(&mut b, 9));
        m.commit_full_blocks(&mut b, &prompt);
        m.free(b);
        assert_eq!(m.lookup_prefix(&prompt, 9).table.len(), 2);
        assert!(m.lookup_prefix(&prompt, 0).table.is_empty());
    }

    #[test]
    fn eviction_takes_the_least_recently_released_block_and_forgets_it() {
        let mut m = BlockManager::new(2, 2, true);
        let (p, q) = (vec![1, 2, 3], vec![7, 8, 9]);
        for prompt in [&p, &q] {
            let mut s = m.lookup_prefix(prompt, 0);
            assert!(m.allocate(&mut s, 2));
            m.commit_full_blocks(&mut s, &prompt[..2]);
            m.free(s);
        }
        assert_eq!(m.available(), 2);
        let mut r = SeqBlocks::default();
        assert!(m.allocate(&mut r, 1)); // evicts p's block, released first
        assert!(m.lookup_prefix(&p, 0).table.is_empty());
        assert_eq!(m.lookup_prefix(&q, 0).table.len(), 1);
        assert!(!m.allocate(&mut r, 4), "no block left");
        assert_eq!(r.table.len(), 1, "a failed allocation changes nothing");
    }

    #[test]
    fn shared_blocks_stay_referenced_until_every_sequence_frees_them() {
        let mut m = BlockManager::new(4, 2, true);
        let prompt = vec![4, 5, 6];
        let mut a = m.lookup_prefix(&prompt, 0);
        assert!(m.allocate(&mut a, 3));
        m.commit_full_blocks(&mut a, &prompt);
        let b = m.lookup_prefix(&prompt, 0);
        assert_eq!(b.table, a.table[..1]);
        m.free(a);
        assert_eq!(m.available(), 3, "the shared block is still held by b");
        m.free(b);
        assert_eq!(m.available(), 4);
    }

    #[test]
    fn without_prefix_caching_nothing_hits() {
        let mut m = BlockManager::new(4, 2, false);
        let prompt = vec![4, 5, 6];
        let mut a = m.lookup_prefix(&prompt, 0);
        assert!(m.allocate(&mut a, 3));
        m.commit_full_blocks(&mut a, &prompt);
        m.free(a);
        assert!(m.lookup_prefix(&prompt, 0).table.is_empty());
        assert_eq!(m.available(), 4);
    }
}
