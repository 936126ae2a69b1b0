//! What one decoder layer's training forward keeps for its backward ([`LayerActs`]), and
//! how many bytes that is per token (the activation-memory formula's layer term).

use super::attention::AttnActs;
use super::mlp::MlpActs;
use super::norm::NormStats;
use super::stored::{Stored, element_bytes};
use crate::TransformerConfig;
use ferrotron_tensor::Buffer;

/// What one decoder layer's backward needs, all over `rows = s·b` tokens in `[s, b]` order
/// ("local rows" are this rank's residual-stream rows: all rows without sequence
/// parallelism). q and k are saved **after** rotary embedding (what core attention
/// consumed); the backward rotates their gradients back with `RopeTable::apply_inverse`.
pub(crate) struct LayerActs {
    /// Layer input (residual stream) `[local rows, h]`.
    pub x: Buffer<f32>,
    /// `input_layernorm`'s statistics over `x` (absent under post-sublayer norms).
    pub norm1: Option<NormStats>,
    /// Input of `linear_qkv` `[rows, h]`: `input_layernorm(x)` (`x` itself under
    /// post-sublayer norms), all rows (gathered under sequence parallelism). Under parallel
    /// attention also the MLP's input.
    pub attn_in: Stored,
    /// Attention's activations: q/k/v, the q/k norms' or MLA's latents, core attention's
    /// output (`None` under selective recompute).
    pub attn: AttnActs,
    /// Attention's output `[local rows, h]` before `post_self_attn_layernorm`, and that
    /// norm's statistics (post-sublayer norms).
    pub post_attn: Option<(Buffer<f32>, NormStats)>,
    /// Residual stream after attention `[local rows, h]` (empty under parallel attention).
    pub x_mid: Buffer<f32>,
    /// `pre_mlp_layernorm`'s statistics over `x_mid`.
    pub norm2: Option<NormStats>,
    /// Input of `linear_fc1` `[rows, h]`, all rows; `None` under parallel attention (the
    /// MLP reads `attn_in`).
    pub mlp_in: Option<Stored>,
    /// The MLP's activations: a dense MLP's `linear_fc1` and activation outputs, or an MoE
    /// layer's routing and experts' ([`MlpActs`]).
    pub mlp: MlpActs,
    /// The MLP's output `[local rows, h]` before `post_mlp_layernorm`, and that norm's
    /// statistics.
    pub post_mlp: Option<(Buffer<f32>, NormStats)>,
}

/// The q/k norms' inputs: `linear_qkv`'s queries `[rows, a·d]` and keys `[rows, g·d]` (f32),
/// with the statistics of each norm.
pub(crate) struct QkNormActs {
    pub q: Buffer<f32>,
    pub k: Buffer<f32>,
    pub q_stats: NormStats,
    pub k_stats: NormStats,
}

impl LayerActs {
    /// Bytes held (core attention's output included when kept).
    pub(crate) fn bytes(&self) -> u128 {
        let stored = [&self.attn_in];
        let stats = [&self.norm1, &self.norm2];
        let post = [&self.post_attn, &self.post_mlp];
        self.x.bytes()
            + self.x_mid.bytes()
            + self.mlp.bytes()
            + stored.iter().map(|t| t.bytes()).sum::<u128>()
            + self.mlp_in.as_ref().map_or(0, Stored::bytes)
            + stats
                .iter()
                .flat_map(|s| s.as_ref())
                .map(NormStats::bytes)
                .sum::<u128>()
            + post
                .iter()
                .flat_map(|p| p.as_ref())
                .map(|(o, s)| o.bytes() + s.bytes())
                .sum::<u128>()
            + self.attn.bytes()
    }

    /// Bytes [`super::forward::layer_forward`] saves per token besides the MLP's activations
    /// ([`super::mlp::MlpActs::bytes_for`]) and core attention's output: f32 `x`
    /// (`h`), `x_mid` (`h`, unless parallel attention), each norm's statistics
    /// ([`NormStats::bytes_per_row`]), post-sublayer norm inputs (`2h`) and q/k norm inputs
    /// (`(a + g)·d`), MLA's latents; in the saved dtype (bf16 when `narrow`) the linears'
    /// inputs `attn_in` and `mlp_in` (`h` each, one under parallel attention) and `q, k, v`
    /// (`(a + 2g)·d`). In u128, so no config overflows.
    pub(crate) fn bytes_per_row(c: &TransformerConfig, narrow: bool) -> u128 {
        let [h, a, g, d] = [
            c.hidden_size,
            c.num_attention_heads,
            c.num_query_groups,
            c.kv_channels,
        ]
        .map(|n| n as u128);
        let (copies, norms) = match (c.post_sublayer_norm, c.parallel_attention_mlp) {
            (true, _) => (2, 2),
            (false, true) => (1, 1),
            (false, false) => (2, 2),
        };
        let stats = norms * NormStats::bytes_per_row(c.normalization);
        let post_inputs = if c.post_sublayer_norm { 2 * 4 * h } else { 0 };
        let qk = if c.qk_layernorm {
            4 * (a + g) * d + 8
        } else {
            0
        };
        // MLA's latents: each f32 with its `1/rms`, and normed in the saved dtype.
        let latents = c.multi_latent_attention.map_or(0, |m| {
            let latent = |w: usize| (4 + element_bytes(narrow)) * w as u128 + 4;
            latent(m.kv_lora_rank) + m.q_lora_rank.map_or(0, latent)
        });
        4 * copies * h
            + stats
            + post_inputs
            + qk
            + latents
            + element_bytes(narrow) * (copies * h + (a + 2 * g) * d)
    }

    /// The layer input alone (what a recomputed group keeps), the rest freed.
    pub(crate) fn into_input(self) -> Buffer<f32> {
        self.x
    }
}
