use ferrotron_tensor::{TensorView, gemm::matmul_weight_t, ops::add_bias};
use std::borrow::Cow;

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
        Linear { weight, bias }
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

    /// `y[rows, out] = x[rows, in]·Wᵀ`: a row-parallel layer adds its bias only after the
    /// tensor-parallel reduction (Megatron's `RowParallelLinear`).
    pub fn forward_without_bias(&self, x: &[f32], y: &mut [f32]) {
        let (n, k) = (self.out_features(), self.in_features());
        let rows = x.len() / k;
        matmul_weight_t(x, self.weight.weight_ref(), y, rows, n, k, false);
    }
}
