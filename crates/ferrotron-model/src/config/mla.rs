//! [`MlaConfig`]: multi-latent attention's sizes (DeepSeek-V2, Liu et al. 2024), with
//! Megatron-Core's names (`MLATransformerConfig`; `megatron/core/transformer/
//! multi_latent_attention.py`).

use super::{PositionEmbedding, TransformerConfig, field_error};
use crate::Result;

/// Multi-latent attention: queries through an optional low-rank latent, keys and values
/// through one shared `kv_lora_rank` latent, and a decoupled rotary part of the keys that one
/// head shares with all.
///
/// Per token `x: [h]` and head `i` (`a` heads):
/// - `q = linear_q_up_proj(q_layernorm(linear_q_down_proj(x)))` `[a·(qk_head_dim +
///   qk_pos_emb_head_dim)]` (or `linear_q_proj(x)` without `q_lora_rank`), split per head into
///   `q_nope` and `q_pe`;
/// - `[c | k_pe] = linear_kv_down_proj(x)` `[kv_lora_rank + qk_pos_emb_head_dim]`;
///   `[k_nope | v] = linear_kv_up_proj(kv_layernorm(c))` per head;
/// - `q_pe`, `k_pe` rotated (interleaved pairs, HF DeepSeek-V2), `k_i = [k_nope_i | k_pe]`,
///   `softmax(q_i·k_iᵀ · mscale² / √(qk_head_dim + qk_pos_emb_head_dim))·v_i`, then
///   `linear_proj` over the `a·v_head_dim` outputs.
///
/// Core attention runs with one head dim, the config's `kv_channels` =
/// [`MlaConfig::attention_head_dim`]: values (or queries and keys) are zero-padded to it,
/// which changes no score and no output (vLLM pads the same way for FlashAttention).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaConfig {
    /// `q_lora_rank`: the query latent's width; `None` projects queries directly (V2-Lite).
    pub q_lora_rank: Option<usize>,
    /// `kv_lora_rank`: the shared key/value latent's width.
    pub kv_lora_rank: usize,
    /// `qk_head_dim` (HF `qk_nope_head_dim`): each head's query/key dims without rope.
    pub qk_head_dim: usize,
    /// `qk_pos_emb_head_dim` (HF `qk_rope_head_dim`): the rotary dims, shared by all heads'
    /// keys.
    pub qk_pos_emb_head_dim: usize,
    /// `v_head_dim`: each head's value dims.
    pub v_head_dim: usize,
}

impl MlaConfig {
    /// A head's query / key width `qk_head_dim + qk_pos_emb_head_dim`.
    pub fn query_head_dim(&self) -> usize {
        self.qk_head_dim + self.qk_pos_emb_head_dim
    }

    /// The head dim core attention runs with (the config's `kv_channels`): the larger of
    /// the query and value widths.
    pub fn attention_head_dim(&self) -> usize {
        self.query_head_dim().max(self.v_head_dim)
    }

    /// Checks the sizes and what MLA needs of the rest of `c`.
    ///
    /// # Errors
    /// A [`crate::ModelError::ConfigField`] naming the field: a zero or odd size, a
    /// `kv_channels` other than [`MlaConfig::attention_head_dim`], key/value groups other than
    /// the heads, no rotary embedding, a full-width q/k norm, biases, LoRA.
    pub(crate) fn validate(&self, c: &TransformerConfig) -> Result<()> {
        let sizes = [
            ("q_lora_rank", self.q_lora_rank.unwrap_or(1)),
            ("kv_lora_rank", self.kv_lora_rank),
            ("qk_head_dim", self.qk_head_dim),
            ("qk_pos_emb_head_dim", self.qk_pos_emb_head_dim),
            ("v_head_dim", self.v_head_dim),
        ];
        if let Some((field, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return Err(field_error(field, "must be > 0"));
        }
        if !self.qk_pos_emb_head_dim.is_multiple_of(2) {
            return Err(field_error(
                "qk_pos_emb_head_dim",
                "rotary embedding needs an even head dim",
            ));
        }
        if c.kv_channels != self.attention_head_dim() {
            return Err(field_error(
                "kv_channels",
                format!(
                    "multi-latent attention runs core attention at max(qk_head_dim + \
                     qk_pos_emb_head_dim, v_head_dim) = {}, got {}",
                    self.attention_head_dim(),
                    c.kv_channels
                ),
            ));
        }
        if c.num_query_groups != c.num_attention_heads {
            return Err(field_error(
                "num_query_groups",
                "multi-latent attention has one key/value head per query head",
            ));
        }
        let unsupported = [
            (
                "position_embedding_type",
                c.position_embedding_type != PositionEmbedding::Rope,
                "multi-latent attention needs rope",
            ),
            (
                "qk_layernorm",
                c.qk_layernorm,
                "multi-latent attention normalises its latents, not q/k",
            ),
            (
                "add_qkv_bias",
                c.add_qkv_bias || c.add_proj_bias,
                "multi-latent attention projections without biases only",
            ),
            (
                "lora",
                c.lora.is_some(),
                "LoRA on multi-latent attention is not supported",
            ),
        ];
        match unsupported.iter().find(|(_, bad, _)| *bad) {
            Some((field, _, why)) => Err(field_error(field, *why)),
            None => Ok(()),
        }
    }
}
