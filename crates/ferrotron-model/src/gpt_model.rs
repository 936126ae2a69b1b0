use crate::transformer_layer::{LayerInputs, LayerScratch};
use crate::{KvCache, ModelError, Result, TransformerConfig, TransformerLayer};
use ferrotron_nn::{Embedding, Linear, RmsNorm};
use ferrotron_tensor::gemm::matmul_weight_t;
use ferrotron_tensor::ops::RopeTable;

/// Which positions get logits from [`GptModel::forward`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsMode {
    /// Every token: logits `[s, b, v]`.
    All,
    /// Only the last token of each sequence: logits `[b, v]` (generation).
    Last,
}

/// A decoder-only transformer (Megatron `GPTModel`): embedding, `num_layers` decoder layers,
/// final RMSNorm and the output layer (the embedding table itself when tied).
#[derive(Clone, Debug)]
pub struct GptModel {
    pub config: TransformerConfig,
    pub embedding: Embedding,
    pub layers: Vec<TransformerLayer>,
    pub final_layernorm: RmsNorm,
    /// `[v, h]`; `None` when tied to the embedding.
    pub output_layer: Option<Linear>,
    rope: RopeTable,
    /// Set on a tensor-parallel shard ([`GptModel::tensor_parallel_shard`]): `config` then
    /// holds the local sizes.
    pub(crate) tp: Option<crate::TpInfo>,
    /// Set on a pipeline stage ([`GptModel::pipeline_stage`]).
    pub(crate) stage: Option<crate::StageInfo>,
}

impl GptModel {
    /// Assembles a model from its layers; checks that their count and sizes agree with `config`.
    pub fn new(
        config: TransformerConfig,
        embedding: Embedding,
        layers: Vec<TransformerLayer>,
        final_layernorm: RmsNorm,
        output_layer: Option<Linear>,
    ) -> Result<GptModel> {
        config.validate()?;
        if layers.len() != config.num_layers {
            return Err(ModelError::Input(format!(
                "{} layers given, config num_layers is {}",
                layers.len(),
                config.num_layers
            )));
        }
        if output_layer.is_some() != config.untie_embeddings_and_output_weights {
            return Err(ModelError::Input(
                "output layer presence disagrees with untie_embeddings_and_output_weights".into(),
            ));
        }
        let rope = RopeTable::new(
            config.kv_channels,
            config.rotary_base,
            &config.rope_scaling,
            config.max_position_embeddings,
        );
        Ok(GptModel {
            config,
            embedding,
            layers,
            final_layernorm,
            output_layer,
            rope,
            tp: None,
            stage: None,
        })
    }

    /// The rotary tables (`[max_position_embeddings, d/2]` cos and sin).
    pub fn rope(&self) -> &RopeTable {
        &self.rope
    }

    /// Runs `tokens: [s, b]` (Megatron order: token `t` of sequence `j` at `t·b + j`) after the
    /// `cache.len()` tokens already cached, appending their keys/values to `cache`.
    ///
    /// Returns logits `[s, b, v]` for [`LogitsMode::All`] or `[b, v]` for [`LogitsMode::Last`].
    /// Errors: token ids `>= v`, a batch size other than the cache's, or more tokens than the
    /// cache holds.
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        mode: LogitsMode,
    ) -> Result<Vec<f32>> {
        // Run the whole pass on a rayon worker: the many small parallel kernels then start
        // inline instead of each being injected into the pool from outside (a futex handoff).
        rayon::scope(|_| self.forward_on_worker(tokens, cache, mode))
    }

    fn forward_on_worker(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        mode: LogitsMode,
    ) -> Result<Vec<f32>> {
        let c = &self.config;
        let b = cache.batch();
        if b == 0 || tokens.is_empty() || !tokens.len().is_multiple_of(b) {
            return Err(ModelError::Input(format!(
                "{} tokens do not form whole rows of batch {b}",
                tokens.len()
            )));
        }
        let s = tokens.len() / b;
        let start = cache.len();
        if start + s > cache.capacity() {
            return Err(ModelError::Input(format!(
                "{} cached + {s} new tokens exceed the KV cache capacity {}",
                start,
                cache.capacity()
            )));
        }
        let h = c.hidden_size;
        let mut x = vec![0f32; tokens.len() * h];
        self.embedding.forward(tokens, &mut x)?;
        let positions: Vec<usize> = (start..start + s).collect();
        let inputs = LayerInputs {
            config: c,
            rope: &self.rope,
            positions: &positions,
            batch: b,
        };
        let mut scratch = LayerScratch::new(c, tokens.len());
        for (i, layer) in self.layers.iter().enumerate() {
            layer.forward(i, &mut x, &inputs, cache, &mut scratch);
        }
        cache.advance(s);
        let rows = match mode {
            LogitsMode::All => 0..s * b,
            LogitsMode::Last => (s - 1) * b..s * b,
        };
        let hidden = &x[rows.start * h..rows.end * h];
        let mut normed = vec![0f32; hidden.len()];
        self.final_layernorm.forward(hidden, &mut normed);
        let v = c.vocab_size;
        let mut logits = vec![0f32; rows.len() * v];
        let weight = match &self.output_layer {
            Some(l) => l.weight(),
            None => self.embedding.weight(),
        };
        matmul_weight_t(
            &normed,
            weight.weight_ref(),
            &mut logits,
            rows.len(),
            v,
            h,
            false,
        );
        Ok(logits)
    }
}
