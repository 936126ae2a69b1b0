use crate::{ModelError, Result};
use ferrotron_tensor::ops::RopeScaling;

/// Which HuggingFace architecture a model came from (selects weight naming and biases).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelFamily {
    /// `LlamaForCausalLM` (LLaMA 2/3/3.1, SmolLM).
    Llama,
    /// `MistralForCausalLM` (sliding-window attention).
    Mistral,
    /// `Qwen2ForCausalLM` (q/k/v biases).
    Qwen2,
}

impl ModelFamily {
    /// The HF `architectures[0]` name.
    pub fn hf_architecture(self) -> &'static str {
        match self {
            ModelFamily::Llama => "LlamaForCausalLM",
            ModelFamily::Mistral => "MistralForCausalLM",
            ModelFamily::Qwen2 => "Qwen2ForCausalLM",
        }
    }
}

/// Model hyper-parameters with Megatron-Core's names (`TransformerConfig` /
/// `megatron/training/arguments.py`). Normalization is RMSNorm, the MLP is SwiGLU and position
/// embedding is rotary for every family supported today.
#[derive(Clone, Debug, PartialEq)]
pub struct TransformerConfig {
    pub family: ModelFamily,
    pub num_layers: usize,
    /// `h`.
    pub hidden_size: usize,
    /// `f`, the SwiGLU inner size.
    pub ffn_hidden_size: usize,
    /// `a`, query heads.
    pub num_attention_heads: usize,
    /// `g`, key/value heads (GQA); `a % g == 0`.
    pub num_query_groups: usize,
    /// `d`, head dim.
    pub kv_channels: usize,
    /// `v`, vocabulary rows in the embedding table.
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    /// RoPE base θ.
    pub rotary_base: f32,
    pub rope_scaling: RopeScaling,
    /// RMSNorm epsilon.
    pub layernorm_epsilon: f32,
    /// Bias on the q/k/v projections (Qwen2, LLaMA `attention_bias`).
    pub add_qkv_bias: bool,
    /// Bias on the attention output projection (LLaMA `attention_bias`).
    pub add_proj_bias: bool,
    /// Biases on the MLP projections (LLaMA `mlp_bias`).
    pub add_mlp_bias: bool,
    /// Separate output-layer weight; `false` ties it to the embedding (HF `tie_word_embeddings`).
    pub untie_embeddings_and_output_weights: bool,
    /// Keys visible per query (Mistral `sliding_window`); `None` for full causal attention.
    pub sliding_window: Option<usize>,
    /// Activation recomputation in [`GptModel::forward_backward`](crate::GptModel::forward_backward)
    /// (Megatron's `recompute_granularity`, with `recompute_method` and `recompute_num_layers`
    /// folded into [`RecomputeGranularity::Full`]); `None` keeps every activation. Only
    /// training reads it; HF config parsing leaves it `None`.
    pub recompute_granularity: Option<RecomputeGranularity>,
}

/// Which activations the training forward drops and the backward recomputes (Megatron-Core
/// `TransformerConfig.recompute_granularity`). Gradients are bit-identical to keeping
/// everything: the backward re-runs the same kernels on the same inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecomputeGranularity {
    /// Recompute core attention (Megatron's `selective` with its default
    /// `recompute_modules = ["core_attn"]`): each layer drops the attention output `ctx`
    /// `[s·b, a·d]` and its log-sum-exp `[s·b, a]`, which the backward recomputes from the
    /// saved q/k/v with the same flash-style kernel.
    Selective,
    /// Recompute whole layers (Megatron's `full`): only the input `[s·b, h]` of each
    /// recomputed group of layers is kept; the backward re-runs the group's forward, saving
    /// its activations, then backpropagates through it.
    Full {
        /// How layers are grouped (Megatron's `recompute_method`).
        method: RecomputeMethod,
        /// Megatron's `recompute_num_layers`: layers per group for
        /// [`RecomputeMethod::Uniform`], recomputed layers for [`RecomputeMethod::Block`];
        /// `1..=num_layers`.
        num_layers: usize,
    },
}

/// How [`RecomputeGranularity::Full`] groups layers (Megatron's `recompute_method`,
/// `TransformerBlock._checkpointed_forward`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecomputeMethod {
    /// Consecutive groups of `num_layers` layers over the whole stack (the last group is
    /// shorter when `num_layers` does not divide the layer count, as Megatron clamps it);
    /// only each group's input is kept.
    Uniform,
    /// The first `num_layers` layers keep only their input, each recomputed on its own; the
    /// remaining layers keep all activations.
    Block,
}

impl TransformerConfig {
    /// Checks the divisibility and positivity constraints every layer relies on.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("num_layers", self.num_layers),
            ("hidden_size", self.hidden_size),
            ("ffn_hidden_size", self.ffn_hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_query_groups", self.num_query_groups),
            ("kv_channels", self.kv_channels),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(field_error(field, "must be > 0"));
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_query_groups)
        {
            return Err(field_error(
                "num_query_groups",
                format!(
                    "{} query groups do not divide {} attention heads",
                    self.num_query_groups, self.num_attention_heads
                ),
            ));
        }
        if !self.kv_channels.is_multiple_of(2) {
            return Err(field_error(
                "kv_channels",
                "rotary embedding needs an even head dim",
            ));
        }
        if self.sliding_window == Some(0) {
            return Err(field_error("sliding_window", "must be > 0"));
        }
        self.validate_recompute()
    }

    /// Megatron's `TransformerConfig.__post_init__` rules for recomputation that the type does
    /// not already enforce (a `full` granularity always carries a method and a layer count, a
    /// `selective` one neither): `recompute_num_layers` must lie in `1..=num_layers` (Megatron's
    /// "between 1 and num_layers_per_pipeline_rank", pipeline size 1 here).
    pub(crate) fn validate_recompute(&self) -> Result<()> {
        if let Some(RecomputeGranularity::Full { num_layers, .. }) = self.recompute_granularity
            && !(1..=self.num_layers).contains(&num_layers)
        {
            return Err(field_error(
                "recompute_num_layers",
                format!(
                    "{num_layers} is not between 1 and num_layers ({})",
                    self.num_layers
                ),
            ));
        }
        Ok(())
    }

    /// Query heads per key/value group, `a / g`.
    pub fn heads_per_group(&self) -> usize {
        self.num_attention_heads / self.num_query_groups
    }

    /// Output width of the packed `linear_qkv`: `g · (a/g + 2) · d`.
    pub fn qkv_size(&self) -> usize {
        self.num_query_groups * (self.heads_per_group() + 2) * self.kv_channels
    }

    /// Parameter count (embedding counted once when tied), from the parameter declarations
    /// ([`crate::module::ModelLayout::num_parameters`]).
    pub fn num_parameters(&self) -> usize {
        let whole = crate::module::ModelPart::whole(self.num_layers);
        crate::module::ModelLayout::new(self, self.vocab_size, &whole).num_parameters()
    }
}

pub(crate) fn field_error(field: &str, message: impl Into<String>) -> ModelError {
    ModelError::ConfigField {
        field: field.to_string(),
        message: message.into(),
    }
}
