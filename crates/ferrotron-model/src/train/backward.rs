//! The training backward: output layer, final norm, then the decoder layers in reverse
//! (MLP, then attention, each with its pre-norm and residual), then the embedding. Every
//! parameter gradient is **accumulated** (`+=`) into the caller's slices; activation
//! gradients are per-call buffers. Saved activations are freed as soon as their layer's
//! backward is done.

use super::attention::attention_backward;
use super::forward::{Activations, Pass, Saved, usize_bytes};
use super::layer_acts::LayerActs;
use super::lora::lora_backward;
use super::memory::Ledger;
use super::mlp::mlp_backward;
use super::norm::{NormLayer, NormStats};
use super::tp_ops::{adds_replicated_grads, column_input_backward};
use super::{GradReady, TrainBatch};
use crate::module::{LinearParams, Norm, ParamId, TransformerLayer};
use crate::{GptModel, OutputHead, Result};
use ferrotron_tensor::Buffer;
use ferrotron_tensor::gemm::WeightRef;
use ferrotron_tensor::gemm::{matmul_weight, weight_grad};
use ferrotron_tensor::gemm_bf16::{Operand, round_to_bf16_in_place, rounded_to_bf16};
use ferrotron_tensor::ops::{add_bias_backward, add_inplace};

/// The running state of one backward pass, shared by every layer.
pub(crate) struct Backprop<'g, 'p> {
    /// Gradient of the residual stream `[rows, h]` at the current layer boundary.
    pub dres: Buffer<f32>,
    /// Work buffer `[rows, h]`.
    pub scratch: Buffer<f32>,
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
            embedding,
            saved,
            positions,
            x_final,
            final_stats,
            normed_final,
            dlogits,
            loss_scale,
            moe_losses: _,
            global_aux,
        } = acts;
        let dres = match final_stats {
            Some(final_stats) => {
                let head = Head {
                    x_final,
                    final_stats,
                    normed_final,
                    dlogits,
                };
                self.head_backward(batch, head, grads, ledger, ready)?
            }
            None => {
                ledger.release(x_final.bytes());
                self.output_grad(batch, dout)?
            }
        };
        let pass = Pass::new(self, &positions, batch)
            .with_moe_losses(loss_scale)
            .rerun(global_aux);
        let mut st = Backprop {
            scratch: Buffer::zeros(self.device(), dres.len()),
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
            return Ok(Some(st.dres.into_host()));
        }
        self.embedding_backward(batch, embedding, &mut st)?;
        Ok(None)
    }

    /// A stage before the last: the gradient of its output `[local rows, h]`, given by the
    /// next stage.
    fn output_grad(&self, batch: &TrainBatch, dout: Option<Vec<f32>>) -> Result<Buffer<f32>> {
        let want = self.local_rows(batch)? * self.local_config().hidden_size;
        match dout {
            Some(d) if d.len() == want => Ok(Buffer::from_host(d)),
            _ => Err(crate::ModelError::Input(format!(
                "a pipeline stage before the last needs the gradient of its output \
                 ({want} values)"
            ))),
        }
    }

    /// The first stage's embedding backward from `st.dres` (the gradient of the embedding
    /// stage's output), then tells `st.ready` the embedding's parameters are final.
    fn embedding_backward(
        &self,
        batch: &TrainBatch,
        embedding: super::tp_ops::EmbeddingActs,
        st: &mut Backprop<'_, '_>,
    ) -> Result<()> {
        if let Some((e, stats)) = &embedding {
            st.ledger.release(e.bytes() + stats.bytes());
        }
        self.embed_forward_backward(&batch.tokens, embedding, st.dres.host(), st.grads)?;
        let layout = self.layout();
        let norm = layout
            .embedding_layernorm
            .iter()
            .flat_map(|n| n.param_ids());
        let first: Vec<usize> = layout
            .embedding
            .into_iter()
            .chain(norm)
            .map(|id| id.index())
            .collect();
        st.ready.ready(&first, st.grads);
        Ok(())
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
    ) -> Result<Buffer<f32>> {
        let Head {
            x_final,
            final_stats,
            normed_final,
            mut dlogits,
        } = head;
        let rows = batch.tokens.len();
        // Output layer `logits = normed·Wᵀ`, W: [v, h] (the embedding table when tied; [1, h]
        // for a score head).
        let layout = self.layout();
        let out_id = layout
            .output_weight()
            .expect("the last stage holds an output weight");
        let w_out = self.param(out_id);
        let (v, h) = (w_out.shape()[0], w_out.shape()[1]);
        let mut dnormed_all = Buffer::zeros(self.device(), rows * h);
        let w = w_out.weight_ref();
        // A bf16 output weight multiplies bf16 logit gradients in both products: rounded
        // once, in place (nothing else reads them).
        let dl = rounded_once(dlogits.host_mut(), w);
        // A score head is replicated: every tensor-parallel rank computes the whole of its
        // gradients, so the first alone contributes them and the sums over the group (the
        // input's below, the weight's in `finalize_grads`) are exactly that rank's.
        let contributes = self.config().output_head == OutputHead::LanguageModel
            || adds_replicated_grads(self.tp.as_ref());
        if contributes {
            matmul_weight(dl, w, dnormed_all.host_mut(), rows, v, h, false);
        }
        let dnormed = column_input_backward(self.tp.as_ref(), dnormed_all)?;
        if let Some(dw) = trainable(grads, out_id).filter(|_| contributes) {
            weight_grad(dl, Operand::F32(normed_final.host()), w, dw, rows, v, h);
        }
        ledger.release(dlogits.bytes() + normed_final.bytes());
        drop((dlogits, normed_final));
        // Final norm: the gradient of the residual stream after the last layer.
        let norm = layout
            .final_layernorm
            .expect("the last stage holds the final norm");
        let mut dres = Buffer::zeros(self.device(), x_final.len());
        let (x, dy, dx) = (x_final.host(), dnormed.host(), dres.host_mut());
        NormLayer::new(self, norm).backward(x, h, &final_stats, dy, dx, grads)?;
        ledger.release(x_final.bytes() + final_stats.bytes());
        let done: Vec<usize> = layout
            .output_layer
            .into_iter()
            .chain(norm.param_ids())
            .map(|id| id.index())
            .collect();
        ready.ready(&done, grads);
        Ok(dres)
    }
}

