//! The MLP's training pass (Megatron-Core `MLP`): `linear_fc1`, the (gated) activation and the
//! row-parallel `linear_fc2`, and its backward beside it.

use super::backward::{linear_backward, trainable};
use super::forward::{LayerActs, Pass};
use super::stored::{Kept, Stored};
use super::tp_ops::{row_parallel_forward, row_parallel_output_grad};
use crate::Result;
use crate::module::TransformerLayer;
use ferrotron_tensor::Buffer;
use ferrotron_tensor::gemm_bf16::Operand;
use ferrotron_tensor::ops::{
    activation, activation_backward, add_bias_backward, glu_packed, glu_packed_backward,
};

/// The MLP over `input: [rows, h]` (all rows): returns the kept `linear_fc1` output and
/// activation output, and the row-parallel `linear_fc2`'s output `[local rows, h]`.
pub(super) fn mlp_forward(
    layer: &TransformerLayer,
    pass: &Pass<'_>,
    input: &[f32],
) -> Result<(Stored, Stored, Buffer<f32>)> {
    let c = pass.c;
    let rows = pass.positions.len();
    let f = c.ffn_hidden_size;
    let mut fc1 = Buffer::zeros(pass.device, rows * c.fc1_size());
    pass.linear(layer.mlp.linear_fc1)
        .forward(input, fc1.host_mut());
    let fc1 = Kept::new(fc1, pass.narrow);
    let mut act = Buffer::zeros(pass.device, rows * f);
    if c.gated_linear_unit {
        glu_packed(c.activation_func, fc1.values(), act.host_mut(), f);
    } else {
        activation(c.activation_func, fc1.values(), act.host_mut());
    }
    let act = Kept::new(act, pass.narrow);
    let fc2 = pass.linear(layer.mlp.linear_fc2);
    let out = row_parallel_forward(pass, &fc2, act.values())?;
    Ok((fc1.stored, act.stored, out))
}

/// The MLP's backward from `dout` (gradient of `linear_fc2`'s output, local rows) to the
/// gradient of its input `[rows, h]` (all rows, a partial sum on each tensor-parallel rank).
pub(super) fn mlp_backward(
    layer: &TransformerLayer,
    la: &LayerActs,
    mlp_in: Operand<'_>,
    pass: &Pass<'_>,
    dout: &[f32],
    grads: &mut [&mut [f32]],
) -> Result<Buffer<f32>> {
    let c = pass.c;
    let (h, f) = (c.hidden_size, c.ffn_hidden_size);
    let rows = pass.positions.len();
    let dev = pass.device;
    let dy = row_parallel_output_grad(pass.tp, dout)?;
    let mut dact = Buffer::zeros(dev, rows * f);
    let fc2 = layer.mlp.linear_fc2;
    let act = la.act.operand();
    linear_backward(pass, fc2.without_bias(), act, &dy, dact.host_mut(), grads);
    if let Some(db) = fc2.bias.and_then(|b| trainable(grads, b)) {
        add_bias_backward(dout, db);
    }
    drop((dy, act));
    let mut dfc1 = Buffer::zeros(dev, rows * c.fc1_size());
    let (fc1, func) = (la.fc1.f32(), c.activation_func);
    if c.gated_linear_unit {
        glu_packed_backward(func, &fc1, dact.host(), dfc1.host_mut(), f);
    } else {
        activation_backward(func, &fc1, dact.host(), dfc1.host_mut());
    }
    drop((dact, fc1));
    let mut dinput = Buffer::zeros(dev, rows * h);
    let fc1_params = layer.mlp.linear_fc1;
    linear_backward(
        pass,
        fc1_params,
        mlp_in,
        dfc1.host(),
        dinput.host_mut(),
        grads,
    );
    Ok(dinput)
}
