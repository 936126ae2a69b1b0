//! The trainable parameters of a [`GptModel`] as flat f32 views in table order (the order of
//! the model's [`ModelLayout`](crate::module::ModelLayout): Megatron-Core's state-dict order,
//! `megatron/core/models/gpt/gpt_model.py`), and copies between the model and the
//! optimizer's buffers.

use crate::{GptModel, ModelError, Result};
use ferrotron_tensor::{Storage, Tensor};
use std::borrow::Cow;

/// One trainable parameter as this rank holds it: its Megatron name, local shape and the
/// flags the optimizer needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamInfo {
    /// Megatron name, e.g. `decoder.layers.0.self_attention.linear_qkv.weight`.
    pub name: String,
    /// Local shape (`[out, in]` for linear weights, `[v, h]` for the embedding, `[n]` for
    /// norms/biases; divided over tensor-parallel ranks on a shard).
    pub shape: Vec<usize>,
    /// A norm gain or a bias (no weight decay by default, as Megatron's
    /// `no_weight_decay_cond`).
    pub is_norm_or_bias: bool,
    /// The word embedding (or the untied output layer): a `[v, h]` table.
    pub is_embedding: bool,
}

impl ParamInfo {
    /// Element count.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The values of `t` as f32: borrowed when stored in f32, widened (exactly) otherwise.
pub(crate) fn f32_values(t: &Tensor) -> Cow<'_, [f32]> {
    match t.storage() {
        Storage::F32(v) => Cow::Borrowed(v),
        _ => Cow::Owned(t.to_f32_vec()),
    }
}

impl GptModel {
    /// Every trainable parameter in table order: the embedding, then per layer
    /// `input_layernorm`, `linear_qkv` (weight, bias), `linear_proj` (weight, bias),
    /// `pre_mlp_layernorm`, `linear_fc1` (weight, bias), `linear_fc2` (weight, bias), then
    /// `final_layernorm` and, when untied, `output_layer`. Biases appear only where the model
    /// has them; a pipeline stage lists what it holds.
    pub fn parameters(&self) -> Vec<ParamInfo> {
        self.layout()
            .decls()
            .iter()
            .zip(self.param_tensors())
            .map(|(d, t)| ParamInfo {
                name: d.name.clone(),
                shape: t.shape().to_vec(),
                is_norm_or_bias: d.role.is_norm_or_bias(),
                is_embedding: d.role == crate::module::ParamRole::Embedding,
            })
            .collect()
    }

    /// One zeroed f32 vector per parameter, in table order, each [`ParamInfo::numel`] long:
    /// gradient storage for [`GptModel::forward_backward`].
    pub fn zero_grads(&self) -> Vec<Vec<f32>> {
        self.param_tensors()
            .iter()
            .map(|t| vec![0f32; t.numel()])
            .collect()
    }

    /// Every parameter's values widened to f32 (exact), in table order.
    pub fn parameters_f32(&self) -> Vec<Vec<f32>> {
        self.param_tensors()
            .iter()
            .map(Tensor::to_f32_vec)
            .collect()
    }

    /// Copies every parameter, widened to f32, into `dst` (one slice per parameter in table
    /// order, each exactly [`ParamInfo::numel`] long; **overwritten**).
    ///
    /// # Errors
    /// A count or length mismatch.
    pub fn copy_parameters_to(&self, dst: &mut [&mut [f32]]) -> Result<()> {
        self.check_slices(dst.iter().map(|d| d.len()))?;
        for (t, d) in self.param_tensors().iter().zip(dst.iter_mut()) {
            d.copy_from_slice(&f32_values(t));
        }
        Ok(())
    }

    /// Writes every parameter from `src` (f32, same order and lengths as
    /// [`GptModel::copy_parameters_to`]), rounded to its storage dtype (round-to-nearest-even
    /// for bf16/f16; norms and biases are f32).
    ///
    /// The optimizer keeps the f32 master weights in its own flat buffer and, after each
    /// step, copies them into the model with this function.
    ///
    /// # Errors
    /// A count or length mismatch (nothing is written then).
    pub fn load_parameters_from(&mut self, src: &[&[f32]]) -> Result<()> {
        self.check_slices(src.iter().map(|s| s.len()))?;
        for (t, s) in self.param_tensors_mut().iter_mut().zip(src) {
            t.copy_from_f32(s)?;
        }
        Ok(())
    }

    /// Parameter `index` (table order) widened to f32 (exact).
    ///
    /// # Errors
    /// No such parameter.
    pub fn parameter_f32(&self, index: usize) -> Result<Vec<f32>> {
        self.param_tensors()
            .get(index)
            .map(Tensor::to_f32_vec)
            .ok_or_else(|| self.no_such_param(index))
    }

    /// Writes the parameters `indices` (table order) from `src(i)` (f32, rounded to the
    /// storage dtype as [`GptModel::load_parameters_from`]).
    ///
    /// # Errors
    /// An index beyond the parameters, or a source of the wrong length; the parameters
    /// before it in `indices` are written by then.
    pub fn load_parameters_with<'s>(
        &mut self,
        indices: &[usize],
        mut src: impl FnMut(usize) -> Cow<'s, [f32]>,
    ) -> Result<()> {
        for &i in indices {
            if i >= self.param_tensors().len() {
                return Err(self.no_such_param(i));
            }
            let values = src(i);
            let name = &self.layout().decls()[i].name;
            let t = &self.param_tensors()[i];
            if values.len() != t.numel() {
                return Err(ModelError::Input(format!(
                    "{name}: slice of {} elements, the parameter has {} ({:?})",
                    values.len(),
                    t.numel(),
                    t.shape()
                )));
            }
            self.param_tensors_mut()[i].copy_from_f32(&values)?;
        }
        Ok(())
    }

    fn no_such_param(&self, index: usize) -> ModelError {
        ModelError::Input(format!(
            "parameter {index} of a model with {} parameters",
            self.param_tensors().len()
        ))
    }

    /// Checks one slice length per parameter, naming the first that disagrees.
    pub(crate) fn check_slices(&self, lens: impl ExactSizeIterator<Item = usize>) -> Result<()> {
        let tensors = self.param_tensors();
        if lens.len() != tensors.len() {
            return Err(ModelError::Input(format!(
                "{} parameter slices given, the model has {} parameters",
                lens.len(),
                tensors.len()
            )));
        }
        for ((t, got), d) in tensors.iter().zip(lens).zip(self.layout().decls()) {
            if t.numel() != got {
                return Err(ModelError::Input(format!(
                    "{}: slice of {got} elements, the parameter has {} ({:?})",
                    d.name,
                    t.numel(),
                    t.shape()
                )));
            }
        }
        Ok(())
    }
}
