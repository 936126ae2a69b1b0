//! The MLP's parameters (Megatron-Core `MLP`): `linear_fc1` (packing gate and up rows under
//! `gated_linear_unit`, the LLaMA SwiGLU / Gemma GeGLU), and `linear_fc2`.

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

impl Mlp {
    /// Declares layer `layer`'s MLP parameters.
    pub(crate) fn declare(d: &mut Declarer<'_>, layer: usize) -> Mlp {
        let c = d.c;
        let (h, f) = (c.hidden_size, c.ffn_hidden_size);
        let mg = format!("decoder.layers.{layer}.mlp");
        let linear_fc1 = LinearParams::declare(
            d,
            LinearSpec {
                name: format!("{mg}.linear_fc1"),
                layer,
                shape: [c.fc1_size(), h],
                parallel: Parallel::Column {
                    parts: if c.gated_linear_unit { 2 } else { 1 },
                },
                bias: c.add_mlp_bias,
                init: Init::Normal,
                hf: match d.hf.fc1 {
                    HfFc1::Gated { gate, up } => vec![
                        (d.hf_layer(layer, gate), block(0..f)),
                        (d.hf_layer(layer, up), block(f..2 * f)),
                    ],
                    HfFc1::Whole(fc1) => vec![(d.hf_layer(layer, fc1), block(0..c.fc1_size()))],
                },
            },
        );
        let linear_fc2 = LinearParams::declare(
            d,
            LinearSpec {
                name: format!("{mg}.linear_fc2"),
                layer,
                shape: [h, f],
                parallel: Parallel::Row,
                bias: c.add_mlp_bias,
                init: Init::ScaledNormal,
                hf: vec![(d.hf_layer(layer, d.hf.linear_fc2), block(0..h))],
            },
        );
        Mlp {
            linear_fc1,
            linear_fc2,
        }
    }
}
