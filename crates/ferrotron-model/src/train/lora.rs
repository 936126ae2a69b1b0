//! The backward of a LoRA adapter (`y += s·(d(x)·Aᵀ)·Bᵀ`, `d` its input dropout or the
//! identity, [`ferrotron_nn::LoraAdapter`]), beside its base layer's backward in
//! `backward.rs::linear_backward`.
//!
//! The adapter's bottleneck `z = s·d(x)·Aᵀ` (`[rows, r]`) is recomputed from the layer's
//! saved input rather than kept: it costs `2·rows·in·r` FLOPs, a small fraction of the base
//! layer's, and no activation memory; the dropout mask is recomputed from its keys.

use super::TrainBatch;
use crate::module::LoraParams;
use crate::{GptModel, TpInfo, TpSplit};
use ferrotron_nn::LoraAdapter;
use ferrotron_nn::lora::{LoraDropout, mix};
use ferrotron_tensor::gemm::{matmul_weight, weight_grad};
use ferrotron_tensor::gemm_bf16::Operand;

/// Backward of adapter `p` (values `adapter`) for the layer input `x: [rows, in]` and output
/// gradient `dy: [rows, out]`: **accumulates** `dB += dyᵀ·z` and `dA += dzᵀ·d(x)` (with
/// `dz = s·dy·B`) into `grads` (table order) and `dx += d'(dz·A)` into the layer's input
/// gradient (`d'` the dropout's backward: the same mask and scale).
///
/// Under tensor parallelism each rank's `dz` (column-parallel base: `B`'s rows are split) or
/// `z` (row-parallel base: `A`'s columns are split) is a partial sum over the ranks, so the
/// replicated matrix's gradient is too; `GptModel::finalize_grads` all-reduces it, and `dx`
/// joins the base layer's partial input gradient.
pub(super) fn lora_backward(
    adapter: &LoraAdapter<'_>,
    p: LoraParams,
    x: Operand<'_>,
    dy: &[f32],
    dx: &mut [f32],
    grads: &mut [&mut [f32]],
) {
    let (a, b) = (adapter.linear_in, adapter.linear_out);
    let (r, k, n) = (adapter.rank(), a.shape()[1], b.shape()[0]);
    let rows = dy.len() / n;
    let dropped = adapter.dropout.map(|d| {
        let mut v = x.to_f32().into_owned();
        d.apply(&mut v, k);
        v
    });
    let x = match &dropped {
        Some(v) => Operand::F32(v),
        None => x,
    };
    let mut z = vec![0f32; rows * r];
    adapter.down(&x.to_f32(), &mut z);
    weight_grad(
        Operand::F32(dy),
        Operand::F32(&z),
        b.weight_ref(),
        grads[p.linear_out.index()],
        rows,
        n,
        r,
    );
    let mut dz = z;
    matmul_weight(Operand::F32(dy), b.weight_ref(), &mut dz, rows, n, r, false);
    dz.iter_mut().for_each(|v| *v *= adapter.scale);
    weight_grad(
        Operand::F32(&dz),
        x,
        a.weight_ref(),
        grads[p.linear_in.index()],
        rows,
        r,
        k,
    );
    match adapter.dropout {
        None => matmul_weight(Operand::F32(&dz), a.weight_ref(), dx, rows, r, k, true),
        Some(d) => {
            let mut dxa = vec![0f32; rows * k];
            matmul_weight(
                Operand::F32(&dz),
                a.weight_ref(),
                &mut dxa,
                rows,
                r,
                k,
                false,
            );
            d.apply(&mut dxa, k);
            dx.iter_mut().zip(&dxa).for_each(|(g, v)| *g += v);
        }
    }
}

/// The LoRA adapters' input dropout of one training pass: its probability and one key per
/// row `[s·b]` (row `t·b + j` from row `j`'s key and position `t`).
pub(crate) struct PassDropout {
    p: f32,
    row_keys: Vec<u64>,
}

impl PassDropout {
    /// The dropout of a pass of `model` over `batch`: with `lora.dropout > 0` and the batch's
    /// dropout keys (a training step's), `None` otherwise.
    pub(crate) fn new(model: &GptModel, batch: &TrainBatch) -> Option<PassDropout> {
        let p = model.config().lora.as_ref()?.dropout;
        let keys = batch.dropout_keys.as_ref().filter(|_| p > 0.0)?;
        let row_keys = (0..batch.seq)
            .flat_map(|t| keys.iter().map(move |&k| mix(k ^ mix(t as u64))))
            .collect();
        Some(PassDropout { p, row_keys })
    }

    /// The dropout of adapter `a` of `model`, whose layer takes `in_features` input columns on
    /// this rank: keyed by the adapter's name, offset by the rank's first column when a
    /// row-parallel layer splits them.
    pub(crate) fn of_adapter(
        &self,
        model: &GptModel,
        a: LoraParams,
        tp: Option<&TpInfo>,
        in_features: usize,
    ) -> LoraDropout<'_> {
        let decl = model.layout().decl(a.linear_in);
        let col_offset = match (decl.split, tp) {
            (TpSplit::Columns, Some(t)) => t.group.rank() * in_features,
            _ => 0,
        };
        LoraDropout {
            p: self.p,
            key: name_key(&decl.name),
            row_keys: &self.row_keys,
            col_offset,
        }
    }
}

/// A stable 64-bit key of a parameter's name (FNV-1a, then mixed): the same for the
/// parameter in every layout.
fn name_key(name: &str) -> u64 {
    let fnv = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    mix(fnv)
}
