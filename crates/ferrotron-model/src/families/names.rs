//! How each HF architecture names the tensors of the Megatron modules: the per-family half
//! of the HF mapping (Pai-Megatron-Patch's per-model `hf2mcore` name maps). The module kinds
//! declare the Megatron structure and ask this table for HF names, so a family that renames
//! or fuses tensors is one table, not a second mapping.

use crate::config::field_error;
use crate::{ModelFamily, Result, TransformerConfig};

/// HF names of a family's modules (without `.weight` / `.bias`); a decoder layer's names are
/// relative to `{layers}.{i}`. A norm the family does not have is `None` (the config
/// switches decide which modules exist; [`HfNames::check_expresses`] ties the two).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HfNames {
    /// `architectures[0]`, e.g. `LlamaForCausalLM`.
    pub architecture: &'static str,
    /// `model_type`, e.g. `llama`.
    pub model_type: &'static str,
    /// The word embedding, e.g. `model.embed_tokens`.
    pub embedding: &'static str,
    /// The norm right after the embedding (Bloom).
    pub embedding_layernorm: Option<&'static str>,
    /// The decoder layers' prefix, e.g. `model.layers`.
    pub layers: &'static str,
    /// The norm before attention (and before the MLP too, under parallel attention).
    pub input_layernorm: Option<&'static str>,
    /// The query, key and value projections.
    pub qkv: HfQkv,
    /// The full-width query and key norms (OLMo2).
    pub qk_layernorm: Option<[&'static str; 2]>,
    /// Attention's output projection (Megatron `linear_proj`).
    pub linear_proj: &'static str,
    /// The norm on attention's output (OLMo2).
    pub post_self_attn_layernorm: Option<&'static str>,
    /// The norm before the MLP (Megatron `pre_mlp_layernorm`).
    pub pre_mlp_layernorm: Option<&'static str>,
    /// The MLP's first projection(s) (Megatron `linear_fc1`).
    pub fc1: HfFc1,
    /// The MLP's output projection (Megatron `linear_fc2`).
    pub linear_fc2: &'static str,
    /// The norm on the MLP's output (OLMo2).
    pub post_mlp_layernorm: Option<&'static str>,
    /// The norm after the last layer.
    pub final_layernorm: &'static str,
    /// The untied output layer.
    pub output_layer: &'static str,
    /// The MoE layers' tensors (families with experts).
    pub moe: Option<HfMoe>,
    /// Multi-latent attention's tensors (DeepSeek-V2; `qkv` is then unused).
    pub mla: Option<HfMla>,
}

/// How a family names multi-latent attention's tensors (relative to `{layers}.{i}`, without
/// `.weight`; transformers' `DeepseekV2Attention`), each beside its Megatron module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HfMla {
    /// `linear_q_proj` (no `q_lora_rank`).
    pub q_proj: &'static str,
    /// `linear_q_down_proj`.
    pub q_a_proj: &'static str,
    /// `q_layernorm`.
    pub q_a_layernorm: &'static str,
    /// `linear_q_up_proj`.
    pub q_b_proj: &'static str,
    /// `linear_kv_down_proj`.
    pub kv_a_proj_with_mqa: &'static str,
    /// `kv_layernorm`.
    pub kv_a_layernorm: &'static str,
    /// `linear_kv_up_proj`.
    pub kv_b_proj: &'static str,
}

