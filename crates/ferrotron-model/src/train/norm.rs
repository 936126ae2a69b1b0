//! A norm module's forward and backward over this rank's values: RMSNorm, LayerNorm (with or
//! without gain and bias), Megatron's `apply_layernorm_1p` gains, and OLMo2's full-width
//! q/k RMSNorm whose row statistics span every tensor-parallel rank's heads.

use crate::config::Normalization;
use crate::module::Norm;
use crate::{GptModel, Result, TpInfo};
use ferrotron_nn::tensor_parallel::reduce_from_tensor_model_parallel_region;
use ferrotron_tensor::ops::{layer_norm, layer_norm_backward, rms_norm, rms_norm_backward};
use ferrotron_tensor::{Buffer, Device};
use std::borrow::Cow;

/// What a norm's backward needs besides its input: per row `1/σ` (`1/rms` for RMSNorm) and,
/// for LayerNorm, the mean. `[rows]` each.
pub(crate) struct NormStats {
    pub rstd: Buffer<f32>,
    /// Empty for RMSNorm.
    pub mean: Buffer<f32>,
}

impl NormStats {
    /// Bytes held.
    pub(crate) fn bytes(&self) -> u128 {
        self.rstd.bytes() + self.mean.bytes()
    }

    /// Bytes per row for `normalization`: `1/σ`, and the mean for LayerNorm.
    pub(crate) fn bytes_per_row(normalization: Normalization) -> u128 {
        match normalization {
            Normalization::RmsNorm => 4,
            Normalization::LayerNorm | Normalization::NonParametricLayerNorm => 8,
        }
    }
}

/// One norm of a model part over `[rows, n]` rows: the kind and epsilon from the config, the
/// gain (already `1 + w` under `apply_layernorm_1p`) and bias from the parameter table.
pub(crate) struct NormLayer<'m> {
    ids: Norm,
    device: Device,
    kind: Normalization,
    eps: f32,
    weight: Option<Cow<'m, [f32]>>,
    bias: Option<Cow<'m, [f32]>>,
    /// Set for a q/k norm on a tensor-parallel shard: its rows span every rank's features
    /// (`full_width` in all), so the row statistics are all-reduced.
    split: Option<(&'m TpInfo, usize)>,
}

