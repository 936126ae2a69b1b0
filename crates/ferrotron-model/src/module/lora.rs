//! The parameters of a LoRA adapter on a linear layer (NeMo's `ParallelLinearAdapter`,
//! `nemo/collections/llm/peft/lora.py`): `linear_in: [r, in]` and `linear_out: [out, r]`,
//! split over tensor-parallel ranks the way their base layer is.

use super::decl::{Declarer, Init, ParamDecl, ParamId, ParamRole};
use super::linear::Parallel;
use crate::TpSplit;

/// Where a linear layer's adapter sits in the model's table. The layer computes
/// `y = x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ` with `A = linear_in`, `B = linear_out` and
/// `s = alpha / rank`.
///
/// Tensor parallelism follows the base layer: under a column-parallel layer `A` is
/// replicated and `B`'s rows split with the layer's output rows; under a row-parallel layer
/// `A`'s columns split with the layer's input and `B` is replicated, each rank adding its
/// partial `s·(x_r·A_rᵀ)·Bᵀ` to its partial output before the reduction. Either way the
/// replicated matrix's gradient is a sum of the ranks' partial products
/// ([`GptModel::finalize_grads`](crate::GptModel::finalize_grads) all-reduces it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoraParams {
    /// `A: [r, in]`, Xavier-normal init (NeMo's default).
    pub linear_in: ParamId,
    /// `B: [out, r]`, zero init, so a new adapter leaves the model's outputs unchanged.
    pub linear_out: ParamId,
}

impl LoraParams {
    /// Declares the adapter of the linear layer `module` (Megatron prefix) of shape
    /// `[out, inp]` in global layer `layer`, when the config's LoRA targets it.
    pub(crate) fn declare(
        d: &mut Declarer<'_>,
        module: &str,
        layer: usize,
        [out, inp]: [usize; 2],
        parallel: Parallel,
    ) -> Option<LoraParams> {
        let lora = d.c.lora.as_ref().filter(|l| l.matches(module))?;
        let r = lora.rank;
        let (in_split, out_split) = match parallel {
            Parallel::Column { parts } => (TpSplit::Replicated, TpSplit::Rows { parts }),
            Parallel::Row => (TpSplit::Columns, TpSplit::Replicated),
            Parallel::Replicated => (TpSplit::Replicated, TpSplit::Replicated),
        };
        let mut adapter = |name: &str, shape: Vec<usize>, split, init| {
            d.push(ParamDecl {
                name: format!("{module}.adapter.{name}.weight"),
                shape,
                split,
                init,
                role: ParamRole::Adapter,
                layer: Some(layer),
                // No HF tensors: an adapter is exported as a PEFT directory or merged into
                // its base weight (`crate::lora`).
                hf: Vec::new(),
            })
        };
        Some(LoraParams {
            linear_in: adapter("linear_in", vec![r, inp], in_split, Init::XavierNormal),
            linear_out: adapter("linear_out", vec![out, r], out_split, Init::Zeros),
        })
    }
}
