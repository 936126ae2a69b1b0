use crate::Result;
use ferrotron_tensor::{TensorView, ops::embedding_lookup};

/// Token embedding table `[v, h]` over a borrowed parameter (Megatron `VocabParallelEmbedding`
/// at tp 1).
#[derive(Clone, Copy, Debug)]
pub struct Embedding<'a> {
    weight: TensorView<'a>,
}

impl<'a> Embedding<'a> {
    /// Views a `[v, h]` table.
    ///
    /// # Panics
    /// When the table is not 2-D (the model's declarations guarantee it).
    pub fn new(weight: TensorView<'a>) -> Embedding<'a> {
        assert_eq!(weight.shape().len(), 2, "an embedding table is [v, h]");
        Embedding { weight }
    }

    /// The `[v, h]` table (also the output layer's weight when embeddings are tied).
    pub fn weight(&self) -> TensorView<'a> {
        self.weight
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