impl<'m> NormLayer<'m> {
    /// The norm `ids` of `model`.
    pub(crate) fn new(model: &'m GptModel, ids: Norm) -> NormLayer<'m> {
        let c = model.config();
        let weight = ids.weight.map(|id| {
            let w = model.f32_param(id);
            if c.apply_layernorm_1p {
                Cow::Owned(w.iter().map(|w| 1.0 + w).collect())
            } else {
                w
            }
        });
        NormLayer {
            ids,
            device: model.device(),
            kind: c.normalization,
            eps: c.layernorm_epsilon,
            weight,
            bias: ids.bias.map(|id| model.f32_param(id)),
            split: None,
        }
    }

    /// This norm with epsilon `eps` instead of the config's (multi-latent attention's
    /// latent norms).
    pub(crate) fn with_eps(mut self, eps: f32) -> Self {
        self.eps = eps;
        self
    }

    /// A q/k norm whose full row is `full_width` features over the ranks of `tp` (a no-op
    /// without tensor parallelism).
    pub(crate) fn spanning(mut self, tp: Option<&'m TpInfo>, full_width: usize) -> Self {
        self.split = tp.filter(|t| t.group.size() > 1).map(|t| (t, full_width));
        self
    }

    /// `x: [rows, n]` → the normed rows and their statistics.
    ///
    /// # Errors
    /// A failed tensor-parallel all-reduce (q/k norms on a shard).
    pub(crate) fn forward(&self, x: &[f32], n: usize) -> Result<(Buffer<f32>, NormStats)> {
        let rows = x.len() / n;
        let mut out = Buffer::zeros(self.device, x.len());
        let mut rstd = Buffer::zeros(self.device, rows);
        let mut mean = Buffer::default();
        let (o, r) = (out.host_mut(), rstd.host_mut());
        if let Some((tp, full)) = self.split {
            let w = self.weight.as_deref().expect("q/k norms are RMSNorms");
            let mut ss: Vec<f32> = x.chunks_exact(n).map(sum_squares).collect();
            reduce_from_tensor_model_parallel_region(&tp.group, &mut ss)?;
            for ((o, xr), (r, s)) in o
                .chunks_exact_mut(n)
                .zip(x.chunks_exact(n))
                .zip(r.iter_mut().zip(&ss))
            {
                *r = 1.0 / (s / full as f32 + self.eps).sqrt();
                o.iter_mut()
                    .zip(xr)
                    .zip(w)
                    .for_each(|((o, &v), &g)| *o = g * (v * *r));
            }
            return Ok((out, NormStats { rstd, mean }));
        }
        match self.kind {
            Normalization::RmsNorm => {
                let w = self.weight.as_deref().expect("an RMSNorm has a gain");
                rms_norm(x, w, self.eps, o, Some(r));
            }
            Normalization::LayerNorm | Normalization::NonParametricLayerNorm => {
                mean = Buffer::zeros(self.device, rows);
                let stats = Some((mean.host_mut(), r));
                let w = self.weight.as_deref();
                layer_norm(x, n, w, self.bias.as_deref(), self.eps, o, stats);
            }
        }
        Ok((out, NormStats { rstd, mean }))
    }

    /// Backward of [`NormLayer::forward`] for input `x` and output gradient `dy`: **overwrites**
    /// `dx`, **accumulates** the gain and bias gradients into `grads` (table order).
    ///
    /// # Errors
    /// A failed tensor-parallel all-reduce (q/k norms on a shard).
    pub(crate) fn backward(
        &self,
        x: &[f32],
        n: usize,
        stats: &NormStats,
        dy: &[f32],
        dx: &mut [f32],
        grads: &mut [&mut [f32]],
    ) -> Result<()> {
        let ids = [self.ids.weight, self.ids.bias];
        if ids.iter().flatten().any(|id| grads[id.index()].is_empty()) {
            return self.frozen_backward(x, n, stats, dy, dx, grads.len());
        }
        let mut dweight = self
            .ids
            .weight
            .map(|id| std::mem::take(&mut grads[id.index()]));
        if let Some((tp, full)) = self.split {
            let w = self.weight.as_deref().expect("q/k norms are RMSNorms");
            let dw = dweight.as_deref_mut().expect("q/k norms have a gain");
            split_rms_backward(x, w, stats.rstd.host(), dy, dx, dw, tp, full)?;
        } else {
            match self.kind {
                Normalization::RmsNorm => {
                    let w = self.weight.as_deref().expect("an RMSNorm has a gain");
                    let dw = dweight.as_deref_mut().expect("an RMSNorm has a gain");
                    rms_norm_backward(x, w, stats.rstd.host(), dy, dx, dw);
                }
                Normalization::LayerNorm | Normalization::NonParametricLayerNorm => {
                    let mut dbias = self
                        .ids
                        .bias
                        .map(|id| std::mem::take(&mut grads[id.index()]));
                    layer_norm_backward(
                        x,
                        n,
                        self.weight.as_deref(),
                        stats.mean.host(),
                        stats.rstd.host(),
                        dy,
                        dx,
                        dweight.as_deref_mut(),
                        dbias.as_deref_mut(),
                    );
                    if let (Some(id), Some(db)) = (self.ids.bias, dbias) {
                        grads[id.index()] = db;
                    }
                }
            }
        }
        if let (Some(id), Some(dw)) = (self.ids.weight, dweight) {
            grads[id.index()] = dw;
        }
        Ok(())
    }
}

impl NormLayer<'_> {
    /// [`NormLayer::backward`] of a frozen norm (LoRA): `dx` only, the gain and bias
    /// gradients going to scratch (`num_params` is the table's length).
    fn frozen_backward(
        &self,
        x: &[f32],
        n: usize,
        stats: &NormStats,
        dy: &[f32],
        dx: &mut [f32],
        num_params: usize,
    ) -> Result<()> {
        let width = self.weight.as_ref().map_or(0, |w| w.len());
        let ids: Vec<usize> = [self.ids.weight, self.ids.bias]
            .into_iter()
            .flatten()
            .map(|id| id.index())
            .collect();
        let mut scratch = vec![vec![0f32; width]; ids.len()];
        let mut grads: Vec<&mut [f32]> =
            (0..num_params).map(|_| -> &mut [f32] { &mut [] }).collect();
        for (&i, g) in ids.iter().zip(&mut scratch) {
            grads[i] = g;
        }
        self.backward(x, n, stats, dy, dx, &mut grads)
    }
}

/// RMSNorm backward over rows split by features across the ranks of `tp` (each rank holds
/// `[rows, n]` of rows `full` wide): `dx = r·(w⊙dy) − r³/full · x · Σ_all(w·dy·x)`, the sum
/// all-reduced; `dw += Σ_rows dy ⊙ x·r`.
#[allow(clippy::too_many_arguments)]
fn split_rms_backward(
    x: &[f32],
    w: &[f32],
    rstd: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    dw: &mut [f32],
    tp: &TpInfo,
    full: usize,
) -> Result<()> {
    let n = w.len();
    let mut s: Vec<f32> = x
        .chunks_exact(n)
        .zip(dy.chunks_exact(n))
        .map(|(xr, dr)| xr.iter().zip(dr).zip(w).map(|((x, d), w)| w * d * x).sum())
        .collect();
    reduce_from_tensor_model_parallel_region(&tp.group, &mut s)?;
    for ((((xr, dr), dxr), &r), &s) in x
        .chunks_exact(n)
        .zip(dy.chunks_exact(n))
        .zip(dx.chunks_exact_mut(n))
        .zip(rstd)
        .zip(&s)
    {
        let c = r * r * r * s / full as f32;
        for ((((o, &xv), &d), &g), dwj) in dxr.iter_mut().zip(xr).zip(dr).zip(w).zip(dw.iter_mut())
        {
            *o = r * (g * d) - c * xv;
            *dwj += d * (xv * r);
        }
    }
    Ok(())
}

fn sum_squares(x: &[f32]) -> f32 {
    x.iter().map(|v| v * v).sum()
}
