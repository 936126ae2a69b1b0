use super::{ParamMapping, param_mapping};
use crate::{GptModel, ModelError, Result, TransformerConfig, TransformerLayer};
use ferrotron_nn::{Embedding, Linear, RmsNorm, SwiGluMlp};
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
    let c = &config;
    // One tensor per Megatron parameter, in the order of `GptModel::parameters`.
    let mut params = param_mapping(c, c.vocab_size)?
        .iter()
        .map(|m| pack(m, src))
        .collect::<Result<Vec<_>>>()?
        .into_iter();
    let unused: Vec<String> = src
        .remaining()
        .into_iter()
        .filter(|n| !is_ignorable(n))
        .collect();
    if !unused.is_empty() {
        return Err(ModelError::UnusedWeights(unused));
    }
    let mut next = || params.next().expect("one tensor per mapped parameter");
    let (h, eps) = (c.hidden_size, c.layernorm_epsilon);
    let embedding = Embedding::new("embedding.word_embeddings.weight", next())?;
    let mut layers = Vec::with_capacity(c.num_layers);
    for i in 0..c.num_layers {
        let p = format!("decoder.layers.{i}");
        let linear = |next: &mut dyn FnMut() -> Tensor, name: &str, bias: bool| {
            let w = next();
            let b = bias.then(next);
            Linear::new(&format!("{p}.{name}"), w, b)
        };
        let input_layernorm = RmsNorm::new(&format!("{p}.input_layernorm"), next(), h, eps)?;
        let linear_qkv = linear(&mut next, "self_attention.linear_qkv", c.add_qkv_bias)?;
        let linear_proj = linear(&mut next, "self_attention.linear_proj", c.add_proj_bias)?;
        let pre_mlp_layernorm = RmsNorm::new(&format!("{p}.pre_mlp_layernorm"), next(), h, eps)?;
        let linear_fc1 = linear(&mut next, "mlp.linear_fc1", c.add_mlp_bias)?;
        let linear_fc2 = linear(&mut next, "mlp.linear_fc2", c.add_mlp_bias)?;
        layers.push(TransformerLayer {
            input_layernorm,
            linear_qkv,
            linear_proj,
            pre_mlp_layernorm,
            mlp: SwiGluMlp {
                linear_fc1,
                linear_fc2,
            },
        });
    }
    let final_layernorm = RmsNorm::new("decoder.final_layernorm.weight", next(), h, eps)?;
    let output_layer = if c.untie_embeddings_and_output_weights {
        Some(Linear::new("output_layer.weight", next(), None)?)
    } else {
        None
    };
    GptModel::new(config, embedding, layers, final_layernorm, output_layer)
}

/// The Megatron parameter `m` from its HF tensors taken from `src` (each checked against its
/// HF shape): the one tensor as is, or the parts' rows placed where `m` says (q/k/v
/// interleaved per query group, gate then up).
fn pack(m: &ParamMapping, src: &mut dyn WeightSource) -> Result<Tensor> {
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
