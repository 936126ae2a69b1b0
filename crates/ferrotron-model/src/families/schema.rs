//! How each family's HF `config.json` spells the skeleton's sizes, and which
//! [`TransformerConfig`] switches the family fixes: one table per family, read when parsing
//! (`hf_config.rs`) and when writing (`hf_export.rs`), after transformers 5.23's
//! `configuration_<family>.py` files.

use crate::config::{ActivationFunc, Normalization, PositionEmbedding, field_error};
use crate::{ModelFamily, Result, TransformerConfig};

/// The switches a family fixes (its modeling code has no flag for them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Switches {
    pub normalization: Normalization,
    pub apply_layernorm_1p: bool,
    pub qk_layernorm: bool,
    pub post_sublayer_norm: bool,
    pub parallel_attention_mlp: bool,
    pub embedding_layernorm: bool,
    pub scale_embeddings: bool,
    pub gated_linear_unit: bool,
    pub position_embedding_type: PositionEmbedding,
}

impl Switches {
    /// `c`'s switches.
    pub(crate) fn of(c: &TransformerConfig) -> Switches {
        Switches {
            normalization: c.normalization,
            apply_layernorm_1p: c.apply_layernorm_1p,
            qk_layernorm: c.qk_layernorm,
            post_sublayer_norm: c.post_sublayer_norm,
            parallel_attention_mlp: c.parallel_attention_mlp,
            embedding_layernorm: c.embedding_layernorm,
            scale_embeddings: c.scale_embeddings,
            gated_linear_unit: c.gated_linear_unit,
            position_embedding_type: c.position_embedding_type,
        }
    }

    /// Writes these switches into `c`.
    pub(crate) fn apply(self, c: &mut TransformerConfig) {
        c.normalization = self.normalization;
        c.apply_layernorm_1p = self.apply_layernorm_1p;
        c.qk_layernorm = self.qk_layernorm;
        c.post_sublayer_norm = self.post_sublayer_norm;
        c.parallel_attention_mlp = self.parallel_attention_mlp;
        c.embedding_layernorm = self.embedding_layernorm;
        c.scale_embeddings = self.scale_embeddings;
        c.gated_linear_unit = self.gated_linear_unit;
        c.position_embedding_type = self.position_embedding_type;
    }

    /// Errors unless `c` has exactly these switches (naming the first that differs).
    pub(crate) fn check(self, c: &TransformerConfig) -> Result<()> {
        let have = Switches::of(c);
        let fields = [
            ("normalization", self.normalization != have.normalization),
            (
                "apply_layernorm_1p",
                self.apply_layernorm_1p != have.apply_layernorm_1p,
            ),
            ("qk_layernorm", self.qk_layernorm != have.qk_layernorm),
            (
                "post_sublayer_norm",
                self.post_sublayer_norm != have.post_sublayer_norm,
            ),
            (
                "parallel_attention_mlp",
                self.parallel_attention_mlp != have.parallel_attention_mlp,
            ),
            (
                "embedding_layernorm",
                self.embedding_layernorm != have.embedding_layernorm,
            ),
            (
                "scale_embeddings",
                self.scale_embeddings != have.scale_embeddings,
            ),
            (
                "gated_linear_unit",
                self.gated_linear_unit != have.gated_linear_unit,
            ),
            (
                "position_embedding_type",
                self.position_embedding_type != have.position_embedding_type,
            ),
        ];
        match fields.iter().find(|(_, differs)| *differs) {
            Some((field, _)) => Err(field_error(
                field,
                format!(
                    "{} fixes it (the family's skeleton: {self:?})",
                    c.family.hf_architecture()
                ),
            )),
            None => Ok(()),
        }
    }
}

/// The LLaMA skeleton: RMSNorm before each sublayer, SwiGLU, rope.
pub(crate) const LLAMA_SWITCHES: Switches = Switches {
    normalization: Normalization::RmsNorm,
    apply_layernorm_1p: false,
    qk_layernorm: false,
    post_sublayer_norm: false,
    parallel_attention_mlp: false,
    embedding_layernorm: false,
    scale_embeddings: false,
    gated_linear_unit: true,
    position_embedding_type: PositionEmbedding::Rope,
};

/// Where a family's config gives the key/value head count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KvHeads {
    /// `num_key_value_heads` (default: the query heads).
    Key,
    /// Falcon's `multi_query` flag: one group, or one per head.
    MultiQuery,
    /// Always one per head (Bloom).
    PerHead,
}

