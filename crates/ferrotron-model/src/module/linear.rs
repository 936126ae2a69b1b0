//! The parameters of a linear layer (Megatron `ColumnParallelLinear` / `RowParallelLinear`):
//! a `[out, in]` weight and an optional `[out]` bias, declared together with their
//! tensor-parallel splits and HF tensors.

use std::ops::Range;

use super::decl::{Declarer, HfPart, Init, ParamDecl, ParamId, ParamRole};
use super::lora::LoraParams;
use crate::TpSplit;

/// Where a linear layer's parameters sit in the model's table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearParams {
    /// `[out, in]`.
    pub weight: ParamId,
    /// `[out]`, when the layer has a bias.
    pub bias: Option<ParamId>,
    /// The layer's LoRA adapter, when the config's LoRA targets it.
    pub lora: Option<LoraParams>,
}

/// How tensor parallelism splits a linear layer (Megatron-Core `tensor_parallel/layers.py`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Parallel {
    /// `ColumnParallelLinear`: output rows split, in `parts` packed blocks split each (2 for
    /// `linear_fc1`'s gate and up); the bias splits the same way.
    Column { parts: usize },
    /// `RowParallelLinear`: input columns split; the bias is replicated and added after the
    /// reduction.
    Row,
    /// Megatron's `duplicated` linear: every rank holds all of it (multi-latent attention's
    /// down projections).
    Replicated,
}

/// A linear layer to declare.
pub(crate) struct LinearSpec {
    /// Megatron prefix, e.g. `decoder.layers.0.self_attention.linear_qkv`.
    pub name: String,
    /// Global decoder layer index.
    pub layer: usize,
    /// Full `[out, in]`.
    pub shape: [usize; 2],
    pub parallel: Parallel,
    pub bias: bool,
    pub init: Init,
    /// HF projections making up the rows: (HF prefix, row ranges of this layer's output).
    pub hf: Vec<(String, Vec<Range<usize>>)>,
}

impl LinearParams {
    /// The weight alone: a row-parallel layer adds (and backpropagates) its bias after the
    /// tensor-parallel reduction, outside the matmul.
    pub fn without_bias(self) -> LinearParams {
        LinearParams { bias: None, ..self }
    }

    /// Declares `spec`'s weight, then its bias, then its LoRA adapter (when targeted).
    pub(crate) fn declare(d: &mut Declarer<'_>, spec: LinearSpec) -> LinearParams {
        let (weight_split, bias_split) = match spec.parallel {
            Parallel::Column { parts } => (TpSplit::Rows { parts }, TpSplit::Rows { parts }),
            Parallel::Row => (TpSplit::Columns, TpSplit::Replicated),
            Parallel::Replicated => (TpSplit::Replicated, TpSplit::Replicated),
        };
        let make = |suffix: &str, shape: Vec<usize>, split, init, role| ParamDecl {
            name: format!("{}.{suffix}", spec.name),
            hf: spec
                .hf
                .iter()
                .map(|(prefix, rows)| {
                    let mut hf_shape = vec![rows.iter().map(Range::len).sum()];
                    hf_shape.extend_from_slice(&shape[1..]);
                    HfPart {
                        name: format!("{prefix}.{suffix}"),
                        shape: hf_shape,
                        rows: rows.clone(),
                    }
                })
                .collect(),
            shape,
            split,
            init,
            role,
            layer: Some(spec.layer),
        };
        let [out, inp] = spec.shape;
        let weight = d.push(make(
            "weight",
            vec![out, inp],
            weight_split,
            spec.init,
            ParamRole::Weight,
        ));
        let bias = spec.bias.then(|| {
            d.push(make(
                "bias",
                vec![out],
                bias_split,
                Init::Zeros,
                ParamRole::Bias,
            ))
        });
        let lora = LoraParams::declare(d, &spec.name, spec.layer, spec.shape, spec.parallel);
        LinearParams { weight, bias, lora }
    }
}

/// One row range as a list.
pub(crate) fn block(rows: Range<usize>) -> Vec<Range<usize>> {
    std::iter::once(rows).collect()
}