/// The last stage's saved head activations.
struct Head {
    x_final: Buffer<f32>,
    final_stats: NormStats,
    normed_final: Buffer<f32>,
    dlogits: Buffer<f32>,
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
    let h = pass.c.hidden_size;
    let Backprop {
        dres,
        scratch,
        grads,
        ledger,
        ..
    } = st;
    let (dres, scratch) = (dres.host_mut(), scratch.host_mut());
    // MLP: y = x_mid + post_mlp(fc2(act(fc1(mlp_in)))) (x + attn + mlp under parallel attention).
    let dmlp_out = post_norm_backward(pass, layer.post_mlp_layernorm, &la.post_mlp, dres, grads)?;
    let mlp_in = la.mlp_in.as_ref().unwrap_or(&la.attn_in);
    let dout = dmlp_out.as_ref().map_or(&*dres, Buffer::host);
    let dmlp_in = mlp_backward(&layer.mlp, &la.mlp, mlp_in, pass, dout, grads)?;
    drop(dmlp_out);
    let dattn_in_extra = if pass.c.parallel_attention_mlp {
        Some(dmlp_in)
    } else {
        let dmlp_in = column_input_backward(pass.tp, dmlp_in)?;
        input_norm_backward(
            pass,
            layer.pre_mlp_layernorm,
            la.x_mid.host(),
            la.norm2.as_ref(),
            dmlp_in.host(),
            dres,
            scratch,
            grads,
        )?;
        None
    };
    // Attention: x_mid = x + post_attn(proj(attn(rope(qk_norm(qkv(attn_in)))))).
    let dattn_out = post_norm_backward(
        pass,
        layer.post_self_attn_layernorm,
        &la.post_attn,
        dres,
        grads,
    )?;
    let dout = dattn_out.as_ref().map_or(&*dres, Buffer::host);
    let mut dattn_in = attention_backward(layer, la, pass, dout, grads, ledger)?;
    drop(dattn_out);
    if let Some(d) = dattn_in_extra {
        add_inplace(dattn_in.host_mut(), d.host());
    }
    let dattn_in = column_input_backward(pass.tp, dattn_in)?;
    input_norm_backward(
        pass,
        layer.input_layernorm,
        la.x.host(),
        la.norm1.as_ref(),
        dattn_in.host(),
        dres,
        scratch,
        grads,
    )?;
    debug_assert_eq!(dres.len() % h, 0);
    Ok(())
}