/// Which biases a family's config turns on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Biases {
    /// `attention_bias` (q/k/v and the output projection) and `mlp_bias` (LLaMA).
    AttentionAndMlp,
    /// `attention_bias` only (the MLP has none).
    Attention,
    /// q/k/v only, always (Qwen2).
    Qkv,
    /// q/k/v only, as a flag (Qwen2-MoE's `qkv_bias`, default true).
    QkvFlag(&'static str),
    /// One flag for every linear layer (StarCoder2 `use_bias`, Falcon `bias`).
    AllLinears(&'static str),
    /// Every linear layer, always (Bloom).
    Always,
    /// None.
    Never,
}

/// How a family's config spells what the skeleton needs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct ConfigSchema {
    /// Key of the layer count.
    pub num_layers: &'static str,
    /// Key of the query head count.
    pub num_heads: &'static str,
    pub kv_heads: KvHeads,
    /// Key of the MLP size (`None`: `4h`), and whether a missing key means `4h`.
    pub ffn: Option<&'static str>,
    /// Key of the norm epsilon (`None`: fixed) and its default.
    pub eps: (Option<&'static str>, f64),
    /// Key of the activation (`None`: fixed) and its default.
    pub activation: (Option<&'static str>, &'static str),
    /// `tie_word_embeddings` when absent.
    pub tie_default: bool,
    pub biases: Biases,
    /// Reads `head_dim` (else `h / a`).
    pub head_dim: bool,
    /// Reads `sliding_window`.
    pub sliding_window: bool,
    pub switches: Switches,
}

const LLAMA_SCHEMA: ConfigSchema = ConfigSchema {
    num_layers: "num_hidden_layers",
    num_heads: "num_attention_heads",
    kv_heads: KvHeads::Key,
    ffn: Some("intermediate_size"),
    eps: (Some("rms_norm_eps"), 1e-6),
    activation: (Some("hidden_act"), "silu"),
    tie_default: false,
    biases: Biases::AttentionAndMlp,
    head_dim: true,
    sliding_window: false,
    switches: LLAMA_SWITCHES,
};

const FALCON_SCHEMA: ConfigSchema = ConfigSchema {
    num_layers: "num_hidden_layers",
    num_heads: "num_attention_heads",
    kv_heads: KvHeads::MultiQuery,
    ffn: Some("ffn_hidden_size"),
    eps: (Some("layer_norm_epsilon"), 1e-5),
    activation: (Some("activation"), "gelu"),
    tie_default: true,
    biases: Biases::AllLinears("bias"),
    head_dim: false,
    sliding_window: false,
    switches: Switches {
        normalization: Normalization::LayerNorm,
        parallel_attention_mlp: true,
        gated_linear_unit: false,
        ..LLAMA_SWITCHES
    },
};

impl ModelFamily {
    /// How the family's `config.json` spells the skeleton.
    pub(crate) fn config_schema(self) -> ConfigSchema {
        match self {
            ModelFamily::Llama => LLAMA_SCHEMA,
            ModelFamily::Mistral => ConfigSchema {
                biases: Biases::Never,
                sliding_window: true,
                ..LLAMA_SCHEMA
            },
            ModelFamily::Qwen2 => ConfigSchema {
                biases: Biases::Qkv,
                ..LLAMA_SCHEMA
            },
            ModelFamily::Olmo => ConfigSchema {
                eps: (None, 1e-5),
                biases: Biases::Attention,
                head_dim: false,
                switches: Switches {
                    normalization: Normalization::NonParametricLayerNorm,
                    ..LLAMA_SWITCHES
                },
                ..LLAMA_SCHEMA
            },
            ModelFamily::Olmo2 => ConfigSchema {
                biases: Biases::Attention,
                head_dim: false,
                switches: Switches {
                    qk_layernorm: true,
                    post_sublayer_norm: true,
                    ..LLAMA_SWITCHES
                },
                ..LLAMA_SCHEMA
            },
            ModelFamily::Gemma => ConfigSchema {
                activation: (Some("hidden_activation"), "gelu_pytorch_tanh"),
                tie_default: true,
                biases: Biases::Attention,
                switches: Switches {
                    apply_layernorm_1p: true,
                    scale_embeddings: true,
                    ..LLAMA_SWITCHES
                },
                ..LLAMA_SCHEMA
            },
            ModelFamily::Phi3 => ConfigSchema {
                biases: Biases::Never,
                head_dim: false,
                sliding_window: true,
                ..LLAMA_SCHEMA
            },
            ModelFamily::Starcoder2 => ConfigSchema {
                eps: (Some("norm_epsilon"), 1e-5),
                activation: (Some("hidden_act"), "gelu_pytorch_tanh"),
                tie_default: true,
                biases: Biases::AllLinears("use_bias"),
                head_dim: false,
                sliding_window: true,
                switches: Switches {
                    normalization: Normalization::LayerNorm,
                    gated_linear_unit: false,
                    ..LLAMA_SWITCHES
                },
                ..LLAMA_SCHEMA
            },
            ModelFamily::Mixtral => ConfigSchema {
                biases: Biases::Never,
                sliding_window: true,
                ..LLAMA_SCHEMA
            },
            ModelFamily::Qwen2Moe => ConfigSchema {
                biases: Biases::QkvFlag("qkv_bias"),
                head_dim: false,
                ..LLAMA_SCHEMA
            },
            ModelFamily::Olmoe => ConfigSchema {
                eps: (Some("rms_norm_eps"), 1e-5),
                biases: Biases::Attention,
                head_dim: false,
                switches: Switches {
                    qk_layernorm: true,
                    ..LLAMA_SWITCHES
                },
                ..LLAMA_SCHEMA
            },
            ModelFamily::DeepseekV2 => ConfigSchema {
                biases: Biases::Attention,
                // `head_dim` is the rope width there; MLA's sizes come from its own keys.
                head_dim: false,
                ..LLAMA_SCHEMA
            },
            ModelFamily::Falcon => FALCON_SCHEMA,
            ModelFamily::Bloom => ConfigSchema {
                num_layers: "n_layer",
                num_heads: "n_head",
                kv_heads: KvHeads::PerHead,
                ffn: None,
                activation: (None, "gelu_pytorch_tanh"),
                biases: Biases::Always,
                switches: Switches {
                    parallel_attention_mlp: false,
                    embedding_layernorm: true,
                    position_embedding_type: PositionEmbedding::Alibi,
                    ..FALCON_SCHEMA.switches
                },
                ..FALCON_SCHEMA
            },
        }
    }
}

/// An HF activation name as Megatron's `activation_func`.
pub(crate) fn activation_from_hf(name: &str) -> Option<ActivationFunc> {
    match name {
        "silu" | "swish" => Some(ActivationFunc::Silu),
        "gelu" => Some(ActivationFunc::Gelu),
        "gelu_pytorch_tanh" | "gelu_new" => Some(ActivationFunc::GeluTanh),
        _ => None,
    }
}

/// The HF name of `f`.
pub(crate) fn activation_to_hf(f: ActivationFunc) -> &'static str {
    match f {
        ActivationFunc::Silu => "silu",
        ActivationFunc::Gelu => "gelu",
        ActivationFunc::GeluTanh => "gelu_pytorch_tanh",
    }
}

impl ModelFamily {
    /// The family whose HF `model_type` is `name` (`llama`, `olmo2`, `bloom`, …).
    pub fn from_model_type(name: &str) -> Option<ModelFamily> {
        ModelFamily::ALL
            .into_iter()
            .find(|f| f.model_type() == name)
    }
}

impl TransformerConfig {
    /// Makes this config a `family` model of the same sizes: the family's fixed switches, its
    /// default activation, and the biases it has by default (Bloom's everywhere, Qwen2's on
    /// q/k/v, none for the families whose biases are a flag). For models built from sizes
    /// (training from scratch); an HF config sets all of these itself.
    pub fn set_family(&mut self, family: ModelFamily) {
        let schema = family.config_schema();
        self.family = family;
        schema.switches.apply(self);
        self.activation_func =
            activation_from_hf(schema.activation.1).expect("every schema default is known");
        (self.add_qkv_bias, self.add_proj_bias, self.add_mlp_bias) = match schema.biases {
            Biases::Always => (true, true, true),
            Biases::Qkv | Biases::QkvFlag(_) => (true, false, false),
            _ => (false, false, false),
        };
        if let (None, eps) = schema.eps {
            self.layernorm_epsilon = eps as f32;
        }
    }
}
