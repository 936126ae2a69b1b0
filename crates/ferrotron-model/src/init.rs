//! A model from explicit dimensions with Megatron-Core's default random initialization, for
//! pretraining from scratch: [`TransformerConfig::llama`] and [`GptModel::init_random`].
//!
//! The rules are Megatron-Core's (`megatron/core/transformer/transformer_config.py`
//! `__post_init__`, `megatron/core/utils.py`), with `σ = init_method_std` (default 0.02):
//!
//! | parameter | init |
//! |---|---|
//! | `embedding.word_embeddings.weight` | `N(0, σ)` (`embedding_init_method` = `init_method`) |
//! | `linear_qkv.weight`, `linear_fc1.weight` | `N(0, σ)` (`init_method_normal`) |
//! | `linear_proj.weight`, `linear_fc2.weight` | `N(0, σ / √(2·num_layers))` (`output_layer_init_method` = `scaled_init_method_normal`) |
//! | `output_layer.weight` (untied only) | `N(0, σ)`: `GPTModel` passes `config.init_method`, **not** the scaled one |
//! | norm gains | 1 |
//! | biases | 0 |
//!
//! Draws are plain (untruncated) normals, as `torch.nn.init.normal_`. The random stream is
//! ours, not torch's: every parameter draws from its own ChaCha8 stream, chosen by a hash of
//! its Megatron name, so its values depend only on the seed, its name and its size (not on
//! the other parameters, the thread count or whether biases exist).

use crate::config::field_error;
use crate::config::{ActivationFunc, Normalization, OutputHead, PositionEmbedding};
use crate::module::{Init, ModelLayout, ModelPart, ParamDecl};
use crate::{GptModel, ModelFamily, Result, TransformerConfig};
use ferrotron_tensor::ops::RopeScaling;
use ferrotron_tensor::{DType, Tensor};
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

/// How [`GptModel::init_random`] draws the weights (Megatron's `--seed`, `--init-method-std`,
/// `--params-dtype`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct InitConfig {
    /// Seed of every parameter's random stream (Megatron's default `--seed` is 1234).
    pub seed: u64,
    /// `σ`, the std of the normal init (Megatron `init_method_std`, default 0.02); the output
    /// projections use `σ / √(2·num_layers)`. Must be finite and > 0.
    pub init_method_std: f32,
    /// Storage dtype of every parameter (values are drawn in f32, then rounded to nearest
    /// even; the gains 1 and biases 0 are exact in every dtype).
    pub params_dtype: DType,
}

impl Default for InitConfig {
    /// Megatron's defaults: seed 1234, `init_method_std` 0.02, f32 storage.
    fn default() -> InitConfig {
        InitConfig {
            seed: 1234,
            init_method_std: 0.02,
            params_dtype: DType::F32,
        }
    }
}

impl InitConfig {
    /// Errors when `init_method_std` is not a finite number > 0.
    pub fn validate(&self) -> Result<()> {
        if !(self.init_method_std.is_finite() && self.init_method_std > 0.0) {
            return Err(field_error(
                "init_method_std",
                format!("must be a finite number > 0, got {}", self.init_method_std),
            ));
        }
        Ok(())
    }

    /// Std of `linear_proj` and `linear_fc2`: `σ / √(2·num_layers)` (Megatron
    /// `scaled_init_method_normal` with `multiplier = 2`).
    pub fn output_layer_init_std(&self, num_layers: usize) -> f32 {
        (self.init_method_std as f64 / (2.0 * num_layers as f64).sqrt()) as f32
    }
}

impl TransformerConfig {
    /// A plain LLaMA-style model from explicit dimensions: RMSNorm (eps 1e-5, Megatron's
    /// `norm_epsilon` default), SwiGLU, RoPE with base 10000 and no scaling, no biases, full
    /// causal attention, head dim `kv_channels = hidden_size / num_attention_heads`.
    ///
    /// The output layer is **untied** from the embedding, as in LLaMA (Megatron's
    /// `--untie-embeddings-and-output-weights`; Megatron's own default ties them): set
    /// `untie_embeddings_and_output_weights = false` on the result to tie.
    ///
    /// # Errors
    /// A zero dimension, `hidden_size` not a multiple of `num_attention_heads`,
    /// `num_query_groups` not dividing `num_attention_heads`, or an odd head dim; each names
    /// the field.
    pub fn llama(
        num_layers: usize,
        hidden_size: usize,
        ffn_hidden_size: usize,
        num_attention_heads: usize,
        num_query_groups: usize,
        vocab_size: usize,
        max_position_embeddings: usize,
    ) -> Result<TransformerConfig> {
        if num_attention_heads == 0 {
            return Err(field_error("num_attention_heads", "must be > 0"));
        }
        if !hidden_size.is_multiple_of(num_attention_heads) {
            return Err(field_error(
                "hidden_size",
                format!(
                    "{hidden_size} is not a multiple of num_attention_heads {num_attention_heads}"
                ),
            ));
        }
        let config = TransformerConfig {
            family: ModelFamily::Llama,
            num_layers,
            hidden_size,
            ffn_hidden_size,
            num_attention_heads,
            num_query_groups,
            kv_channels: hidden_size / num_attention_heads,
            vocab_size,
            max_position_embeddings,
            rotary_base: 10000.0,
            rope_scaling: RopeScaling::None,
            rotary_interleaved: false,
            layernorm_epsilon: 1e-5,
            normalization: Normalization::RmsNorm,
            apply_layernorm_1p: false,
            qk_layernorm: false,
            post_sublayer_norm: false,
            parallel_attention_mlp: false,
            embedding_layernorm: false,
            scale_embeddings: false,
            gated_linear_unit: true,
            activation_func: ActivationFunc::Silu,
            position_embedding_type: PositionEmbedding::Rope,
            add_qkv_bias: false,
            add_proj_bias: false,
            add_mlp_bias: false,
            untie_embeddings_and_output_weights: true,
            sliding_window: None,
            recompute_granularity: None,
            lora: None,
            output_head: OutputHead::LanguageModel,
            moe: None,
            multi_latent_attention: None,
        };
        config.validate()?;
        Ok(config)
    }
}

