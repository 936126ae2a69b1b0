//! An MoE layer's parameters (Megatron-Core `MoELayer`, `moe/moe_layer.py`): the router,
//! every routed expert's `linear_fc1` / `linear_fc2` stacked into one parameter each (the
//! grouped GEMM's operands), and the optional shared expert with its gate.

use std::ops::Range;

use super::decl::{Declarer, HfPart, Init, ParamDecl, ParamId, ParamRole, whole};
use super::mlp::{Mlp, MlpSpec};
use crate::TpSplit;
use crate::families::{HfFc1, HfMoe};

/// Where an MoE layer's parameters sit in the model's table (`E` experts of width `f_e`,
/// `moe_ffn_hidden_size`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeMlp {
    /// `[E, h]` `mlp.router.weight` (HF `mlp.gate`, Mixtral's `block_sparse_moe.gate`),
    /// replicated over tensor-parallel ranks.
    pub router: ParamId,
    /// `[E·2f_e, h]` `mlp.experts.linear_fc1.weight` (`E` the experts held: an
    /// expert-parallel rank declares its `E/ep`): expert `e`'s gate rows then up rows at
    /// rows `e·2f_e ..` (Megatron's `linear_fc1.weight{e}` stacked; HF `experts.{e}.gate_proj`
    /// and `up_proj`, Mixtral's `w1` and `w3`). Tensor parallelism splits every expert's gate
    /// and up blocks (`2E` parts), as Megatron's expert tensor parallelism does, or holds
    /// the stack whole ([`super::ExpertTensorParallel`]).
    pub experts_fc1: ParamId,
    /// `[E·h, f_e]` `mlp.experts.linear_fc2.weight`: expert `e`'s rows `e·h ..` (HF
    /// `experts.{e}.down_proj`, Mixtral's `w2`); columns split over tensor-parallel ranks.
    pub experts_fc2: ParamId,
    /// The shared expert (`mlp.shared_experts`; HF Qwen2-MoE's `mlp.shared_expert`), a dense
    /// MLP of width `moe_shared_expert_intermediate_size`.
    pub shared_experts: Option<Mlp>,
    /// `[1, h]` `mlp.shared_experts.gate_weight` (HF `mlp.shared_expert_gate`), replicated.
    pub shared_expert_gate: Option<ParamId>,
    /// `[E]` `mlp.router.expert_bias` (Megatron's buffer, aux-loss-free routing), replicated:
    /// a [`ParamRole::Buffer`] the trainer updates.
    pub expert_bias: Option<ParamId>,
}

/// A decoder layer's MLP: dense, or mixture of experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerMlp {
    Dense(Mlp),
    Moe(MoeMlp),
}

impl LayerMlp {
    /// Declares layer `layer`'s MLP: an MoE layer where the config's `moe` says, else dense.
    pub(crate) fn declare(d: &mut Declarer<'_>, layer: usize) -> LayerMlp {
        match (d.c.is_moe_layer(layer), d.hf.moe) {
            (true, Some(names)) => LayerMlp::Moe(MoeMlp::declare(d, layer, names)),
            // `HfNames::check_expresses` rejects MoE layers in a family without expert names.
            _ => LayerMlp::Dense(Mlp::declare(d, layer)),
        }
    }

    /// The dense MLP's linears, or the shared expert's.
    pub fn linears(&self) -> Vec<super::LinearParams> {
        let mlp = match self {
            LayerMlp::Dense(m) => Some(m),
            LayerMlp::Moe(m) => m.shared_experts.as_ref(),
        };
        mlp.map(|m| vec![m.linear_fc1, m.linear_fc2])
            .unwrap_or_default()
    }
}

