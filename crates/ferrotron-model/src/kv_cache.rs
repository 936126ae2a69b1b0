use crate::{ModelError, Result, TransformerConfig};

/// Keys and values of past tokens for every layer, so each decode step attends to them without
/// recomputation. Per layer `k, v: [capacity, b, g, d]` (Megatron's `[s, b, ...]` order), f32.
#[derive(Clone, Debug)]
pub struct KvCache {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    len: usize,
    capacity: usize,
    batch: usize,
    row: usize,
}

impl KvCache {
    /// An empty cache for `capacity` tokens of `batch` sequences. Errors when `capacity`
    /// exceeds the model's `max_position_embeddings`.
    pub fn new(config: &TransformerConfig, batch: usize, capacity: usize) -> Result<KvCache> {
        if capacity > config.max_position_embeddings {
            return Err(ModelError::Input(format!(
                "KV cache of {capacity} tokens exceeds max_position_embeddings {}",
                config.max_position_embeddings
            )));
        }
        let row = batch * config.num_query_groups * config.kv_channels;
        let per_layer = capacity * row;
        Ok(KvCache {
            keys: (0..config.num_layers)
                .map(|_| vec![0.0; per_layer])
                .collect(),
            values: (0..config.num_layers)
                .map(|_| vec![0.0; per_layer])
                .collect(),
            len: 0,
            capacity,
            batch,
            row,
        })
    }

    /// Tokens stored per sequence.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no token is stored.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Maximum tokens per sequence.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Sequences `b`.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Forgets every token (keeps the buffers).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Keeps only the first `len` tokens (for re-using a shared prompt prefix).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Writes `s` new tokens' keys and values (`[s, b, g, d]`) for `layer` after the stored ones,
    /// returning the layer's keys and values for all `len + s` tokens.
    pub(crate) fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> (&[f32], &[f32]) {
        let start = self.len * self.row;
        let end = start + k.len();
        self.keys[layer][start..end].copy_from_slice(k);
        self.values[layer][start..end].copy_from_slice(v);
        (&self.keys[layer][..end], &self.values[layer][..end])
    }

    /// Marks `s` appended tokens as stored (after every layer appended them).
    pub(crate) fn advance(&mut self, s: usize) {
        self.len += s;
    }
}