impl GptModel {
    /// A freshly initialized model of `config` with Megatron-Core's default init (see the
    /// table in this module's docs): normal `N(0, σ)` for the embedding, `linear_qkv`,
    /// `linear_fc1` and an untied output layer, `N(0, σ/√(2L))` for `linear_proj` and
    /// `linear_fc2`, gains 1 and biases 0 (where `config` has biases). Deterministic in
    /// `init.seed`; weights are stored in `init.params_dtype`.
    ///
    /// # Errors
    /// An invalid `config` ([`TransformerConfig::validate`]) or `init.init_method_std`.
    pub fn init_random(config: TransformerConfig, init: InitConfig) -> Result<GptModel> {
        config.validate()?;
        init.validate()?;
        let layout = ModelLayout::new(
            &config,
            config.vocab_size,
            &ModelPart::whole(config.num_layers),
        );
        let scaled = init.output_layer_init_std(config.num_layers);
        let params = layout
            .decls()
            .iter()
            .map(|d| init_param(d, &init, scaled))
            .collect::<Result<Vec<_>>>()?;
        GptModel::new(config, params)
    }
}

/// Parameter `d` drawn as its declaration says: normals from the stream of its name (`σ`, or
/// `scaled` = `σ/√(2L)`, or Xavier's), gains 1 and zeros, all in `init.params_dtype`.
pub(crate) fn init_param(d: &ParamDecl, init: &InitConfig, scaled: f32) -> Result<Tensor> {
    let n = d.numel();
    let values = match d.init {
        Init::Normal => return normal(init, &d.name, &d.shape, init.init_method_std),
        Init::ScaledNormal => return normal(init, &d.name, &d.shape, scaled),
        Init::Ones => vec![1.0; n],
        Init::Zeros => vec![0.0; n],
        Init::XavierNormal => {
            let std = (2.0 / (d.shape[0] + d.shape[1]) as f64).sqrt() as f32;
            return normal(init, &d.name, &d.shape, std);
        }
    };
    Ok(Tensor::from_f32(&d.shape, values)?.to_dtype(init.params_dtype))
}

/// A `shape` tensor of `N(0, std)` draws from the stream of `name`, stored in
/// `init.params_dtype`.
fn normal(init: &InitConfig, name: &str, shape: &[usize], std: f32) -> Result<Tensor> {
    let mut values = vec![0f32; shape.iter().product()];
    fill_normal(&mut values, init.seed, name_stream(name), std);
    Ok(Tensor::from_f32(shape, values)?.to_dtype(init.params_dtype))
}

/// Normals per parallel chunk (even, so every chunk starts on a Box-Muller pair).
const CHUNK: usize = 1 << 16;

/// Fills `out` with `N(0, std)` draws: Box-Muller on pairs of 53-bit uniforms from ChaCha8
/// (`seed`, `stream`). Each pair consumes 4 words of the stream, so chunk `k` starts at word
/// `4·k·CHUNK/2` and chunks are generated in parallel with results independent of the thread
/// count. An odd tail drops the pair's second normal.
fn fill_normal(out: &mut [f32], seed: u64, stream: u64, std: f32) {
    out.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(k, chunk)| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            rng.set_stream(stream);
            rng.set_word_pos((k * CHUNK * 2) as u128);
            for pair in chunk.chunks_mut(2) {
                let (z0, z1) = box_muller(&mut rng);
                pair[0] = (z0 * std as f64) as f32;
                if let Some(second) = pair.get_mut(1) {
                    *second = (z1 * std as f64) as f32;
                }
            }
        });
}

/// Two independent standard normals from two uniforms: with `u1 ∈ (0, 1]`, `u2 ∈ [0, 1)`,
/// `r = √(-2 ln u1)`, `(r cos 2πu2, r sin 2πu2)`.
fn box_muller(rng: &mut ChaCha8Rng) -> (f64, f64) {
    const SCALE: f64 = 1.0 / (1u64 << 53) as f64;
    let u1 = 1.0 - (rng.next_u64() >> 11) as f64 * SCALE;
    let u2 = (rng.next_u64() >> 11) as f64 * SCALE;
    let r = (-2.0 * u1.ln()).sqrt();
    let (sin, cos) = (std::f64::consts::TAU * u2).sin_cos();
    (r * cos, r * sin)
}

/// The stream of a parameter: 64-bit FNV-1a of its Megatron name.
fn name_stream(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_continue_one_stream() {
        // The chunked fill equals one sequential pass over the stream.
        let n = CHUNK + 7;
        let mut par = vec![0f32; n];
        fill_normal(&mut par, 7, 3, 1.0);
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        rng.set_stream(3);
        let seq: Vec<f32> = (0..n.div_ceil(2))
            .flat_map(|_| {
                let (a, b) = box_muller(&mut rng);
                [a as f32, b as f32]
            })
            .take(n)
            .collect();
        assert_eq!(par, seq);
    }

    #[test]
    fn streams_differ_by_name() {
        assert_ne!(
            name_stream("decoder.layers.0.mlp.linear_fc1.weight"),
            name_stream("decoder.layers.1.mlp.linear_fc1.weight")
        );
        // FNV-1a reference value of the empty string and of "a".
        assert_eq!(name_stream(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(name_stream("a"), 0xaf63_dc4c_8601_ec8c);
    }
}
