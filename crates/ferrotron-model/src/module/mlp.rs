//! The MLP's parameters (Megatron-Core `MLP`): `linear_fc1` (packing gate and up rows under
//! `gated_linear_unit`, the LLaMA SwiGLU / Gemma GeGLU), and `linear_fc2`. An MoE layer's
//! shared expert is the same module at its own width ([`super::MoeMlp`]).

use super::decl::{Declarer, Init};
use super::linear::{LinearParams, LinearSpec, Parallel, block};
use crate::families::HfFc1;

/// The parameters of one layer's MLP: `linear_fc1: [2f, h]` (gate rows then up rows; HF
/// `gate_proj`, `up_proj`) when gated, else `[f, h]` (HF `c_fc`, `dense_h_to_4h`);
/// `linear_fc2: [h, f]` (HF `down_proj`, `c_proj`, `dense_4h_to_h`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mlp {
    pub linear_fc1: LinearParams,
    pub linear_fc2: LinearParams,
}

/// Where an MLP's parameters are named and how wide it is.
pub(crate) struct MlpSpec<'a> {
    /// Global decoder layer index.
    pub layer: usize,
    /// Megatron prefix, e.g. `decoder.layers.0.mlp`.
    pub mg: String,
    /// Inner size `f`.
    pub ffn: usize,
    /// HF first projection(s), relative to the layer.
    pub fc1: HfFc1,
    /// HF output projection, relative to the layer.
    pub fc2: &'a str,
}

impl Mlp {
    /// Declares layer `layer`'s dense MLP (`ffn_hidden_size` wide, the family's HF names).
    pub(crate) fn declare(d: &mut Declarer<'_>, layer: usize) -> Mlp {
        let spec = MlpSpec {
            layer,
            mg: format!("decoder.layers.{layer}.mlp"),
            ffn: d.c.ffn_hidden_size,
            fc1: d.hf.fc1,
            fc2: d.hf.linear_fc2,
        };
        Mlp::declare_with(d, spec)
    }

    /// Declares the MLP `spec` describes (gated as the config says).
    pub(crate) fn declare_with(d: &mut Declarer<'_>, spec: MlpSpec<'_>) -> Mlp {
        let c = d.c;
        let (h, f, layer) = (c.hidden_size, spec.ffn, spec.layer);
        let gated = c.gated_linear_unit;
        let fc1_rows = if gated { 2 * f } else { f };
        let linear_fc1 = LinearParams::declare(
            d,
            LinearSpec {
                name: format!("{}.linear_fc1", spec.mg),
                layer,
                shape: [fc1_rows, h],
                parallel: Parallel::Column {
                    parts: if gated { 2 } else { 1 },
                },
                bias: c.add_mlp_bias,
                init: Init::Normal,
                hf: match spec.fc1 {
                    HfFc1::Gated { gate, up } => vec![
                        (d.hf_layer(layer, gate), block(0..f)),
                        (d.hf_layer(layer, up), block(f..2 * f)),
                    ],
                    HfFc1::Whole(fc1) => vec![(d.hf_layer(layer, fc1), block(0..fc1_rows))],
                },
            },
        );
        let linear_fc2 = LinearParams::declare(
            d,
            LinearSpec {
                name: format!("{}.linear_fc2", spec.mg),
                layer,
                shape: [h, f],
                parallel: Parallel::Row,
                bias: c.add_mlp_bias,
                init: Init::ScaledNormal,
                hf: vec![(d.hf_layer(layer, spec.fc2), block(0..h))],
            },
        );
        Mlp {
            linear_fc1,
            linear_fc2,
        }
    }
}
