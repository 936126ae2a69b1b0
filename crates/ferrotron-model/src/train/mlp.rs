//! The MLP's training pass (Megatron-Core `MLP`): `linear_fc1`, the (gated) activation and the
//! row-parallel `linear_fc2`, and its backward beside it; an MoE layer's MLP dispatches to
//! [`super::moe`], whose shared expert is this MLP at its own width.

use super::backward::{linear_backward, trainable};
use super::forward::Pass;
use super::moe::{MoeActs, moe_backward, moe_forward};
use super::stored::{Kept, Stored};
use super::tp_ops::{row_parallel_forward, row_parallel_output_grad};
use crate::module::{LayerMlp, Mlp};
use crate::{Result, TransformerConfig};
use ferrotron_tensor::Buffer;
use ferrotron_tensor::ops::{
    activation, activation_backward, add_bias_backward, glu_packed, glu_packed_backward,
};

/// What an MLP's backward needs.
pub(crate) enum MlpActs {
    Dense(DenseActs),
    Moe(Box<MoeActs>),
}

/// A dense MLP's kept activations over `rows` tokens (width `f`).
pub(crate) struct DenseActs {
    /// `linear_fc1` output `[rows, 2f]` (rows `[gate | up]`) gated, `[rows, f]` otherwise.
    pub fc1: Stored,
    /// The activation's output `[rows, f]` (input of `linear_fc2`).
    pub act: Stored,
}

impl MlpActs {
    /// Bytes held.
    pub(crate) fn bytes(&self) -> u128 {
        match self {
            MlpActs::Dense(d) => d.bytes(),
            MlpActs::Moe(m) => m.bytes(),
        }
    }
}

impl MlpActs {
    /// Bytes the MLP of global layer `layer` saves over `rows` tokens of a training pass of
    /// a full model `c` (activations in bf16 when `narrow`): a dense MLP's `fc1` and `act`, or
    /// an MoE layer's ([`super::moe::moe_acts_bytes`]).
    ///
    /// # Errors
    /// An MoE layer whose saved rows depend on the data (token dropping).
    pub(crate) fn bytes_for(
        c: &TransformerConfig,
        layer: usize,
        rows: u128,
        narrow: bool,
    ) -> Result<u128> {
        if c.is_moe_layer(layer) {
            return super::moe::moe_acts_bytes(c, rows, narrow);
        }
        Ok(DenseActs::bytes_for(
            c.fc1_size(),
            c.ffn_hidden_size,
            rows,
            narrow,
        ))
    }
}

impl DenseActs {
    pub(crate) fn bytes(&self) -> u128 {
        self.fc1.bytes() + self.act.bytes()
    }

    /// Bytes of a dense MLP's saved `fc1` (`fc1` wide) and `act` (`f` wide) over `rows`
    /// tokens.
    pub(crate) fn bytes_for(fc1: usize, f: usize, rows: u128, narrow: bool) -> u128 {
        rows * super::stored::element_bytes(narrow) * (fc1 + f) as u128
    }
}

/// The layer's MLP over `input: [rows, h]` (all rows): its kept activations and output
/// `[local rows, h]` (row-parallel: reduced over tensor-parallel ranks).
pub(super) fn mlp_forward(
    mlp: &LayerMlp,
    pass: &Pass<'_>,
    input: &[f32],
) -> Result<(MlpActs, Buffer<f32>)> {
    match mlp {
        LayerMlp::Dense(m) => {
            let (acts, out) = dense_forward(m, pass.c.ffn_hidden_size, pass, input)?;
            Ok((MlpActs::Dense(acts), out))
        }
        LayerMlp::Moe(m) => {
            let (acts, out) = moe_forward(m, pass, input)?;
            Ok((MlpActs::Moe(Box::new(acts)), out))
        }
    }
}

