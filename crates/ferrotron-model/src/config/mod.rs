mod mla;
mod moe;

use crate::lora::LoraConfig;
use crate::{ModelError, Result};
pub use ferrotron_tensor::ops::ActivationFunc;
use ferrotron_tensor::ops::RopeScaling;
pub use mla::MlaConfig;
pub use moe::{
    DropPolicy, ExpertCapacity, ExpertGroups, GroupScore, LoadBalancing, MoeConfig, RouterConfig,
    ScoreFunction, TokenDispatcher,
};

/// Which HuggingFace architecture a model came from (selects weight naming and biases).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelFamily {
    /// `LlamaForCausalLM` (LLaMA 2/3/3.1, SmolLM).
    Llama,
    /// `MistralForCausalLM` (sliding-window attention).
    Mistral,
    /// `Qwen2ForCausalLM` (q/k/v biases).
    Qwen2,
    /// `OlmoForCausalLM` (non-parametric LayerNorm).
    Olmo,
    /// `Olmo2ForCausalLM` (norms after each sublayer, full-width q/k RMSNorm).
    Olmo2,
    /// `GemmaForCausalLM` (GeGLU-tanh, `1 + w` RMSNorm gains, `√h` embedding scale).
    Gemma,
    /// `Phi3ForCausalLM` (fused `qkv_proj` and `gate_up_proj`).
    Phi3,
    /// `Starcoder2ForCausalLM` (LayerNorm with bias, GeLU-tanh MLP, biases everywhere).
    Starcoder2,
    /// `FalconForCausalLM` (parallel attention and MLP, one LayerNorm, multi-query).
    Falcon,
    /// `BloomForCausalLM` (ALiBi, embedding LayerNorm, GeLU-tanh, biases).
    Bloom,
    /// `MixtralForCausalLM` (Mistral with every MLP a top-k softmax-routed MoE).
    Mixtral,
    /// `Qwen2MoeForCausalLM` (Qwen1.5-MoE / Qwen2-MoE: q/k/v biases, routed experts without
    /// renormalisation plus a sigmoid-gated shared expert, dense layers by
    /// `decoder_sparse_step` / `mlp_only_layers`).
    Qwen2Moe,
    /// `OlmoeForCausalLM` (OLMoE: full-width q/k RMSNorm, routed experts without
    /// renormalisation).
    Olmoe,
    /// `DeepseekV2ForCausalLM` (DeepSeek-V2 / V2-Lite: multi-latent attention with
    /// interleaved YaRN rope, ungated shared experts, greedy or group-limited routing
    /// scaled by `routed_scaling_factor`, the first `first_k_dense_replace` layers dense).
    DeepseekV2,
}

impl ModelFamily {
    /// Every family, in the order errors list them.
    pub const ALL: [ModelFamily; 14] = [
        ModelFamily::Llama,
        ModelFamily::Mistral,
        ModelFamily::Qwen2,
        ModelFamily::Olmo,
        ModelFamily::Olmo2,
        ModelFamily::Gemma,
        ModelFamily::Phi3,
        ModelFamily::Starcoder2,
        ModelFamily::Falcon,
        ModelFamily::Bloom,
        ModelFamily::Mixtral,
        ModelFamily::Qwen2Moe,
        ModelFamily::Olmoe,
        ModelFamily::DeepseekV2,
    ];

    /// The HF `architectures[0]` name.
    pub fn hf_architecture(self) -> &'static str {
        self.hf_names().architecture
    }

    /// The HF `architectures[0]` of a model with `head`: `XForCausalLM`, or
    /// `XForSequenceClassification` for a score head.
    pub fn hf_architecture_with(self, head: OutputHead) -> String {
        let lm = self.hf_architecture();
        match head {
            OutputHead::LanguageModel => lm.to_string(),
            OutputHead::Score => {
                let stem = lm.strip_suffix("ForCausalLM").unwrap_or(lm);
                format!("{stem}ForSequenceClassification")
            }
        }
    }

    /// The HF `model_type`.
    pub fn model_type(self) -> &'static str {
        self.hf_names().model_type
    }
}

