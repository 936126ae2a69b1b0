//! The trainable parameters of a [`GptModel`] as flat f32 views in table order (the order of
//! the model's [`ModelLayout`](crate::module::ModelLayout): Megatron-Core's state-dict order,
//! `megatron/core/models/gpt/gpt_model.py`), and copies between the model and the
//! optimizer's buffers.

use crate::{GptModel, ModelError, Result};
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
    /// Frozen (under LoRA, every parameter but the adapters): no gradient, no optimizer
    /// state; its gradient slice is empty.
    pub frozen: bool,
}

impl ParamInfo {
    /// Element count.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

impl GptModel {
    /// Every trainable parameter in table order: the embedding, then per layer
    /// `input_layernorm`, `linear_qkv` (weight, bias), `linear_proj` (weight, bias),
    /// `pre_mlp_layernorm`, `linear_fc1` (weight, bias), `linear_fc2` (weight, bias), then
    /// `final_layernorm` and, when untied, `output_layer`. Biases appear only where the model
    /// has them; a pipeline stage lists what it holds.
    pub fn parameters(&self) -> Vec<ParamInfo> {
        let table = self.param_table();
        self.layout()
            .decls()
            .iter()
            .enumerate()
            .map(|(i, d)| ParamInfo {
                name: d.name.clone(),
                shape: table.shape(i).to_vec(),
                is_norm_or_bias: d.role.is_norm_or_bias(),
                is_embedding: d.role == crate::module::ParamRole::Embedding,
                frozen: table.is_frozen(i),
            })
            .collect()
    }

    /// One zeroed f32 vector per parameter, in table order, each [`ParamInfo::numel`] long
    /// (empty for a frozen one): gradient storage for [`GptModel::forward_backward`].
    pub fn zero_grads(&self) -> Vec<Vec<f32>> {
        let table = self.param_table();
        (0..table.len())
            .map(|i| {
                vec![
                    0f32;
                    if table.is_frozen(i) {
                        0
                    } else {
                        table.numel(i)
                    }
                ]
            })
            .collect()
    }

    /// Every parameter's values widened to f32 (exact), in table order.
    pub fn parameters_f32(&self) -> Vec<Vec<f32>> {
        let table = self.param_table();
        (0..table.len())
            .map(|i| table.f32_values(i).into_owned())
            .collect()
    }

    /// Copies every parameter, widened to f32, into `dst` (one slice per parameter in table
    /// order, each exactly [`ParamInfo::numel`] long; **overwritten**).
    ///
    /// # Errors
    /// A count or length mismatch.
    pub fn copy_parameters_to(&self, dst: &mut [&mut [f32]]) -> Result<()> {
        self.check_slices(dst.iter().map(|d| d.len()))?;
        for (i, d) in dst.iter_mut().enumerate() {
            d.copy_from_slice(&self.param_table().f32_values(i));
        }
        Ok(())
    }

    /// Writes every parameter from `src` (f32, same order and lengths as
    /// [`GptModel::copy_parameters_to`]), rounded to the table's dtype (round-to-nearest-even
    /// for bf16/f16).
    ///
    /// # Errors
    /// A count or length mismatch (nothing is written then).
    pub fn load_parameters_from(&mut self, src: &[&[f32]]) -> Result<()> {
        self.check_slices(src.iter().map(|s| s.len()))?;
        let all: Vec<usize> = (0..src.len()).collect();
        self.load_parameters_with(&all, |i| Cow::Borrowed(src[i]))
    }

    /// Parameter `index` (table order) widened to f32 (exact).
    ///
    /// # Errors
    /// No such parameter.
    pub fn parameter_f32(&self, index: usize) -> Result<Vec<f32>> {
        if index >= self.param_table().len() {
            return Err(self.no_such_param(index));
        }
        Ok(self.param_table().f32_values(index).into_owned())
    }

    /// Writes the parameters `indices` (table order) from `src(i)` (f32, rounded to the
    /// table's dtype as [`GptModel::load_parameters_from`]).
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
            if i >= self.param_table().len() {
                return Err(self.no_such_param(i));
            }
            let values = src(i);
            let name = self.layout().decls()[i].name.clone();
            self.param_table_mut().set_from_f32(i, &name, &values)?;
        }
        Ok(())
    }

    fn no_such_param(&self, index: usize) -> ModelError {
        ModelError::Input(format!(
            "parameter {index} of a model with {} parameters",
            self.param_table().len()
        ))
    }

    /// Checks one slice length per parameter, naming the first that disagrees.
    pub(crate) fn check_slices(&self, lens: impl ExactSizeIterator<Item = usize>) -> Result<()> {
        let table = self.param_table();
        if lens.len() != table.len() {
            return Err(ModelError::Input(format!(
                "{} parameter slices given, the model has {} parameters",
                lens.len(),
                table.len()
            )));
        }
        for ((i, got), d) in lens.enumerate().zip(self.layout().decls()) {
            if table.numel(i) != got {
                return Err(ModelError::Input(format!(
                    "{}: slice of {got} elements, the parameter has {} ({:?})",
                    d.name,
                    table.numel(i),
                    table.shape(i)
                )));
            }
        }
        Ok(())
    }
}