/// The MLP's backward from `dout` (gradient of its output, local rows) to the gradient of its
/// input `mlp_in: [rows, h]` (all rows, a partial sum on each tensor-parallel rank).
pub(super) fn mlp_backward(
    mlp: &LayerMlp,
    acts: &MlpActs,
    mlp_in: &Stored,
    pass: &Pass<'_>,
    dout: &[f32],
    grads: &mut [&mut [f32]],
) -> Result<Buffer<f32>> {
    match (mlp, acts) {
        (LayerMlp::Dense(m), MlpActs::Dense(a)) => {
            dense_backward(m, pass.c.ffn_hidden_size, a, mlp_in, pass, dout, grads)
        }
        (LayerMlp::Moe(m), MlpActs::Moe(a)) => moe_backward(m, a, mlp_in, pass, dout, grads),
        _ => unreachable!("a layer's activations come from its own MLP's forward"),
    }
}

/// The dense MLP `mlp` of inner width `f` over `input: [rows, h]` (all rows): the kept
/// `linear_fc1` output and activation output, and the row-parallel `linear_fc2`'s output
/// `[local rows, h]`.
pub(super) fn dense_forward(
    mlp: &Mlp,
    f: usize,
    pass: &Pass<'_>,
    input: &[f32],
) -> Result<(DenseActs, Buffer<f32>)> {
    let c = pass.c;
    let rows = pass.positions.len();
    let fc1_size = if c.gated_linear_unit { 2 * f } else { f };
    let mut fc1 = Buffer::zeros(pass.device, rows * fc1_size);
    pass.linear(mlp.linear_fc1).forward(input, fc1.host_mut());
    let fc1 = Kept::new(fc1, pass.narrow);
    let mut act = Buffer::zeros(pass.device, rows * f);
    if c.gated_linear_unit {
        glu_packed(c.activation_func, fc1.values(), act.host_mut(), f);
    } else {
        activation(c.activation_func, fc1.values(), act.host_mut());
    }
    let act = Kept::new(act, pass.narrow);
    let fc2 = pass.linear(mlp.linear_fc2);
    let out = row_parallel_forward(pass, &fc2, act.values())?;
    let acts = DenseActs {
        fc1: fc1.stored,
        act: act.stored,
    };
    Ok((acts, out))
}

/// [`dense_forward`]'s backward from `dout` (gradient of `linear_fc2`'s output, local rows)
/// to the gradient of its input `mlp_in: [rows, h]` (all rows, a partial sum on each
/// tensor-parallel rank).
pub(super) fn dense_backward(
    mlp: &Mlp,
    f: usize,
    acts: &DenseActs,
    mlp_in: &Stored,
    pass: &Pass<'_>,
    dout: &[f32],
    grads: &mut [&mut [f32]],
) -> Result<Buffer<f32>> {
    let c = pass.c;
    let h = c.hidden_size;
    let rows = pass.positions.len();
    let dev = pass.device;
    let dy = row_parallel_output_grad(pass.tp, dout)?;
    let mut dact = Buffer::zeros(dev, rows * f);
    let fc2 = mlp.linear_fc2;
    let act = acts.act.operand();
    linear_backward(pass, fc2.without_bias(), act, &dy, dact.host_mut(), grads);
    if let Some(db) = fc2.bias.and_then(|b| trainable(grads, b)) {
        add_bias_backward(dout, db);
    }
    drop((dy, act));
    let fc1_size = if c.gated_linear_unit { 2 * f } else { f };
    let mut dfc1 = Buffer::zeros(dev, rows * fc1_size);
    let (fc1, func) = (acts.fc1.f32(), c.activation_func);
    if c.gated_linear_unit {
        glu_packed_backward(func, &fc1, dact.host(), dfc1.host_mut(), f);
    } else {
        activation_backward(func, &fc1, dact.host(), dfc1.host_mut());
    }
    drop((dact, fc1));
    let mut dinput = Buffer::zeros(dev, rows * h);
    linear_backward(
        pass,
        mlp.linear_fc1,
        mlp_in.operand(),
        dfc1.host(),
        dinput.host_mut(),
        grads,
    );
    Ok(dinput)
}