/// Megatron's `normalization`: which norm every norm module of the model is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Normalization {
    /// `RMSNorm` (Zhang & Sennrich 2019) with a `[n]` gain.
    RmsNorm,
    /// `LayerNorm` (Ba et al. 2016) with a `[n]` gain and a `[n]` bias.
    LayerNorm,
    /// `LayerNorm` without gain or bias (OLMo's `OlmoLayerNorm`; Megatron has no such norm).
    NonParametricLayerNorm,
}

/// Megatron's `position_embedding_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PositionEmbedding {
    /// `rope`: rotary embedding of q and k (Su et al. 2021), rotate-half layout.
    Rope,
    /// `alibi`: a per-head linear bias on the attention scores (Press et al. 2022; HF Bloom).
    Alibi,
}

/// Model hyper-parameters with Megatron-Core's names (`TransformerConfig` /
/// `megatron/training/arguments.py`): one skeleton (embedding, decoder layers of attention
/// and MLP, final norm, output layer) whose switches express every supported family.
#[derive(Clone, Debug, PartialEq)]
pub struct TransformerConfig {
    pub family: ModelFamily,
    pub num_layers: usize,
    /// `h`.
    pub hidden_size: usize,
    /// `f`, the MLP's inner size (per half of a gated `linear_fc1`).
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
    /// Megatron's `rotary_interleaved`: rope rotates adjacent pairs `(2i, 2i + 1)`
    /// (DeepSeek-V2) instead of the halves `(i, i + d/2)`.
    pub rotary_interleaved: bool,
    /// Epsilon of every norm.
    pub layernorm_epsilon: f32,
    /// Megatron's `normalization`.
    pub normalization: Normalization,
    /// Megatron's `apply_layernorm_1p`: gains stored as `w`, applied as `1 + w` (Gemma's
    /// RMSNorm); initialized to zeros.
    pub apply_layernorm_1p: bool,
    /// Megatron's `qk_layernorm`, full width as OLMo2 applies it: an RMSNorm over each row's
    /// `a·d` queries and its `g·d` keys after `linear_qkv` and before rope (Megatron's own
    /// normalizes each head; a tensor-parallel rank all-reduces the row statistics).
    pub qk_layernorm: bool,
    /// Norms on each sublayer's output instead of its input (OLMo2:
    /// `x += norm(attn(x))`, `x += norm(mlp(x))`).
    pub post_sublayer_norm: bool,
    /// Attention and MLP read the same normed input and add into the residual together
    /// (GPT-J / Falcon `parallel_attn`: `x += attn(norm(x)) + mlp(norm(x))`).
    pub parallel_attention_mlp: bool,
    /// A norm right after the word embedding (Bloom's `word_embeddings_layernorm`).
    pub embedding_layernorm: bool,
    /// Multiply the word embeddings by `√h` (Gemma).
    pub scale_embeddings: bool,
    /// Megatron's `gated_linear_unit`: `linear_fc1` is `[2f, h]`, gate rows then up rows, and
    /// the MLP computes `act(gate)·up`; otherwise `[f, h]` and `act(fc1)`.
    pub gated_linear_unit: bool,
    /// Megatron's `activation_func`.
    pub activation_func: ActivationFunc,
    /// Megatron's `position_embedding_type`.
    pub position_embedding_type: PositionEmbedding,
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
    /// LoRA adapters on the linear layers it matches, every other parameter frozen (NeMo's
    /// `LoRA` transform; see [`LoraConfig`]); `None` trains (or serves) the model as it is.
    /// HF config parsing leaves it `None`; [`crate::GptModel::with_lora`] sets it.
    pub lora: Option<LoraConfig>,
    /// What the last stage computes from the final norm's output.
    pub output_head: OutputHead,
    /// Mixture-of-experts layers (Megatron's `num_moe_experts` and `moe_*`); `None`: every
    /// layer has the dense MLP.
    pub moe: Option<MoeConfig>,
    /// Megatron's `multi_latent_attention` with its sizes: every layer's attention is MLA
    /// ([`MlaConfig`]); `None` for the standard `linear_qkv` attention.
    pub multi_latent_attention: Option<MlaConfig>,
}

