//! How each HF architecture names the tensors of the Megatron modules: the per-family half
//! of the HF mapping (Pai-Megatron-Patch's per-model `hf2mcore` name maps). The module kinds
//! declare the Megatron structure and ask this table for HF names, so a family that renames
//! or fuses tensors is one table, not a second mapping.

use crate::ModelFamily;

/// HF names of a family's modules (without `.weight` / `.bias`); a decoder layer's names are
/// relative to `{layers}.{i}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HfNames {
    /// The word embedding, e.g. `model.embed_tokens`.
    pub embedding: &'static str,
    /// The decoder layers' prefix, e.g. `model.layers`.
    pub layers: &'static str,
    /// The norm before attention.
    pub input_layernorm: &'static str,
    /// The query, key and value projections.
    pub qkv: HfQkv,
    /// Attention's output projection (Megatron `linear_proj`).
    pub linear_proj: &'static str,
    /// The norm before the MLP (Megatron `pre_mlp_layernorm`).
    pub pre_mlp_layernorm: &'static str,
    /// The MLP's first projection(s) (Megatron `linear_fc1`).
    pub fc1: HfFc1,
    /// The MLP's output projection (Megatron `linear_fc2`).
    pub linear_fc2: &'static str,
    /// The norm after the last layer.
    pub final_layernorm: &'static str,
    /// The untied output layer.
    pub output_layer: &'static str,
}

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
}

/// transformers' `LlamaForCausalLM` names, shared by Mistral and Qwen2 (`modeling_llama.py`).
const LLAMA: HfNames = HfNames {
    embedding: "model.embed_tokens",
    layers: "model.layers",
    input_layernorm: "input_layernorm",
    qkv: HfQkv::Separate {
        q: "self_attn.q_proj",
        k: "self_attn.k_proj",
        v: "self_attn.v_proj",
    },
    linear_proj: "self_attn.o_proj",
    pre_mlp_layernorm: "post_attention_layernorm",
    fc1: HfFc1::Gated {
        gate: "mlp.gate_proj",
        up: "mlp.up_proj",
    },
    linear_fc2: "mlp.down_proj",
    final_layernorm: "model.norm",
    output_layer: "lm_head",
};

impl ModelFamily {
    /// The family's HF tensor names.
    pub fn hf_names(self) -> HfNames {
        match self {
            ModelFamily::Llama | ModelFamily::Mistral | ModelFamily::Qwen2 => LLAMA,
        }
    }
}
