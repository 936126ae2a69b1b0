//! One decoder layer's parameters (Megatron-Core `TransformerLayer`): its norms (which exist
//! as the config's switches say), self-attention and the MLP.

use std::ops::Range;

use super::decl::Declarer;
use super::mla::LayerAttention;
use super::moe::LayerMlp;
use super::norm::Norm;

/// Where one decoder layer's parameters sit in the model's table. The layer computes
/// `x += proj(attn(rope(qkv(norm1(x)))))`, then `x += mlp(norm2(x))` — or, under
/// `parallel_attention_mlp`, `x += attn(norm1(x)) + mlp(norm1(x))`; under
/// `post_sublayer_norm`, `x += norm1'(attn(x))`, `x += norm2'(mlp(x))`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransformerLayer {
    /// Global index of the layer in the full model.
    pub number: usize,
    /// `[h]` (HF `input_layernorm`); absent under `post_sublayer_norm`.
    pub input_layernorm: Option<Norm>,
    /// Standard or multi-latent attention.
    pub self_attention: LayerAttention,
    /// `[h]` on attention's output (OLMo2's `post_attention_layernorm`).
    pub post_self_attn_layernorm: Option<Norm>,
    /// `[h]` (HF `post_attention_layernorm`); absent under parallel attention or
    /// `post_sublayer_norm`.
    pub pre_mlp_layernorm: Option<Norm>,
    /// Dense, or mixture of experts.
    pub mlp: LayerMlp,
    /// `[h]` on the MLP's output (OLMo2's `post_feedforward_layernorm`).
    pub post_mlp_layernorm: Option<Norm>,
    /// The layer's parameters: a contiguous run of the table.
    pub params: Range<usize>,
}

impl TransformerLayer {
    /// Declares the parameters of global layer `number`.
    pub(crate) fn declare(d: &mut Declarer<'_>, number: usize) -> TransformerLayer {
        let start = d.len();
        let c = d.c;
        let (pre, post) = (!c.post_sublayer_norm, c.post_sublayer_norm);
        let norm = |d: &mut Declarer<'_>, mg: &str, hf: Option<&str>, present: bool| {
            let hf = hf.filter(|_| present)?;
            let hf = d.hf_layer(number, hf);
            let mg = format!("decoder.layers.{number}.{mg}");
            Some(Norm::declare_hidden(d, &mg, &hf, Some(number)))
        };
        let names = d.hf;
        let input_layernorm = norm(d, "input_layernorm", names.input_layernorm, pre);
        let self_attention = LayerAttention::declare(d, number);
        let post_self_attn_layernorm = norm(
            d,
            "post_self_attn_layernorm",
            names.post_self_attn_layernorm,
            post,
        );
        let separate_mlp_norm = pre && !c.parallel_attention_mlp;
        let pre_mlp_layernorm = norm(
            d,
            "pre_mlp_layernorm",
            names.pre_mlp_layernorm,
            separate_mlp_norm,
        );
        let mlp = LayerMlp::declare(d, number);
        let post_mlp_layernorm = norm(d, "post_mlp_layernorm", names.post_mlp_layernorm, post);
        TransformerLayer {
            number,
            input_layernorm,
            self_attention,
            post_self_attn_layernorm,
            pre_mlp_layernorm,
            mlp,
            post_mlp_layernorm,
            params: start..d.len(),
        }
    }

    /// The layer's linear layers: attention's (`linear_qkv`, `linear_proj`, or MLA's), then
    /// the MLP's `linear_fc1`, `linear_fc2` (an MoE layer's shared expert's; routed experts
    /// are not linears).
    pub fn linears(&self) -> Vec<super::LinearParams> {
        let mut linears = self.self_attention.linears();
        linears.extend(self.mlp.linears());
        linears
    }

    /// Indices of the layer's parameters.
    pub fn param_indices(&self) -> Vec<usize> {
        self.params.clone().collect()
    }
}