/// The head on the final hidden states.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OutputHead {
    /// Logits over the vocabulary (the output layer, or the tied embedding): a causal LM.
    #[default]
    LanguageModel,
    /// One scalar per token from `score.weight: [1, h]` (HF's `score` of
    /// `...ForSequenceClassification` with one label, no bias): a reward model, whose reward
    /// is read at a sequence's last token. Never tied to the embedding.
    Score,
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
        if let Some(mla) = &self.multi_latent_attention {
            mla.validate(self)?;
        } else if self.position_embedding_type == PositionEmbedding::Rope
            && !self.kv_channels.is_multiple_of(2)
        {
            return Err(field_error(
                "kv_channels",
                "rotary embedding needs an even head dim",
            ));
        }
        if self.sliding_window == Some(0) {
            return Err(field_error("sliding_window", "must be > 0"));
        }
        if self.qk_layernorm && self.normalization != Normalization::RmsNorm {
            return Err(field_error(
                "qk_layernorm",
                "the full-width q/k norm is an RMSNorm (set normalization to RMSNorm)",
            ));
        }
        if self.post_sublayer_norm && self.parallel_attention_mlp {
            return Err(field_error(
                "post_sublayer_norm",
                "cannot be combined with parallel_attention_mlp",
            ));
        }
        self.family.hf_names().check_expresses(self)?;
        self.validate_moe()?;
        if let Some(lora) = &self.lora {
            lora.validate()?;
        }
        self.validate_recompute()
    }

    /// The MoE settings, and what the experts need of the rest: they are SwiGLU MLPs
    /// without biases.
    fn validate_moe(&self) -> Result<()> {
        let Some(moe) = &self.moe else {
            return Ok(());
        };
        moe.validate(self.num_layers)?;
        if !self.gated_linear_unit || self.activation_func != ActivationFunc::Silu {
            return Err(field_error(
                "activation_func",
                "MoE experts are SwiGLU MLPs (gated_linear_unit with silu)",
            ));
        }
        if self.add_mlp_bias {
            return Err(field_error("add_mlp_bias", "MoE experts have no biases"));
        }
        if self.lora.is_some() {
            return Err(field_error(
                "lora",
                "LoRA on a model with MoE layers is not supported",
            ));
        }
        Ok(())
    }

    /// Whether global layer `layer` has an MoE MLP.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.is_moe_layer(layer))
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

    /// The dims rope rotates per head: multi-latent attention's `qk_pos_emb_head_dim`, else
    /// the head dim `d`.
    pub fn rotary_dim(&self) -> usize {
        self.multi_latent_attention
            .map_or(self.kv_channels, |m| m.qk_pos_emb_head_dim)
    }

    /// Each head's value dims (`linear_proj`'s input is `a·` this): multi-latent
    /// attention's `v_head_dim`, else the head dim `d`.
    pub fn value_head_dim(&self) -> usize {
        self.multi_latent_attention
            .map_or(self.kv_channels, |m| m.v_head_dim)
    }

    /// Query heads per key/value group, `a / g`.
    pub fn heads_per_group(&self) -> usize {
        self.num_attention_heads / self.num_query_groups
    }

    /// Output width of `linear_fc1`: `2f` when gated, `f` otherwise.
    pub fn fc1_size(&self) -> usize {
        if self.gated_linear_unit {
            2 * self.ffn_hidden_size
        } else {
            self.ffn_hidden_size
        }
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

#[cfg(test)]
mod tests {
    use super::ModelFamily;

    /// `ModelFamily::ALL` names every variant once: the exhaustive match stops compiling when
    /// a variant is added, and the positions catch a missing or repeated entry.
    #[test]
    fn all_lists_every_family_once() {
        for (i, family) in ModelFamily::ALL.into_iter().enumerate() {
            let position = match family {
                ModelFamily::Llama => 0,
                ModelFamily::Mistral => 1,
                ModelFamily::Qwen2 => 2,
                ModelFamily::Olmo => 3,
                ModelFamily::Olmo2 => 4,
                ModelFamily::Gemma => 5,
                ModelFamily::Phi3 => 6,
                ModelFamily::Starcoder2 => 7,
                ModelFamily::Falcon => 8,
                ModelFamily::Bloom => 9,
                ModelFamily::Mixtral => 10,
                ModelFamily::Qwen2Moe => 11,
                ModelFamily::Olmoe => 12,
                ModelFamily::DeepseekV2 => 13,
            };
            assert_eq!(position, i, "{family:?}");
            assert_eq!(
                ModelFamily::from_model_type(family.model_type()),
                Some(family)
            );
        }
    }
}
