use super::param_mapping;
use crate::module::ParamDecl;
use crate::{GptModel, ModelError, Result, TransformerConfig};
use ferrotron_tensor::Tensor;

/// Where HF-named weights come from (a safetensors checkpoint, a converted GGUF, ...).
pub trait WeightSource {
    /// Removes and returns the tensor `name` (any storage dtype; the source converts to the
    /// dtype it was opened with), or `None` when absent.
    fn take(&mut self, name: &str) -> Result<Option<Tensor>>;
    /// Names not taken yet (reported as unused after loading).
    fn remaining(&self) -> Vec<String>;
}

/// HF tensors that carry no parameters (buffers some older checkpoints saved).
fn is_ignorable(name: &str) -> bool {
    name.ends_with("rotary_emb.inv_freq")
}

/// Builds a [`GptModel`] from HF LLaMA/Mistral/Qwen2 weight names
/// (`model.layers.{i}.self_attn.q_proj.weight`, ...; transformers `modeling_llama.py`), packing
/// q/k/v per query group into `linear_qkv` and gate/up into `linear_fc1` (Megatron layout, as
/// Pai-Megatron-Patch's `hf2mcore` converters do). Every checkpoint tensor must be used: missing
/// ones and leftovers are errors naming them.
pub fn gpt_model_from_hf(
    config: TransformerConfig,
    src: &mut dyn WeightSource,
) -> Result<GptModel> {
    // One tensor per Megatron parameter, in table order.
    let params = param_mapping(&config, config.vocab_size)?
        .iter()
        .map(|m| pack(m, src))
        .collect::<Result<Vec<_>>>()?;
    let unused: Vec<String> = src
        .remaining()
        .into_iter()
        .filter(|n| !is_ignorable(n))
        .collect();
    if !unused.is_empty() {
        return Err(ModelError::UnusedWeights(unused));
    }
    GptModel::new(config, params)
}

/// The Megatron parameter `m` from its HF tensors taken from `src` (each checked against its
/// HF shape): the one tensor as is, or the parts' rows placed where `m` says (q/k/v
/// interleaved per query group, gate then up).
fn pack(m: &ParamDecl, src: &mut dyn WeightSource) -> Result<Tensor> {
    let mut taken = Vec::with_capacity(m.hf.len());
    for part in &m.hf {
        let t = src
            .take(&part.name)?
            .ok_or_else(|| ModelError::MissingWeight(part.name.clone()))?;
        if t.shape() != part.shape.as_slice() {
            return Err(ferrotron_nn::NnError::ParamShape {
                name: part.name.clone(),
                expected: part.shape.clone(),
                actual: t.shape().to_vec(),
            }
            .into());
        }
        // Rows of one element for 1-D tensors (biases), so they pack like weights.
        let rows = part.shape[0];
        taken.push(t.reshape(&[rows, part.shape[1..].iter().product()])?);
    }
    if let [part] = m.hf.as_slice()
        && let [rows] = part.rows.as_slice()
        && *rows == (0..m.shape[0])
        && let Some(t) = taken.pop()
    {
        return Ok(t.reshape(&m.shape)?);
    }
    // (row of the parameter, source tensor, its rows), sorted by the parameter's rows.
    let mut pieces = Vec::new();
    for (part, t) in m.hf.iter().zip(&taken) {
        let mut cursor = 0;
        for r in &part.rows {
            pieces.push((r.start, t, cursor..cursor + r.len()));
            cursor += r.len();
        }
    }
    pieces.sort_by_key(|(start, _, _)| *start);
    let rows: Vec<(&Tensor, std::ops::Range<usize>)> =
        pieces.into_iter().map(|(_, t, r)| (t, r)).collect();
    Ok(Tensor::cat_rows(&rows)?.reshape(&m.shape)?)
}
