//! Where a training pass talks to the other tensor-parallel ranks (Megatron-Core's
//! `ColumnParallelLinear` / `RowParallelLinear` / `VocabParallelEmbedding` forward and
//! backward, `mappings.py`), each a no-op on a full model. "Local rows" are the rank's
//! residual-stream rows (all rows without sequence parallelism).

use super::forward::Pass;
use super::norm::{NormLayer, NormStats};
use crate::{GptModel, Result, TpInfo};
use ferrotron_nn::Linear;
use ferrotron_nn::tensor_parallel::{
    copy_to_tensor_model_parallel_region_backward, gather_from_sequence_parallel_region,
    gather_from_sequence_parallel_region_backward, reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region_backward, vocab_parallel_embedding_backward,
    vocab_parallel_embedding_forward,
};
use ferrotron_tensor::Buffer;
use ferrotron_tensor::ops::{add_bias, embedding_backward};
use std::borrow::Cow;

fn sequence_parallel(tp: Option<&TpInfo>) -> Option<&TpInfo> {
    tp.filter(|t| t.group.sequence_parallel())
}

/// The input of a column-parallel linear from the local rows: all-gathered along `s` under
/// sequence parallelism (`gather_from_sequence_parallel_region`), as is otherwise.
pub(crate) fn column_input(tp: Option<&TpInfo>, local: Buffer<f32>) -> Result<Buffer<f32>> {
    match sequence_parallel(tp) {
        Some(t) => Ok(Buffer::from_host(gather_from_sequence_parallel_region(
            &t.group,
            local.host(),
        )?)),
        None => Ok(local),
    }
}

/// Backward of [`column_input`]: the input gradient over all rows (a partial sum on each
/// rank) → the local rows' gradient: reduce-scatter along `s`, or all-reduce
/// (`copy_to_tensor_model_parallel_region`).
pub(crate) fn column_input_backward(
    tp: Option<&TpInfo>,
    mut d: Buffer<f32>,
) -> Result<Buffer<f32>> {
    match tp {
        Some(t) if t.group.sequence_parallel() => Ok(Buffer::from_host(
            gather_from_sequence_parallel_region_backward(&t.group, d.into_host())?,
        )),
        Some(t) => {
            copy_to_tensor_model_parallel_region_backward(&t.group, d.host_mut())?;
            Ok(d)
        }
        None => Ok(d),
    }
}

/// A row-parallel linear's output for the local rows: `input·Wᵀ` summed over the ranks
/// (all-reduce, or reduce-scatter along `s`), then the bias.
pub(crate) fn row_parallel_forward(
    pass: &Pass<'_>,
    l: &Linear<'_>,
    input: &[f32],
) -> Result<Buffer<f32>> {
    let rows = input.len() / l.in_features();
    let mut out = Buffer::zeros(pass.device, rows * l.out_features());
    l.forward_without_bias(input, out.host_mut());
    let mut out = reduce_partial_rows(pass.tp, out)?;
    if let Some(b) = l.bias() {
        add_bias(out.host_mut(), b);
    }
    Ok(out)
}

/// Partial sums over all rows → the summed local rows (all-reduce, or reduce-scatter along
/// `s` under sequence parallelism).
pub(crate) fn reduce_partial_rows(
    tp: Option<&TpInfo>,
    mut out: Buffer<f32>,
) -> Result<Buffer<f32>> {
    match tp {
        Some(t) if t.group.sequence_parallel() => Ok(Buffer::from_host(
            reduce_scatter_to_sequence_parallel_region(&t.group, out.into_host())?,
        )),
        Some(t) => {
            reduce_from_tensor_model_parallel_region(&t.group, out.host_mut())?;
            Ok(out)
        }
        None => Ok(out),
    }
}

/// Backward of [`row_parallel_forward`]'s reduction: the local rows' output gradient → all
/// rows' (all-gathered along `s`; the all-reduce's backward is the identity).
pub(crate) fn row_parallel_output_grad<'d>(
    tp: Option<&TpInfo>,
    dlocal: &'d [f32],
) -> Result<Cow<'d, [f32]>> {
    match sequence_parallel(tp) {
        Some(t) => Ok(Cow::Owned(
            reduce_scatter_to_sequence_parallel_region_backward(&t.group, dlocal)?,
        )),
        None => Ok(Cow::Borrowed(dlocal)),
    }
}

