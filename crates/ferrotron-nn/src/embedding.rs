use crate::{Result, error::check_shape};
use ferrotron_tensor::{Tensor, ops::embedding_lookup};

/// Token embedding table `[v, h]` (Megatron `VocabParallelEmbedding` at tp 1).
#[derive(Clone, Debug)]
pub struct Embedding {
    weight: Tensor,
}

impl Embedding {
    /// Wraps a `[v, h]` table; errors when it is not 2-D.
    pub fn new(name: &str, weight: Tensor) -> Result<Embedding> {
        if weight.shape().len() != 2 {
            check_shape(name, weight.shape(), &[0, 0])?;
        }
        Ok(Embedding { weight })
    }

    /// The `[v, h]` table (also the output layer's weight when embeddings are tied).
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The `[v, h]` table, mutable (training writes updated values; keep its shape).
    pub fn weight_mut(&mut self) -> &mut Tensor {
        &mut self.weight
    }

    /// Hidden size `h`.
    pub fn hidden_size(&self) -> usize {
        self.weight.shape()[1]
    }

    /// `out[n, h] = table[ids[n], :]`; an id `>= v` is an error.
    pub fn forward(&self, ids: &[u32], out: &mut [f32]) -> Result<()> {
        embedding_lookup(self.weight.weight_ref(), self.hidden_size(), ids, out)?;
        Ok(())
    }
}
