//! One decoder layer's parameters (Megatron-Core `TransformerLayer` with the LLaMA spec):
//! `input_layernorm`, self-attention, `pre_mlp_layernorm`, MLP.

use std::ops::Range;

use super::attention::SelfAttention;
use super::decl::{Declarer, ParamId};
use super::mlp::Mlp;
use super::norm::declare_norm;

/// Where one decoder layer's parameters sit in the model's table. The layer computes
/// `x += proj(attn(rope(qkv(norm1(x)))))`, then `x += mlp(norm2(x))`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransformerLayer {
    /// Global index of the layer in the full model.
    pub number: usize,
    /// `[h]` (HF `input_layernorm`).
    pub input_layernorm: ParamId,
    pub self_attention: SelfAttention,
    /// `[h]` (HF `post_attention_layernorm`).
    pub pre_mlp_layernorm: ParamId,
    pub mlp: Mlp,
    /// The layer's parameters: a contiguous run of the table.
    pub params: Range<usize>,
}

impl TransformerLayer {
    /// Declares the parameters of global layer `number`.
    pub(crate) fn declare(d: &mut Declarer<'_>, number: usize) -> TransformerLayer {
        let start = d.len();
        let (mg, hf) = (
            format!("decoder.layers.{number}"),
            format!("model.layers.{number}"),
        );
        let layer = Some(number);
        let input_layernorm = declare_norm(
            d,
            &format!("{mg}.input_layernorm"),
            &format!("{hf}.input_layernorm"),
            layer,
        );
        let self_attention = SelfAttention::declare(d, number);
        let pre_mlp_layernorm = declare_norm(
            d,
            &format!("{mg}.pre_mlp_layernorm"),
            &format!("{hf}.post_attention_layernorm"),
            layer,
        );
        let mlp = Mlp::declare(d, number);
        TransformerLayer {
            number,
            input_layernorm,
            self_attention,
            pre_mlp_layernorm,
            mlp,
            params: start..d.len(),
        }
    }

    /// Indices of the layer's parameters.
    pub fn param_indices(&self) -> Vec<usize> {
        self.params.clone().collect()
    }
}
