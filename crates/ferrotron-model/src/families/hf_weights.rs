use super::param_mapping;
use crate::module::ParamDecl;
use crate::{GptModel, ModelError, ParamValue, Result, TransformerConfig};
use ferrotron_tensor::Tensor;
use ferrotron_tensor::quant::QuantMatrix;

/// Where HF-named weights come from (a safetensors checkpoint, a converted GGUF, ...).
pub trait WeightSource {
    /// Removes and returns the tensor `name` (any storage dtype; the source converts to the
    /// dtype it was opened with), or `None` when absent.
    fn take(&mut self, name: &str) -> Result<Option<Tensor>>;
    /// As [`WeightSource::take`], but a source of quantized weights (a GGUF file) may return
    /// one in its blocks, to be served without dequantizing it. Defaults to `take`.
    fn take_value(&mut self, name: &str) -> Result<Option<ParamValue>> {
        Ok(self.take(name)?.map(ParamValue::Dense))
    }
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
/// ones and leftovers are errors naming them. Quantized weights from the source stay quantized
/// (their rows packed the same way); a fused weight with both dense and quantized parts is
/// dequantized to f32.
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
    GptModel::from_values(config, params)
}

/// The Megatron parameter `m` from its HF tensors taken from `src` (each checked against its
/// HF shape): the one tensor as is, or the parts' rows placed where `m` says (q/k/v
/// interleaved per query group, gate then up).
fn pack(m: &ParamDecl, src: &mut dyn WeightSource) -> Result<ParamValue> {
    let mut taken = Vec::with_capacity(m.hf.len());
    for part in &m.hf {
        let v = src
            .take_value(&part.name)?
            .ok_or_else(|| ModelError::MissingWeight(part.name.clone()))?;
        // 1-D tensors (biases) as rows of one element, so they pack like weights.
        let rows = part.shape[0];
        let matrix = [rows, part.shape[1..].iter().product()];
        let expected = match v {
            ParamValue::Dense(_) => part.shape.clone(),
            ParamValue::Quantized(_) => matrix.to_vec(),
        };
        if v.shape() != expected {
            return Err(ferrotron_nn::NnError::ParamShape {
                name: part.name.clone(),
                expected,
                actual: v.shape(),
            }
            .into());
        }
        taken.push(match v {
            ParamValue::Dense(t) => ParamValue::Dense(t.reshape(&matrix)?),
            quantized => quantized,
        });
    }
    if let [part] = m.hf.as_slice()
        && let [rows] = part.rows.as_slice()
        && *rows == (0..m.shape[0])
        && let Some(v) = taken.pop()
    {
        return Ok(match v {
            ParamValue::Dense(t) => ParamValue::Dense(t.reshape(&m.shape)?),
            quantized => quantized,
        });
    }
    // (row of the parameter, part index, its rows), sorted by the parameter's rows.
    let mut pieces = Vec::new();
    for (i, part) in m.hf.iter().enumerate() {
        let mut cursor = 0;
        for r in &part.rows {
            pieces.push((r.start, i, cursor..cursor + r.len()));
            cursor += r.len();
        }
    }
    pieces.sort_by_key(|(start, _, _)| *start);
    if let Some(quantized) = taken
        .iter()
        .map(|v| match v {
            ParamValue::Quantized(q) => Some(q),
            ParamValue::Dense(_) => None,
        })
        .collect::<Option<Vec<&QuantMatrix>>>()
    {
        let rows: Vec<_> = pieces
            .into_iter()
            .map(|(_, i, r)| (quantized[i], r))
            .collect();
        let packed = QuantMatrix::cat_rows(&rows)
            .map_err(|e| ModelError::Input(format!("{}: {e}", m.name)))?;
        return Ok(ParamValue::Quantized(packed));
    }
    let dense: Vec<Tensor> = taken
        .into_iter()
        .map(|v| match v {
            ParamValue::Dense(t) => t,
            ParamValue::Quantized(q) => {
                let mut values = vec![0f32; q.rows() * q.cols()];
                q.dequantize_rows(0..q.rows(), &mut values);
                Tensor::from_f32(&[q.rows(), q.cols()], values).expect("shape of its values")
            }
        })
        .collect();
    let rows: Vec<(&Tensor, std::ops::Range<usize>)> =
        pieces.into_iter().map(|(_, i, r)| (&dense[i], r)).collect();
    Ok(ParamValue::Dense(
        Tensor::cat_rows(&rows)?.reshape(&m.shape)?,
    ))
}
