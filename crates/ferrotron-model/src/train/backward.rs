//! The training backward: output layer, final norm, then the decoder layers in reverse
//! (MLP, then attention, each with its pre-norm and residual), then the embedding. Every
//! parameter gradient is **accumulated** (`+=`) into the caller's slices; activation
//! gradients are per-call buffers. Saved activations are freed as soon as their layer's
//! backward is done.

use super::core_attention::{CoreAttnOut, attention_dims};
use super::forward::{Activations, LayerActs, Pass, Saved, f32_bytes, usize_bytes};
use super::memory::Ledger;
use super::tp_ops::{column_input_backward, row_parallel_output_grad};
use super::{GradReady, TrainBatch};
use crate::module::{LinearParams, TransformerLayer, pack_qkv};
use crate::{GptModel, Result};
use ferrotron_nn::RmsNorm;
use ferrotron_nn::attention::core_attention_backward;
use ferrotron_tensor::gemm::{Op, matmul_weight, sgemm};
use ferrotron_tensor::ops::{
    add_bias_backward, add_inplace, rms_norm_backward, swiglu_packed_backward,
};

/// The running state of one backward pass, shared by every layer.
pub(crate) struct Backprop<'g, 'p> {
    /// Gradient of the residual stream `[rows, h]` at the current layer boundary.
    pub dres: Vec<f32>,
    /// Work buffer `[rows, h]`.
    pub scratch: Vec<f32>,
    /// Parameter gradients, order of [`GptModel::parameters`] (**accumulated**).
    pub grads: &'g mut [&'p mut [f32]],
    /// Saved-activation bytes: released as the backward frees them.
    pub ledger: &'g mut Ledger,
    /// Told as each parameter group's gradients become final.
    pub ready: &'g mut (dyn GradReady + Send),
}

impl GptModel {
    /// Backpropagates `acts.dlogits` (already `∂(loss_scale·loss)/∂logits`; on a stage
    /// before the last virtual one, `dout`) through `acts.part`, accumulating into `grads` (order of [`GptModel::parameters`]). Consumes the
    /// activations, freeing each as soon as its backward is done (recorded in `ledger`);
    /// groups saved as their input alone are re-run first ([`super::recompute`]).
    ///
    /// # Errors
    /// A failed tensor-parallel collective.
    pub(crate) fn train_backward(
        &self,
        batch: &TrainBatch,
        acts: Activations,
        grads: &mut [&mut [f32]],
        ledger: &mut Ledger,
        ready: &mut (dyn GradReady + Send),
        dout: Option<Vec<f32>>,
    ) -> Result<Option<Vec<f32>>> {
        let Activations {
            part,
            saved,
            positions,
            x_final,
            rstd_final,
            normed_final,
            dlogits,
        } = acts;
        let c = self.local_config();
        let dres = if part.post_process {
            let head = Head {
                x_final,
                rstd_final,
                normed_final,
                dlogits,
            };
            self.head_backward(batch, head, grads, ledger, ready)?
        } else {
            ledger.release(f32_bytes(&x_final));
            let want = self.local_rows(batch)? * c.hidden_size;
            match dout {
                Some(d) if d.len() == want => d,
                _ => {
                    return Err(crate::ModelError::Input(format!(
                        "a pipeline stage before the last needs the gradient of its output \
                         ({want} values)"
                    )));
                }
            }
        };
        let pass = Pass::new(self, &positions, batch);
        let mut st = Backprop {
            scratch: vec![0f32; dres.len()],
            dres,
            grads,
            ledger,
            ready,
        };
        for s in saved.into_iter().rev() {
            match s {
                Saved::Layer { index, acts } => {
                    let layer = &self.layers()[index];
                    layer_backward(layer, &acts, &pass, &mut st)?;
                    st.ledger.release(acts.bytes());
                    st.ready.ready(&layer.param_indices(), st.grads);
                }
                Saved::Input { layers, x } => {
                    self.recompute_backward(layers, x, &pass, &mut st)?;
                }
            }
        }
        st.ledger.release(usize_bytes(&positions));
        if !part.pre_process {
            return Ok(Some(st.dres));
        }
        let emb = self
            .layout()
            .embedding
            .expect("the first stage holds the embedding")
            .index();
        self.embed_train_backward(&batch.tokens, &st.dres, st.grads[emb])?;
        st.ready.ready(&[emb], st.grads);
        Ok(None)
    }

