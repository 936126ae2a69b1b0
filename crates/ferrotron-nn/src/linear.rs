use crate::{Result, error::check_shape};
use ferrotron_tensor::{Tensor, gemm::matmul_weight_t, ops::add_bias};

/// A dense layer `y = x·Wᵀ + b` (Megatron `ColumnParallelLinear`/`RowParallelLinear` at
/// tensor-parallel size 1).
///
/// `weight: [out, in]` in any storage dtype; `bias: [out]` in f32.
#[derive(Clone, Debug)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Vec<f32>>,
}

impl Linear {
    /// Wraps a `[out, in]` weight and an optional `[out]` bias; `name` is used in shape errors.
    pub fn new(name: &str, weight: Tensor, bias: Option<Tensor>) -> Result<Linear> {
        if weight.shape().len() != 2 {
            check_shape(name, weight.shape(), &[0, 0])?;
        }
        let bias = match bias {
            Some(b) => {
                check_shape(&format!("{name} bias"), b.shape(), &[weight.shape()[0]])?;
                Some(b.to_f32_vec())
            }
            None => None,
        };
        Ok(Linear { weight, bias })
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
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The `[out]` bias, if any.
    pub fn bias(&self) -> Option<&[f32]> {
        self.bias.as_deref()
    }

    /// The `[out, in]` weight, mutable (training writes updated values; keep its shape).
    pub fn weight_mut(&mut self) -> &mut Tensor {
        &mut self.weight
    }

    /// The `[out]` bias, mutable, if any.
    pub fn bias_mut(&mut self) -> Option<&mut [f32]> {
        self.bias.as_deref_mut()
    }

    /// The weight and the bias, both mutable at once.
    pub fn parts_mut(&mut self) -> (&mut Tensor, Option<&mut [f32]>) {
        (&mut self.weight, self.bias.as_deref_mut())
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