/// Whether this rank adds the gradients of a replicated parameter that every
/// tensor-parallel rank computes in full from all rows (a score head, an MoE router): the
/// first does, the others add nothing, and the sum over the group is that rank's (see
/// [`crate::ModelLayout::single_contributor_params`]).
pub(crate) fn adds_replicated_grads(tp: Option<&TpInfo>) -> bool {
    tp.is_none_or(|t| t.group.rank() == 0)
}

/// The embedding norm's input `[local rows, h]` and statistics, when the model has one.
pub(crate) type EmbeddingActs = Option<(Buffer<f32>, NormStats)>;

impl GptModel {
    /// The embedding stage of `ids: [rows]` for the local rows `[local rows, h]`: the word
    /// embeddings, times `√h` under `scale_embeddings` (HF Gemma's `normalizer`), then the
    /// embedding norm (Bloom's `word_embeddings_layernorm`), whose input and statistics come
    /// back for the backward.
    pub(crate) fn embed_forward(&self, ids: &[u32]) -> Result<(Buffer<f32>, EmbeddingActs)> {
        let h = self.local_config().hidden_size;
        let mut x = self.embed_train(ids)?;
        if self.config().scale_embeddings {
            let scale = embedding_scale(h);
            x.host_mut().iter_mut().for_each(|v| *v *= scale);
        }
        match self.layout().embedding_layernorm {
            Some(norm) => {
                let (out, stats) = NormLayer::new(self, norm).forward(x.host(), h)?;
                Ok((out, Some((x, stats))))
            }
            None => Ok((x, None)),
        }
    }

    /// Backward of [`embed_forward`](Self::embed_forward) for the gradient `dres` of its output
    /// `[local rows, h]`: **accumulates** into the embedding table's and norm's gradients
    /// (`grads` in table order).
    pub(crate) fn embed_forward_backward(
        &self,
        ids: &[u32],
        acts: EmbeddingActs,
        dres: &[f32],
        grads: &mut [&mut [f32]],
    ) -> Result<()> {
        let h = self.local_config().hidden_size;
        let mut d = match (acts, self.layout().embedding_layernorm) {
            (Some((x, stats)), Some(norm)) => {
                let mut dx = Buffer::zeros(self.device(), x.len());
                let n = NormLayer::new(self, norm);
                n.backward(x.host(), h, &stats, dres, dx.host_mut(), grads)?;
                dx
            }
            _ => Buffer::from_host(dres.to_vec()),
        };
        if self.config().scale_embeddings {
            let scale = embedding_scale(h);
            d.host_mut().iter_mut().for_each(|v| *v *= scale);
        }
        let emb = self
            .layout()
            .embedding
            .expect("the first stage holds the embedding")
            .index();
        self.embed_train_backward(ids, d.host(), grads[emb])
    }

    /// The embedding of `ids: [rows]` for the local rows `[local_rows, h]`.
    pub(crate) fn embed_train(&self, ids: &[u32]) -> Result<Buffer<f32>> {
        let h = self.local_config().hidden_size;
        let mut x = Buffer::zeros(self.device(), ids.len() * h);
        let embedding = self.word_embedding()?;
        let Some(tp) = &self.tp else {
            embedding.forward(ids, x.host_mut())?;
            return Ok(x);
        };
        let w = embedding.weight();
        let v_local = w.shape()[0];
        let (start, out) = (tp.vocab_start, x.host_mut());
        vocab_parallel_embedding_forward(w.weight_ref(), h, start, v_local, ids, out)?;
        reduce_partial_rows(Some(tp), x)
    }

    /// Backward of [`embed_train`](Self::embed_train): **accumulates** into `dtable`.
    pub(crate) fn embed_train_backward(
        &self,
        ids: &[u32],
        dlocal: &[f32],
        dtable: &mut [f32],
    ) -> Result<()> {
        let h = self.local_config().hidden_size;
        if dtable.is_empty() {
            // A frozen table (LoRA): no gradient, and no collective on any rank.
            return Ok(());
        }
        let Some(tp) = &self.tp else {
            embedding_backward(ids, dlocal, dtable, h);
            return Ok(());
        };
        let dy = row_parallel_output_grad(Some(tp), dlocal)?;
        vocab_parallel_embedding_backward(ids, &dy, dtable, h, tp.vocab_start);
        Ok(())
    }
}

/// `√h` rounded once to f32, as HF Gemma's `torch.tensor(hidden_size**0.5, dtype=f32)`.
fn embedding_scale(h: usize) -> f32 {
    (h as f64).sqrt() as f32
}
