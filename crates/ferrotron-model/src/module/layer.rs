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
        let mg = format!("decoder.layers.{number}");
        let layer = Some(number);
        let hf = d.hf_layer(number, d.hf.input_layernorm);
        let input_layernorm = declare_norm(d, &format!("{mg}.input_layernorm"), &hf, layer);
        let self_attention = SelfAttention::declare(d, number);
        let hf = d.hf_layer(number, d.hf.pre_mlp_layernorm);
        let pre_mlp_layernorm = declare_norm(d, &format!("{mg}.pre_mlp_layernorm"), &hf, layer);
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