    /// The last stage's head backward (output layer, then the final norm): returns the
    /// gradient of the residual stream after the last layer.
    fn head_backward(
        &self,
        batch: &TrainBatch,
        head: Head,
        grads: &mut [&mut [f32]],
        ledger: &mut Ledger,
        ready: &mut (dyn GradReady + Send),
    ) -> Result<Vec<f32>> {
        let Head {
            x_final,
            rstd_final,
            normed_final,
            dlogits,
        } = head;
        let c = self.local_config();
        let (h, v) = (c.hidden_size, c.vocab_size);
        let rows = batch.tokens.len();
        // Output layer `logits = normed·Wᵀ`, W: [v, h] (the embedding table when tied).
        let layout = self.layout();
        let out_id = layout
            .output_weight()
            .expect("the last stage holds an output weight");
        let (w_out, out_slot) = (self.param(out_id), out_id.index());
        let mut dnormed_all = vec![0f32; rows * h];
        matmul_weight(
            &dlogits,
            w_out.weight_ref(),
            &mut dnormed_all,
            rows,
            v,
            h,
            false,
        );
        let dnormed = column_input_backward(self.tp.as_ref(), dnormed_all)?;
        sgemm(
            v,
            h,
            rows,
            &dlogits,
            Op::T,
            &normed_final,
            Op::N,
            grads[out_slot],
            true,
        );
        ledger.release(f32_bytes(&dlogits) + f32_bytes(&normed_final));
        drop((dlogits, normed_final));
        // Final norm: the gradient of the residual stream after the last layer.
        let norm_id = layout
            .final_layernorm
            .expect("the last stage holds the final norm");
        let norm_slot = norm_id.index();
        let mut dres = vec![0f32; x_final.len()];
        norm_backward(
            &self.norm(norm_id),
            &x_final,
            &rstd_final,
            &dnormed,
            &mut dres,
            grads[norm_slot],
        );
        ledger.release(f32_bytes(&x_final) + f32_bytes(&rstd_final));
        match layout.output_layer {
            Some(out) => ready.ready(&[out.index(), norm_slot], grads),
            None => ready.ready(&[norm_slot], grads),
        }
        Ok(dres)
    }
}

/// The last stage's saved head activations.
struct Head {
    x_final: Vec<f32>,
    rstd_final: Vec<f32>,
    normed_final: Vec<f32>,
    dlogits: Vec<f32>,
}

/// One layer's backward: `st.dres: [local rows, h]` is the gradient of the layer output on
/// entry and of its input on return. Under selective recompute core attention is re-run right
/// before the attention backward. Row-parallel biases take their gradient from the local rows
/// (reduced over the tensor-parallel ranks by [`GptModel::finalize_grads`] under sequence
/// parallelism).
///
/// # Errors
/// A failed tensor-parallel collective.
pub(crate) fn layer_backward(
    layer: &TransformerLayer,
    la: &LayerActs,
    pass: &Pass<'_>,
    st: &mut Backprop<'_, '_>,
) -> Result<()> {
    let (c, model) = (pass.c, pass.model);
    let (a, g, f) = (c.num_attention_heads, c.num_query_groups, c.ffn_hidden_size);
    let rows = pass.positions.len();
    let h = c.hidden_size;
    let Backprop {
        dres,
        scratch,
        grads,
        ledger,
        ..
    } = st;
    // MLP: y = x_mid + fc2(swiglu(fc1(norm2(x_mid)))).
    let dy = row_parallel_output_grad(pass.tp, dres)?;
    let mut dact = vec![0f32; rows * f];
    let fc2 = layer.mlp.linear_fc2;
    linear_backward(
        model,
        fc2.without_bias(),
        &la.act.f32(),
        &dy,
        &mut dact,
        grads,
    );
    if let Some(b) = fc2.bias {
        add_bias_backward(dres, grads[b.index()]);
    }
    drop(dy);
    let mut dfc1 = vec![0f32; rows * 2 * f];
    swiglu_packed_backward(&la.fc1.f32(), &dact, &mut dfc1, f);
    drop(dact);
    let mut dnorm2 = vec![0f32; rows * h];
    linear_backward(
        model,
        layer.mlp.linear_fc1,
        &la.norm2.f32(),
        &dfc1,
        &mut dnorm2,
        grads,
    );
    drop(dfc1);
    let dnorm2 = column_input_backward(pass.tp, dnorm2)?;
    let n2 = layer.pre_mlp_layernorm;
    let dn2 = &mut *grads[n2.index()];
    norm_backward(&model.norm(n2), &la.x_mid, &la.rstd2, &dnorm2, scratch, dn2);
    add_inplace(dres, scratch);
    // Attention: x_mid = x + proj(attn(rope(qkv(norm1(x))))).
    let dy = row_parallel_output_grad(pass.tp, dres)?;
    let [mut dq, mut dk, dv] =
        core_attention_and_proj_backward(layer, la, pass, &dy, grads, ledger);
    drop(dy);
    if let Some(b) = layer.self_attention.linear_proj.bias {
        add_bias_backward(dres, grads[b.index()]);
    }
    pass.rope.apply_inverse(&mut dq, pass.positions, a);
    pass.rope.apply_inverse(&mut dk, pass.positions, g);
    let mut dqkv = vec![0f32; rows * c.qkv_size()];
    pack_qkv(&dq, &dk, &dv, c, &mut dqkv);
    drop((dq, dk, dv));
    let mut dnorm1 = vec![0f32; rows * h];
    linear_backward(
        model,
        layer.self_attention.linear_qkv,
        &la.norm1.f32(),
        &dqkv,
        &mut dnorm1,
        grads,
    );
    let dnorm1 = column_input_backward(pass.tp, dnorm1)?;
    let n1 = layer.input_layernorm;
    let dn1 = &mut *grads[n1.index()];
    norm_backward(&model.norm(n1), &la.x, &la.rstd1, &dnorm1, scratch, dn1);
    add_inplace(dres, scratch);
    Ok(())
}

