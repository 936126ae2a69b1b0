use crate::lora::{LoraAdapter, LoraDropout, TransposedLoraAdapter};
use ferrotron_tensor::gemm::{WeightRef, matmul_weight_t, matmul_weight_t_with};
use ferrotron_tensor::quant::QuantRows;
use ferrotron_tensor::{TensorView, ops::add_bias};
use rayon::prelude::*;
use std::borrow::Cow;
use std::ops::Range;

/// A dense layer `y = x·Wᵀ + b` over borrowed parameters (Megatron `ColumnParallelLinear` /
/// `RowParallelLinear` on one rank's shard).
///
/// `weight: [out, in]` in any storage dtype; `bias: [out]` in f32 (borrowed from an f32
/// table, widened from a narrower one). The parameters live in the model's parameter table;
/// a `Linear` is a view built where it is used.
#[derive(Clone, Debug)]
pub struct Linear<'a> {
    weight: TensorView<'a>,
    bias: Option<Cow<'a, [f32]>>,
    lora: Option<LoraAdapter<'a>>,
    /// Adapters of row ranges (serving several adapters in one batch).
    row_lora: Vec<(Range<usize>, TransposedLoraAdapter<'a>)>,
    /// How a quantized weight multiplies each range of rows (empty: by their number).
    row_paths: Vec<(Range<usize>, QuantRows)>,
}

impl<'a> Linear<'a> {
    /// Views a `[out, in]` weight and an optional `[out]` bias.
    ///
    /// # Panics
    /// When the weight is not 2-D or the bias length is not `out` (the model's parameter
    /// declarations guarantee both; a mismatch is a bug).
    pub fn new(weight: TensorView<'a>, bias: Option<Cow<'a, [f32]>>) -> Linear<'a> {
        assert_eq!(weight.shape().len(), 2, "a linear weight is [out, in]");
        if let Some(b) = &bias {
            assert_eq!(b.len(), weight.shape()[0], "a linear bias is [out]");
        }
        Linear {
            weight,
            bias,
            lora: None,
            row_lora: Vec::new(),
            row_paths: Vec::new(),
        }
    }

    /// The layer with `adapter` added to its output.
    ///
    /// # Panics
    /// When the adapter's shapes do not fit the weight (`A: [r, in]`, `B: [out, r]`).
    pub fn with_lora(mut self, adapter: LoraAdapter<'a>) -> Linear<'a> {
        self.check_fits(&adapter);
        self.lora = Some(adapter);
        self
    }

    fn check_fits(&self, adapter: &LoraAdapter<'a>) {
        let (a, b) = (adapter.linear_in.shape(), adapter.linear_out.shape());
        assert!(
            a.len() == 2 && b == [self.out_features(), a[0]] && a[1] == self.in_features(),
            "a LoRA adapter of a [out, in] layer is A: [r, in], B: [out, r]"
        );
    }

    /// The layer with a LoRA adapter on each of the given row ranges of its input (S-LoRA,
    /// Sheng et al. 2023; vLLM's punica kernels): rows `range` of the output get
    /// `adapter`'s `scale·(x·Aᵀ)·Bᵀ`, other rows none. Serving batches the sequences of
    /// several adapters this way over one base weight. Forward only: a backward takes
    /// [`Linear::lora`] alone.
    ///
    /// # Panics
    /// When an adapter's shapes do not fit the weight (as [`Linear::with_lora`]), or the
    /// ranges are not ascending and disjoint.
    pub fn with_row_lora(
        mut self,
        adapters: Vec<(Range<usize>, TransposedLoraAdapter<'a>)>,
    ) -> Linear<'a> {
        for (_, a) in &adapters {
            let (a_in, b_t) = (a.linear_in.shape(), a.linear_out_t.shape());
            assert!(
                a_in == [a.rank(), self.in_features()] && b_t == [a.rank(), self.out_features()],
                "a served LoRA adapter of a [out, in] layer is A: [r, in], Bᵀ: [r, out]"
            );
        }
        assert!(
            adapters.windows(2).all(|w| w[0].0.end <= w[1].0.start),
            "row ranges of LoRA adapters are ascending and disjoint"
        );
        self.row_lora = adapters;
        self
    }

    /// The layer with a quantized weight multiplying each row range of `paths` by its
    /// [`QuantRows`] path (a served batch: prompt rows by the prompt-processing kernels,
    /// generated rows by integer dot products, whatever else the batch holds). The ranges cover
    /// the input's rows in order (checked in the forward). Other weights ignore them.
    pub fn with_row_paths(mut self, paths: Vec<(Range<usize>, QuantRows)>) -> Linear<'a> {
        self.row_paths = paths;
        self
    }

    /// The layer with its adapter's input dropout `dropout` (a training pass).
    ///
    /// # Panics
    /// When the layer has no adapter.
    pub fn with_lora_dropout(mut self, dropout: LoraDropout<'a>) -> Linear<'a> {
        let a = self.lora.as_mut().expect("dropout needs a LoRA adapter");
        a.dropout = Some(dropout);
        self
    }

    /// The layer's LoRA adapter, if any.
    pub fn lora(&self) -> Option<&LoraAdapter<'a>> {
        self.lora.as_ref()
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.weight.shape()[0]
    }

    /// Input features.
    pub fn in_features(&self) -> usize {
        self.weight.shape()[1]
    }

    /// The `[out, in]` weight.
    pub fn weight(&self) -> TensorView<'a> {
        self.weight
    }

    /// The `[out]` bias, if any.
    pub fn bias(&self) -> Option<&[f32]> {
        self.bias.as_deref()
    }

    /// `y[rows, out] = x[rows, in]·Wᵀ + b`. Backward needs `x` (for dW) and `W` (for dx).
    pub fn forward(&self, x: &[f32], y: &mut [f32]) {
        self.forward_without_bias(x, y);
        if let Some(b) = &self.bias {
            add_bias(y, b);
        }
    }

    /// `y[rows, out] = x[rows, in]·Wᵀ` (plus the LoRA adapter's output): a row-parallel
    /// layer adds its bias only after the tensor-parallel reduction (Megatron's
    /// `RowParallelLinear`), and its adapter's partial output before it.
    pub fn forward_without_bias(&self, x: &[f32], y: &mut [f32]) {
        let (n, k) = (self.out_features(), self.in_features());
        let rows = x.len() / k;
        let w = self.weight.weight_ref();
        match w {
            WeightRef::Quant(_) if !self.row_paths.is_empty() => {
                for (path, ranges) in paths_by_kind(&self.row_paths, rows) {
                    matmul_rows(x, w, y, (n, k), &ranges, path);
                }
            }
            _ => matmul_weight_t(x, w, y, rows, n, k, false),
        }
        if let Some(a) = &self.lora {
            a.apply(x, y);
        }
        self.row_lora_forward(x, y);
    }

    /// Adds each row range's adapter output to its rows of `y`, the ranges in parallel.
    fn row_lora_forward(&self, x: &[f32], y: &mut [f32]) {
        let (n, k) = (self.out_features(), self.in_features());
        let mut parts = Vec::with_capacity(self.row_lora.len());
        let (mut rest, mut at) = (y, 0);
        for (rows, a) in &self.row_lora {
            let (_, tail) = rest.split_at_mut((rows.start - at) * n);
            let (mine, tail) = tail.split_at_mut(rows.len() * n);
            parts.push((a, &x[rows.start * k..rows.end * k], mine));
            (rest, at) = (tail, rows.end);
        }
        match parts.len() {
            1 => parts.into_iter().for_each(|(a, x, y)| a.apply(x, y)),
            _ => parts.into_par_iter().for_each(|(a, x, y)| a.apply(x, y)),
        }
    }
}