impl MoeMlp {
    fn declare(d: &mut Declarer<'_>, layer: usize, names: HfMoe) -> MoeMlp {
        let c = d.c;
        let moe = c.moe.as_ref().expect("an MoE layer has an MoE config");
        let (h, f) = (c.hidden_size, moe.moe_ffn_hidden_size);
        // An expert-parallel rank declares its own experts only (same names, fewer rows).
        let held = d
            .experts
            .map_or(0..moe.num_experts(), |s| s.experts(moe.num_experts()));
        let e = held.len();
        let mg = format!("decoder.layers.{layer}.mlp");
        let router = d.push(whole(
            format!("{mg}.router.weight"),
            format!("{}.weight", d.hf_layer(layer, names.router)),
            vec![moe.num_experts(), h],
            TpSplit::Replicated,
            Init::Normal,
            ParamRole::Weight,
            Some(layer),
        ));
        let expert = |d: &Declarer<'_>, e: usize, proj: &str, rows: Range<usize>, cols| HfPart {
            name: format!("{}.{e}.{proj}.weight", d.hf_layer(layer, names.experts)),
            shape: vec![rows.len(), cols],
            rows: vec![rows],
        };
        let [gate, up] = names.expert_fc1;
        let fc1_parts = held
            .clone()
            .enumerate()
            .flat_map(|(i, global)| {
                let at = i * 2 * f;
                [
                    expert(d, global, gate, at..at + f, h),
                    expert(d, global, up, at + f..at + 2 * f, h),
                ]
            })
            .collect();
        // Tensor parallelism splits every expert's gate and up blocks and its down columns,
        // or (expert_tensor_parallel_size 1) none of them.
        let expert_tp = d.expert_tp;
        let split = |s: TpSplit| match expert_tp {
            super::ExpertTensorParallel::Split => s,
            super::ExpertTensorParallel::Whole => TpSplit::Replicated,
        };
        let experts_fc1 = d.push(ParamDecl {
            name: format!("{mg}.experts.linear_fc1.weight"),
            shape: vec![e * 2 * f, h],
            split: split(TpSplit::Rows { parts: 2 * e }),
            init: Init::Normal,
            role: ParamRole::Weight,
            layer: Some(layer),
            hf: fc1_parts,
        });
        let fc2_parts = held
            .enumerate()
            .map(|(i, global)| expert(d, global, names.expert_fc2, i * h..(i + 1) * h, f))
            .collect();
        let experts_fc2 = d.push(ParamDecl {
            name: format!("{mg}.experts.linear_fc2.weight"),
            shape: vec![e * h, f],
            split: split(TpSplit::Columns),
            init: Init::ScaledNormal,
            role: ParamRole::Weight,
            layer: Some(layer),
            hf: fc2_parts,
        });
        let shared_experts = names
            .shared_expert
            .zip(moe.shared_expert_intermediate_size)
            .map(|([gate, up, down], ffn)| {
                let spec = MlpSpec {
                    layer,
                    mg: format!("{mg}.shared_experts"),
                    ffn,
                    fc1: HfFc1::Gated { gate, up },
                    fc2: down,
                };
                Mlp::declare_with(d, spec)
            });
        let shared_expert_gate = names
            .shared_expert_gate
            .filter(|_| moe.shared_expert_gate)
            .map(|hf| {
                d.push(whole(
                    format!("{mg}.shared_experts.gate_weight"),
                    format!("{}.weight", d.hf_layer(layer, hf)),
                    vec![1, h],
                    TpSplit::Replicated,
                    Init::Normal,
                    ParamRole::Weight,
                    Some(layer),
                ))
            });
        let expert_bias = moe.expert_bias_update_rate.map(|_| {
            d.push(ParamDecl {
                name: format!("{mg}.router.expert_bias"),
                shape: vec![moe.num_experts()],
                split: TpSplit::Replicated,
                init: Init::Zeros,
                role: ParamRole::Buffer,
                layer: Some(layer),
                // No HF family has it: their configs route by softmax, and the export of a
                // sigmoid router is refused.
                hf: Vec::new(),
            })
        });
        MoeMlp {
            router,
            experts_fc1,
            experts_fc2,
            shared_experts,
            shared_expert_gate,
            expert_bias,
        }
    }
}
