//! The training backward: output layer, final norm, then the decoder layers in reverse
//! (MLP, then attention, each with its pre-norm and residual), then the embedding. Every
//! parameter gradient is **accumulated** (`+=`) into the caller's slices; activation
//! gradients are per-call buffers.

use super::TrainBatch;
use super::forward::{Activations, LayerActs, attention_dims, pack_qkv};
use super::params::LayerSlots;
use crate::{GptModel, TransformerConfig, TransformerLayer};
use ferrotron_nn::attention::core_attention_backward;
use ferrotron_nn::{Linear, RmsNorm};
use ferrotron_tensor::gemm::{Op, sgemm};
use ferrotron_tensor::ops::{
    RopeTable, add_bias_backward, add_inplace, embedding_backward, rms_norm_backward,
    swiglu_packed_backward,
};
use ferrotron_tensor::{Storage, Tensor};
use std::borrow::Cow;

impl GptModel {
    /// Backpropagates `acts.dlogits` (already `∂(loss_scale·loss)/∂logits`) through the whole
    /// model, accumulating into `grads` (order of [`GptModel::parameters`]).
    pub(crate) fn train_backward(
        &self,
        batch: &TrainBatch,
        acts: &Activations,
        grads: &mut [&mut [f32]],
    ) {
        let c = &self.config;
        let (h, v) = (c.hidden_size, c.vocab_size);
        let rows = batch.tokens.len();
        let slots = self.param_slots();
        // Output layer `logits = normed·Wᵀ`, W: [v, h] (the embedding table when tied).
        let (w_out, out_slot) = match &self.output_layer {
            Some(l) => (
                l.weight(),
                slots.output.expect("untied model has an output slot"),
            ),
            None => (self.embedding.weight(), slots.embedding),
        };
        let mut dnormed = vec![0f32; rows * h];
        sgemm(
            rows,
            h,
            v,
            &acts.dlogits,
            Op::N,
            &f32_weight(w_out),
            Op::N,
            &mut dnormed,
            false,
        );
        sgemm(
            v,
            h,
            rows,
            &acts.dlogits,
            Op::T,
            &acts.normed_final,
            Op::N,
            grads[out_slot],
            true,
        );
        // Final norm: the gradient of the residual stream after the last layer.
        let mut dres = vec![0f32; rows * h];
        norm_backward(
            &self.final_layernorm,
            &acts.x_final,
            &acts.rstd_final,
            &dnormed,
            &mut dres,
            grads[slots.final_norm],
        );
        let mut scratch = vec![0f32; rows * h];
        for ((layer, la), ls) in self
            .layers
            .iter()
            .zip(&acts.layers)
            .zip(&slots.layers)
            .rev()
        {
            layer_backward(
                layer,
                la,
                ls,
                c,
                self.rope(),
                acts,
                batch,
                &mut dres,
                &mut scratch,
                grads,
            );
        }
        embedding_backward(&batch.tokens, &dres, grads[slots.embedding], h);
    }
}