/// The gradient of a sublayer's output before its post-norm, from `dres` (the gradient of
/// what the sublayer added to the residual stream, local rows); `None` when it has no
/// post-norm (the gradient is `dres` itself).
fn post_norm_backward(
    pass: &Pass<'_>,
    norm: Option<Norm>,
    saved: &Option<(Buffer<f32>, NormStats)>,
    dres: &[f32],
    grads: &mut [&mut [f32]],
) -> Result<Option<Buffer<f32>>> {
    match (norm, saved) {
        (Some(n), Some((out, stats))) => {
            let mut d = Buffer::zeros(pass.device, dres.len());
            let (h, dx) = (pass.c.hidden_size, d.host_mut());
            NormLayer::new(pass.model, n).backward(out.host(), h, stats, dres, dx, grads)?;
            Ok(Some(d))
        }
        _ => Ok(None),
    }
}

/// Adds to `dres` the gradient through a sublayer's input: its pre-norm's backward over the
/// residual `x` for `dinput` (local rows), or `dinput` itself when the sublayer reads the
/// residual stream directly.
#[allow(clippy::too_many_arguments)]
fn input_norm_backward(
    pass: &Pass<'_>,
    norm: Option<Norm>,
    x: &[f32],
    stats: Option<&NormStats>,
    dinput: &[f32],
    dres: &mut [f32],
    scratch: &mut [f32],
    grads: &mut [&mut [f32]],
) -> Result<()> {
    match (norm, stats) {
        (Some(n), Some(stats)) => {
            NormLayer::new(pass.model, n).backward(
                x,
                pass.c.hidden_size,
                stats,
                dinput,
                scratch,
                grads,
            )?;
            add_inplace(dres, scratch);
        }
        _ => add_inplace(dres, dinput),
    }
    Ok(())
}

/// Backward of `y[rows, n] = x[rows, k]·Wᵀ + b` (+ its LoRA adapter's output) for the
/// linear layer `p` of the pass's model: **overwrites** `dx = dy·W` (+ the adapter's part) and
/// **accumulates** `dW += dyᵀ·x` and (when `p` has a bias) `db += Σ_rows dy` into `grads`
/// (table order) — skipped for a frozen parameter, whose gradient slice is empty — and the
/// adapter's gradients ([`lora_backward`]).
pub(super) fn linear_backward(
    pass: &Pass<'_>,
    p: LinearParams,
    x: Operand<'_>,
    dy: &[f32],
    dx: &mut [f32],
    grads: &mut [&mut [f32]],
) {
    let l = pass.linear(p);
    let (n, k) = (l.out_features(), l.in_features());
    let rows = dy.len() / n;
    let w = l.weight().weight_ref();
    // A bf16 weight's two products read `dy` rounded to bf16: rounded once, into a copy (the
    // bias and adapter gradients, and the residual stream, read it unrounded).
    let rounded = matches!(w, WeightRef::BF16(_)).then(|| rounded_to_bf16(dy));
    let dy_op = rounded
        .as_deref()
        .map_or(Operand::F32(dy), Operand::Rounded);
    matmul_weight(dy_op, w, dx, rows, n, k, false);
    if let Some(dw) = trainable(grads, p.weight) {
        weight_grad(dy_op, x, w, dw, rows, n, k);
    }
    if let Some(db) = p.bias.and_then(|b| trainable(grads, b)) {
        add_bias_backward(dy, db);
    }
    if let (Some(a), Some(adapter)) = (p.lora, l.lora()) {
        lora_backward(adapter, a, x, dy, dx, grads);
    }
}

/// The gradient slice of parameter `id`, `None` when it is frozen (an empty slice: the
/// optimizer's buffer holds no gradient for it).
pub(super) fn trainable<'g>(grads: &'g mut [&mut [f32]], id: ParamId) -> Option<&'g mut [f32]> {
    let g = &mut *grads[id.index()];
    (!g.is_empty()).then_some(g)
}

/// `dy` as the products with weight `w` read it: for a bf16 weight rounded to bf16 in place
/// (once for both products; the caller reads `dy` no more), else as it is.
fn rounded_once<'a>(dy: &'a mut [f32], w: WeightRef<'_>) -> Operand<'a> {
    match w {
        WeightRef::BF16(_) => {
            round_to_bf16_in_place(dy);
            Operand::Rounded(dy)
        }
        _ => Operand::F32(dy),
    }
}
