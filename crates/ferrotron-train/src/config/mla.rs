//! `[mla]`: multi-latent attention with Megatron-Core's flags (`--multi-latent-attention`,
//! `--q-lora-rank`, `--kv-lora-rank`, `--qk-head-dim`, `--qk-pos-emb-head-dim`,
//! `--v-head-dim` and the YaRN rope of `MLATransformerConfig`) for a DeepSeek-V2 model built
//! from the `[model]` dimensions.

use super::sections::section;
use ferrotron_model::MlaConfig;
use ferrotron_tensor::ops::{RopeScaling, YarnScaling};
use serde::{Deserialize, Serialize};

section! {
    /// `[mla]`: multi-latent attention (DeepSeek-V2; Megatron's MLA flags).
    MlaSection, "mla" {
        /// Every layer's attention is multi-latent attention; needs model.family =
        /// "deepseek_v2" and no model.load (a loaded model's checkpoint decides). Default:
        /// false. Megatron: `--multi-latent-attention`.
        multi_latent_attention: bool = false,
        /// The query latent's width; unset projects queries directly (V2-Lite). Default:
        /// unset. Megatron: `--q-lora-rank`.
        q_lora_rank: Option<usize> = None,
        /// The shared key/value latent's width. Default: 512. Megatron: `--kv-lora-rank`.
        kv_lora_rank: usize = 512,
        /// Each head's query/key dims without rope. Default: 128. Megatron: `--qk-head-dim`.
        qk_head_dim: usize = 128,
        /// Each head's rotary query/key dims (one rotary key head shared by all). Default:
        /// 64. Megatron: `--qk-pos-emb-head-dim`.
        qk_pos_emb_head_dim: usize = 64,
        /// Each head's value dims. Default: 128. Megatron: `--v-head-dim`.
        v_head_dim: usize = 128,
        /// "rope" (plain) or "yarn" (YaRN with the keys below). Default: "yarn". Megatron:
        /// `MLATransformerConfig.rope_type`.
        rope_type: String = "yarn".to_string(),
        /// YaRN's context extension factor. Default: 40. Megatron: `--rotary-scaling-factor`.
        rotary_scaling_factor: f64 = 40.0,
        /// YaRN's pretraining context. Default: 4096. Megatron:
        /// `MLATransformerConfig.original_max_position_embeddings`.
        original_max_position_embeddings: usize = 4096,
        /// YaRN's attention-factor numerator weight. Default: 1.0. Megatron: `--mscale`.
        mscale: f64 = 1.0,
        /// YaRN's attention-factor denominator weight, and the softmax scale's `mscale²`
        /// (0: none). Default: 0.0. Megatron: `--mscale-all-dim`.
        mscale_all_dim: f64 = 0.0,
        /// YaRN's fast boundary (rotations). Default: 32. Megatron: `--beta-fast`.
        beta_fast: f64 = 32.0,
        /// YaRN's slow boundary (rotations). Default: 1. Megatron: `--beta-slow`.
        beta_slow: f64 = 1.0,
    }
}

/// Multi-latent attention for a model built from `[model]`: the sizes and its rope.
#[derive(Debug, Clone, PartialEq)]
pub struct MlaSettings {
    pub config: MlaConfig,
    pub rope_scaling: RopeScaling,
}

/// Validates `[mla]` (problems pushed to `p`, each naming its key): `loaded` says the model
/// comes from `model.load`, `family` is `model.family` of a built one.
pub(super) fn mla_settings(
    s: &MlaSection,
    loaded: bool,
    family: Option<ferrotron_model::ModelFamily>,
    p: &mut Vec<String>,
) -> Option<MlaSettings> {
    if !s.multi_latent_attention {
        if *s != MlaSection::default() {
            p.push("[mla] keys need mla.multi_latent_attention = true".into());
        }
        return None;
    }
    if loaded {
        p.push(
            "mla.multi_latent_attention must be unset with model.load (the checkpoint decides)"
                .into(),
        );
        return None;
    }
    if family != Some(ferrotron_model::ModelFamily::DeepseekV2) {
        p.push("mla.multi_latent_attention needs model.family = \"deepseek_v2\"".into());
    }
    let rope_scaling = match s.rope_type.as_str() {
        "rope" => RopeScaling::None,
        "yarn" => {
            let numbers = [
                ("rotary_scaling_factor", s.rotary_scaling_factor),
                ("beta_fast", s.beta_fast),
                ("beta_slow", s.beta_slow),
            ];
            for (key, v) in numbers {
                if !(v.is_finite() && v > 0.0) {
                    p.push(format!("mla.{key} ({v}) must be positive"));
                }
            }
            if s.original_max_position_embeddings == 0 {
                p.push("mla.original_max_position_embeddings must be positive".into());
            }
            RopeScaling::Yarn(YarnScaling {
                factor: s.rotary_scaling_factor as f32,
                original_max_position_embeddings: s.original_max_position_embeddings,
                beta_fast: s.beta_fast as f32,
                beta_slow: s.beta_slow as f32,
                mscale: Some(s.mscale as f32),
                mscale_all_dim: Some(s.mscale_all_dim as f32),
                attention_factor: None,
                truncate: true,
            })
        }
        other => {
            p.push(format!(
                "mla.rope_type = \"{other}\": expected \"rope\" or \"yarn\""
            ));
            RopeScaling::None
        }
    };
    Some(MlaSettings {
        config: MlaConfig {
            q_lora_rank: s.q_lora_rank,
            kv_lora_rank: s.kv_lora_rank,
            qk_head_dim: s.qk_head_dim,
            qk_pos_emb_head_dim: s.qk_pos_emb_head_dim,
            v_head_dim: s.v_head_dim,
        },
        rope_scaling,
    })
}