/// One layer's backward: `dres: [rows, h]` is the gradient of the layer output on entry and of
/// its input on return; `scratch: [rows, h]`.
#[allow(clippy::too_many_arguments)]
fn layer_backward(
    layer: &TransformerLayer,
    la: &LayerActs,
    ls: &LayerSlots,
    c: &TransformerConfig,
    rope: &RopeTable,
    acts: &Activations,
    batch: &TrainBatch,
    dres: &mut [f32],
    scratch: &mut [f32],
    grads: &mut [&mut [f32]],
) {
    let (a, g, d, f) = (
        c.num_attention_heads,
        c.num_query_groups,
        c.kv_channels,
        c.ffn_hidden_size,
    );
    let rows = acts.positions.len();
    // MLP: y = x_mid + fc2(swiglu(fc1(norm2(x_mid)))).
    let mut dact = vec![0f32; rows * f];
    linear_backward(
        &layer.mlp.linear_fc2,
        &la.act,
        dres,
        &mut dact,
        grads,
        ls.fc2_w,
        ls.fc2_b,
    );
    let mut dfc1 = vec![0f32; rows * 2 * f];
    swiglu_packed_backward(&la.fc1, &dact, &mut dfc1, f);
    drop(dact);
    let mut dnorm2 = vec![0f32; dres.len()];
    linear_backward(
        &layer.mlp.linear_fc1,
        &la.norm2,
        &dfc1,
        &mut dnorm2,
        grads,
        ls.fc1_w,
        ls.fc1_b,
    );
    drop(dfc1);
    let n2 = &layer.pre_mlp_layernorm;
    norm_backward(n2, &la.x_mid, &la.rstd2, &dnorm2, scratch, grads[ls.norm2]);
    add_inplace(dres, scratch);
    // Attention: x_mid = x + proj(attn(rope(qkv(norm1(x))))).
    let mut dctx = vec![0f32; rows * a * d];
    linear_backward(
        &layer.linear_proj,
        &la.ctx,
        dres,
        &mut dctx,
        grads,
        ls.proj_w,
        ls.proj_b,
    );
    let mut dq = vec![0f32; rows * a * d];
    let mut dk = vec![0f32; rows * g * d];
    let mut dv = vec![0f32; rows * g * d];
    let (dims, mask) = attention_dims(c, batch);
    core_attention_backward(
        &la.q, &la.k, &la.v, &la.ctx, &dctx, &la.lse, &mut dq, &mut dk, &mut dv, dims, mask,
    );
    drop(dctx);
    rope.apply_inverse(&mut dq, &acts.positions, a);
    rope.apply_inverse(&mut dk, &acts.positions, g);
    let mut dqkv = vec![0f32; rows * c.qkv_size()];
    pack_qkv(&dq, &dk, &dv, c, &mut dqkv);
    drop((dq, dk, dv));
    let mut dnorm1 = dnorm2;
    linear_backward(
        &layer.linear_qkv,
        &la.norm1,
        &dqkv,
        &mut dnorm1,
        grads,
        ls.qkv_w,
        ls.qkv_b,
    );
    let n1 = &layer.input_layernorm;
    norm_backward(n1, &la.x, &la.rstd1, &dnorm1, scratch, grads[ls.norm1]);
    add_inplace(dres, scratch);
}

/// Backward of `y[rows, n] = x[rows, k]·Wᵀ + b`: **overwrites** `dx = dy·W` and
/// **accumulates** `dW += dyᵀ·x` into `grads[w_slot]` and `db += Σ_rows dy` into
/// `grads[b_slot]`.
fn linear_backward(
    l: &Linear,
    x: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    grads: &mut [&mut [f32]],
    w_slot: usize,
    b_slot: Option<usize>,
) {
    let (n, k) = (l.out_features(), l.in_features());
    let rows = dy.len() / n;
    sgemm(
        rows,
        k,
        n,
        dy,
        Op::N,
        &f32_weight(l.weight()),
        Op::N,
        dx,
        false,
    );
    sgemm(n, k, rows, dy, Op::T, x, Op::N, grads[w_slot], true);
    if let Some(b) = b_slot {
        add_bias_backward(dy, grads[b]);
    }
}

/// RMSNorm backward: **overwrites** `dx`, **accumulates** the gain gradient.
fn norm_backward(
    norm: &RmsNorm,
    x: &[f32],
    rstd: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    dweight: &mut [f32],
) {
    rms_norm_backward(x, norm.weight(), rstd, dy, dx, dweight);
}

/// A weight as f32 (borrowed when stored in f32, widened otherwise).
fn f32_weight(t: &Tensor) -> Cow<'_, [f32]> {
    match t.storage() {
        Storage::F32(v) => Cow::Borrowed(v),
        _ => Cow::Owned(t.to_f32_vec()),
    }
}
