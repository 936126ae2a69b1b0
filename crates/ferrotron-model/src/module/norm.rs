//! Norms and the vocabulary tables: parameters that are one HF tensor each.

use super::decl::{Declarer, Init, ParamId, ParamRole, whole};
use crate::TpSplit;
use crate::config::Normalization;

/// Where a norm's parameters sit in the model's table: RMSNorm has a gain, LayerNorm a gain
/// and a bias, OLMo's non-parametric LayerNorm neither (the kind is the config's
/// [`Normalization`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Norm {
    /// `[n]` gain (`1 + w` under `apply_layernorm_1p`).
    pub weight: Option<ParamId>,
    /// `[n]` bias (LayerNorm).
    pub bias: Option<ParamId>,
}

/// A norm to declare.
pub(crate) struct NormSpec<'a> {
    /// Megatron prefix, e.g. `decoder.layers.0.input_layernorm`.
    pub mg: &'a str,
    /// HF prefix, e.g. `model.layers.0.input_layernorm`.
    pub hf: &'a str,
    /// The decoder layer it belongs to (global index).
    pub layer: Option<usize>,
    /// Width `n`: `h`, or `a·d` / `g·d` for the q/k norms.
    pub width: usize,
    /// Replicated, or split by rows with the heads it normalizes (q/k norms).
    pub split: TpSplit,
}

impl Norm {
    /// The parameters of the config's norm kind over `spec.width` features.
    pub(crate) fn declare(d: &mut Declarer<'_>, spec: NormSpec<'_>) -> Norm {
        let (gain, bias) = match d.c.normalization {
            Normalization::RmsNorm => (true, false),
            Normalization::LayerNorm => (true, true),
            Normalization::NonParametricLayerNorm => (false, false),
        };
        let gain_init = if d.c.apply_layernorm_1p {
            Init::Zeros
        } else {
            Init::Ones
        };
        let mut param = |suffix: &str, init: Init, role: ParamRole| {
            d.push(whole(
                format!("{}.{suffix}", spec.mg),
                format!("{}.{suffix}", spec.hf),
                vec![spec.width],
                spec.split,
                init,
                role,
                spec.layer,
            ))
        };
        let weight = gain.then(|| param("weight", gain_init, ParamRole::Norm));
        let bias = bias.then(|| param("bias", Init::Zeros, ParamRole::Bias));
        Norm { weight, bias }
    }

    /// A `[h]` norm replicated over tensor-parallel ranks.
    pub(crate) fn declare_hidden(
        d: &mut Declarer<'_>,
        mg: &str,
        hf: &str,
        layer: Option<usize>,
    ) -> Norm {
        let width = d.c.hidden_size;
        Norm::declare(
            d,
            NormSpec {
                mg,
                hf,
                layer,
                width,
                split: TpSplit::Replicated,
            },
        )
    }

    /// The ids of its parameters (gain, then bias).
    pub fn param_ids(&self) -> impl Iterator<Item = ParamId> {
        self.weight.into_iter().chain(self.bias)
    }
}

/// Declares a `[v, h]` vocabulary table (Megatron `VocabParallelEmbedding` / the output
/// layer's `ColumnParallelLinear`): rows split over tensor-parallel ranks after padding.
pub(crate) fn declare_vocab_table(d: &mut Declarer<'_>, mg: &str, hf: &str) -> ParamId {
    let (v, h) = (d.c.vocab_size, d.c.hidden_size);
    let split = TpSplit::Vocab {
        padded: d.padded_vocab,
    };
    d.push(whole(
        mg.to_string(),
        hf.to_string(),
        vec![v, h],
        split,
        Init::Normal,
        ParamRole::Embedding,
        None,
    ))
}