/// `linear_proj` (without its bias) and core attention backward: returns `[dq, dk, dv]`
/// (`[rows, a, d]`, `[rows, g, d]`, `[rows, g, d]`, still rotated) for `dres` the gradient of
/// the projection's output over all rows. Core
/// attention's output is recomputed when the layer did not keep it, and freed on return.
fn core_attention_and_proj_backward(
    layer: &TransformerLayer,
    la: &LayerActs,
    pass: &Pass<'_>,
    dres: &[f32],
    grads: &mut [&mut [f32]],
    ledger: &mut Ledger,
) -> [Vec<f32>; 3] {
    let c = pass.c;
    let (a, g, d) = (c.num_attention_heads, c.num_query_groups, c.kv_channels);
    let rows = pass.positions.len();
    let (q, k, v) = (la.q.f32(), la.k.f32(), la.v.f32());
    let recomputed;
    let core = match &la.core_attn {
        Some(kept) => kept,
        None => {
            // Rounded as the forward rounded it: the same values as a kept output.
            let (ctx, lse) = CoreAttnOut::compute(&q, &k, &v, pass);
            recomputed = CoreAttnOut {
                ctx: ctx.stored,
                lse,
            };
            ledger.hold(recomputed.bytes());
            &recomputed
        }
    };
    let ctx = core.ctx.f32();
    let mut dctx = vec![0f32; rows * a * d];
    linear_backward(
        pass.model,
        layer.self_attention.linear_proj.without_bias(),
        &ctx,
        dres,
        &mut dctx,
        grads,
    );
    let mut dq = vec![0f32; rows * a * d];
    let mut dk = vec![0f32; rows * g * d];
    let mut dv = vec![0f32; rows * g * d];
    let (dims, mask) = attention_dims(pass);
    core_attention_backward(
        &q, &k, &v, &ctx, &dctx, &core.lse, &mut dq, &mut dk, &mut dv, dims, mask,
    );
    if la.core_attn.is_none() {
        ledger.release(core.bytes());
    }
    [dq, dk, dv]
}

/// Backward of `y[rows, n] = x[rows, k]·Wᵀ + b` for the linear layer `p` of `model`:
/// **overwrites** `dx = dy·W` and **accumulates** `dW += dyᵀ·x` and (when `p` has a bias)
/// `db += Σ_rows dy` into `grads` (table order).
fn linear_backward(
    model: &GptModel,
    p: LinearParams,
    x: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    grads: &mut [&mut [f32]],
) {
    let l = model.linear(p);
    let (n, k) = (l.out_features(), l.in_features());
    let rows = dy.len() / n;
    matmul_weight(dy, l.weight().weight_ref(), dx, rows, n, k, false);
    sgemm(
        n,
        k,
        rows,
        dy,
        Op::T,
        x,
        Op::N,
        grads[p.weight.index()],
        true,
    );
    if let Some(b) = p.bias {
        add_bias_backward(dy, grads[b.index()]);
    }
}

/// RMSNorm backward: **overwrites** `dx`, **accumulates** the gain gradient.
fn norm_backward(
    norm: &RmsNorm<'_>,
    x: &[f32],
    rstd: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    dweight: &mut [f32],
) {
    rms_norm_backward(x, norm.weight(), rstd, dy, dx, dweight);
}