/// How a family names an MoE layer's tensors (relative to `{layers}.{i}`, without
/// `.weight`). transformers 5 fuses the experts into 3-D parameters in memory
/// (`experts.gate_up_proj` `[E, 2f, h]`) but reads and writes them per expert on disk, as
/// here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HfMoe {
    /// The router `[E, h]` (Megatron `mlp.router`): `block_sparse_moe.gate`, `mlp.gate`.
    pub router: &'static str,
    /// Expert `e`'s prefix is `{experts}.{e}`.
    pub experts: &'static str,
    /// Each expert's gate and up projections `[f, h]` under its prefix (Mixtral's `w1`,
    /// `w3`; `gate_proj`, `up_proj`).
    pub expert_fc1: [&'static str; 2],
    /// Each expert's down projection `[h, f]` (Mixtral's `w2`; `down_proj`).
    pub expert_fc2: &'static str,
    /// The shared expert's gate, up and down projections (Qwen2-MoE's
    /// `mlp.shared_expert.gate_proj`, ...).
    pub shared_expert: Option<[&'static str; 3]>,
    /// The shared expert's gate `[1, h]` (Qwen2-MoE's `mlp.shared_expert_gate`).
    pub shared_expert_gate: Option<&'static str>,
}

/// transformers' `Qwen2MoeSparseMoeBlock` / `OlmoeSparseMoeBlock` names.
const QWEN2_MOE: HfMoe = HfMoe {
    router: "mlp.gate",
    experts: "mlp.experts",
    expert_fc1: ["gate_proj", "up_proj"],
    expert_fc2: "down_proj",
    shared_expert: Some([
        "mlp.shared_expert.gate_proj",
        "mlp.shared_expert.up_proj",
        "mlp.shared_expert.down_proj",
    ]),
    shared_expert_gate: Some("mlp.shared_expert_gate"),
};

/// How a family stores the query, key and value projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfQkv {
    /// Three tensors (`[a·d, h]`, `[g·d, h]`, `[g·d, h]`), packed per query group into
    /// Megatron's `linear_qkv`.
    Separate {
        q: &'static str,
        k: &'static str,
        v: &'static str,
    },
    /// One tensor of the three stacked, all queries then all keys then all values (Phi-3's
    /// `qkv_proj`), repacked per query group.
    Stacked(&'static str),
    /// One tensor already in Megatron's per-group layout: each group's queries, its key, its
    /// value (Falcon's `query_key_value`, multi-query = one group; Bloom's, one group per
    /// head: `view(…, heads, 3, d)`).
    Grouped(&'static str),
}

/// How a family stores the MLP's first projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfFc1 {
    /// Gate and up projections as two tensors (`[f, h]` each), packed gate rows then up rows
    /// into Megatron's `linear_fc1`.
    Gated {
        gate: &'static str,
        up: &'static str,
    },
    /// One tensor: gate rows then up rows (Phi-3's `gate_up_proj`), or the single projection
    /// of an ungated MLP (`c_fc`, `dense_h_to_4h`).
    Whole(&'static str),
}

/// transformers' `LlamaForCausalLM` names (`modeling_llama.py`), which most families share.
const LLAMA: HfNames = HfNames {
    architecture: "LlamaForCausalLM",
    model_type: "llama",
    embedding: "model.embed_tokens",
    embedding_layernorm: None,
    layers: "model.layers",
    input_layernorm: Some("input_layernorm"),
    qkv: HfQkv::Separate {
        q: "self_attn.q_proj",
        k: "self_attn.k_proj",
        v: "self_attn.v_proj",
    },
    qk_layernorm: None,
    linear_proj: "self_attn.o_proj",
    post_self_attn_layernorm: None,
    pre_mlp_layernorm: Some("post_attention_layernorm"),
    fc1: HfFc1::Gated {
        gate: "mlp.gate_proj",
        up: "mlp.up_proj",
    },
    linear_fc2: "mlp.down_proj",
    post_mlp_layernorm: None,
    final_layernorm: "model.norm",
    output_layer: "lm_head",
    moe: None,
    mla: None,
};

/// transformers' `FalconForCausalLM` (`new_decoder_architecture=False`) and
/// `BloomForCausalLM` share the `transformer.h` layout.
const FALCON: HfNames = HfNames {
    architecture: "FalconForCausalLM",
    model_type: "falcon",
    embedding: "transformer.word_embeddings",
    embedding_layernorm: None,
    layers: "transformer.h",
    input_layernorm: Some("input_layernorm"),
    qkv: HfQkv::Grouped("self_attention.query_key_value"),
    qk_layernorm: None,
    linear_proj: "self_attention.dense",
    post_self_attn_layernorm: None,
    pre_mlp_layernorm: None,
    fc1: HfFc1::Whole("mlp.dense_h_to_4h"),
    linear_fc2: "mlp.dense_4h_to_h",
    post_mlp_layernorm: None,
    final_layernorm: "transformer.ln_f",
    output_layer: "lm_head",
    moe: None,
    mla: None,
};

impl ModelFamily {
    /// The family's HF tensor names.
    pub fn hf_names(self) -> HfNames {
        match self {
            ModelFamily::Llama => LLAMA,
            ModelFamily::Mistral => HfNames {
                architecture: "MistralForCausalLM",
                model_type: "mistral",
                ..LLAMA
            },
            ModelFamily::Qwen2 => HfNames {
                architecture: "Qwen2ForCausalLM",
                model_type: "qwen2",
                ..LLAMA
            },
            ModelFamily::Olmo => HfNames {
                architecture: "OlmoForCausalLM",
                model_type: "olmo",
                ..LLAMA
            },
            ModelFamily::Olmo2 => HfNames {
                architecture: "Olmo2ForCausalLM",
                model_type: "olmo2",
                input_layernorm: None,
                qk_layernorm: Some(["self_attn.q_norm", "self_attn.k_norm"]),
                post_self_attn_layernorm: Some("post_attention_layernorm"),
                pre_mlp_layernorm: None,
                post_mlp_layernorm: Some("post_feedforward_layernorm"),
                ..LLAMA
            },
            ModelFamily::Gemma => HfNames {
                architecture: "GemmaForCausalLM",
                model_type: "gemma",
                ..LLAMA
            },
            ModelFamily::Phi3 => HfNames {
                architecture: "Phi3ForCausalLM",
                model_type: "phi3",
                qkv: HfQkv::Stacked("self_attn.qkv_proj"),
                fc1: HfFc1::Whole("mlp.gate_up_proj"),
                ..LLAMA
            },
            ModelFamily::Starcoder2 => HfNames {
                architecture: "Starcoder2ForCausalLM",
                model_type: "starcoder2",
                fc1: HfFc1::Whole("mlp.c_fc"),
                linear_fc2: "mlp.c_proj",
                ..LLAMA
            },
            ModelFamily::Falcon => FALCON,
            ModelFamily::Bloom => HfNames {
                architecture: "BloomForCausalLM",
                model_type: "bloom",
                embedding_layernorm: Some("transformer.word_embeddings_layernorm"),
                pre_mlp_layernorm: Some("post_attention_layernorm"),
                ..FALCON
            },
            ModelFamily::Mixtral => HfNames {
                architecture: "MixtralForCausalLM",
                model_type: "mixtral",
                moe: Some(HfMoe {
                    router: "block_sparse_moe.gate",
                    experts: "block_sparse_moe.experts",
                    expert_fc1: ["w1", "w3"],
                    expert_fc2: "w2",
                    shared_expert: None,
                    shared_expert_gate: None,
                }),
                ..LLAMA
            },
            ModelFamily::Qwen2Moe => HfNames {
                architecture: "Qwen2MoeForCausalLM",
                model_type: "qwen2_moe",
                moe: Some(QWEN2_MOE),
                ..LLAMA
            },
            ModelFamily::DeepseekV2 => HfNames {
                architecture: "DeepseekV2ForCausalLM",
                model_type: "deepseek_v2",
                moe: Some(HfMoe {
                    shared_expert: Some([
                        "mlp.shared_experts.gate_proj",
                        "mlp.shared_experts.up_proj",
                        "mlp.shared_experts.down_proj",
                    ]),
                    shared_expert_gate: None,
                    ..QWEN2_MOE
                }),
                mla: Some(HfMla {
                    q_proj: "self_attn.q_proj",
                    q_a_proj: "self_attn.q_a_proj",
                    q_a_layernorm: "self_attn.q_a_layernorm",
                    q_b_proj: "self_attn.q_b_proj",
                    kv_a_proj_with_mqa: "self_attn.kv_a_proj_with_mqa",
                    kv_a_layernorm: "self_attn.kv_a_layernorm",
                    kv_b_proj: "self_attn.kv_b_proj",
                }),
                ..LLAMA
            },
            ModelFamily::Olmoe => HfNames {
                architecture: "OlmoeForCausalLM",
                model_type: "olmoe",
                qk_layernorm: Some(["self_attn.q_norm", "self_attn.k_norm"]),
                moe: Some(HfMoe {
                    shared_expert: None,
                    shared_expert_gate: None,
                    ..QWEN2_MOE
                }),
                ..LLAMA
            },
        }
    }
}

impl HfNames {
    /// Checks that the family has an HF tensor for every module `c` declares, and the MLP
    /// layout `c` asks for.
    ///
    /// # Errors
    /// The first config switch the family's HF layout cannot hold, naming the field.
    pub fn check_expresses(&self, c: &TransformerConfig) -> Result<()> {
        let arch = self.architecture;
        let missing = |field: &str, what: &str| {
            Err(field_error(field, format!("{arch} has no {what} tensor")))
        };
        let pre_norms = !c.post_sublayer_norm;
        if pre_norms && self.input_layernorm.is_none() {
            return missing("post_sublayer_norm", "input_layernorm");
        }
        if pre_norms && !c.parallel_attention_mlp && self.pre_mlp_layernorm.is_none() {
            return missing("parallel_attention_mlp", "pre-MLP norm");
        }
        if c.post_sublayer_norm
            && (self.post_self_attn_layernorm.is_none() || self.post_mlp_layernorm.is_none())
        {
            return missing("post_sublayer_norm", "post-sublayer norm");
        }
        if c.qk_layernorm && self.qk_layernorm.is_none() {
            return missing("qk_layernorm", "q/k norm");
        }
        if self.mla.is_some() != c.multi_latent_attention.is_some() {
            let has = if self.mla.is_some() { "" } else { " no" };
            return Err(field_error(
                "multi_latent_attention",
                format!("{arch} has{has} multi-latent attention"),
            ));
        }
        // DeepSeek-V2 states an all-dense model (`first_k_dense_replace` = the layers); the
        // other families' configs always build their experts.
        if self.moe.is_some() && c.moe.is_none() && self.mla.is_none() {
            return Err(field_error("moe", format!("{arch} has MoE layers")));
        }
        if let Some(moe) = &c.moe {
            let Some(names) = self.moe else {
                return missing("moe", "expert");
            };
            if moe.shared_expert_intermediate_size.is_some() && names.shared_expert.is_none() {
                return missing("moe_shared_expert_intermediate_size", "shared expert");
            }
            if moe.shared_expert_gate && names.shared_expert_gate.is_none() {
                return missing("moe_shared_expert_gate", "shared expert gate");
            }
        }
        if c.embedding_layernorm && self.embedding_layernorm.is_none() {
            return missing("embedding_layernorm", "embedding norm");
        }
        if let HfFc1::Gated { .. } = self.fc1
            && !c.gated_linear_unit
        {
            return Err(field_error(
                "gated_linear_unit",
                format!("{arch} stores a gated MLP (gate and up projections)"),
            ));
        }
        Ok(())
    }
}