/// The row ranges of each path of `paths` (ascending, covering `0..rows`), each path once,
/// adjacent ranges merged.
///
/// # Panics
/// When the ranges do not cover `0..rows` in order (a caller bug).
fn paths_by_kind(
    paths: &[(Range<usize>, QuantRows)],
    rows: usize,
) -> Vec<(QuantRows, Vec<Range<usize>>)> {
    let mut out: Vec<(QuantRows, Vec<Range<usize>>)> = Vec::new();
    let mut at = 0;
    for (r, p) in paths {
        assert_eq!(r.start, at, "row paths cover the rows in order");
        at = r.end;
        match out.iter_mut().find(|(q, _)| q == p) {
            Some((_, ranges)) => match ranges.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => ranges.push(r.clone()),
            },
            None => out.push((*p, vec![r.clone()])),
        }
    }
    assert_eq!(at, rows, "row paths cover the rows in order");
    out
}

/// `y[r] = x[r]·wᵀ` for the rows of `ranges` (`x: [rows, k]`, `y: [rows, n]`) on `path`, in
/// one product: rows of several ranges are gathered first and their results put back.
fn matmul_rows(
    x: &[f32],
    w: WeightRef<'_>,
    y: &mut [f32],
    (n, k): (usize, usize),
    ranges: &[Range<usize>],
    path: QuantRows,
) {
    if let [r] = ranges {
        let (xs, ys) = (&x[r.start * k..r.end * k], &mut y[r.start * n..r.end * n]);
        return matmul_weight_t_with(xs, w, ys, (r.len(), n, k), false, path);
    }
    let xs: Vec<f32> = ranges
        .iter()
        .flat_map(|r| &x[r.start * k..r.end * k])
        .copied()
        .collect();
    let m = xs.len() / k;
    let mut ys = vec![0f32; m * n];
    matmul_weight_t_with(&xs, w, &mut ys, (m, n, k), false, path);
    let mut from = ys.chunks_exact(n);
    for r in ranges {
        for (dst, src) in y[r.start * n..r.end * n]
            .chunks_exact_mut(n)
            .zip(from.by_ref())
        {
            dst.copy_from_slice(src);
        }
    }
}
