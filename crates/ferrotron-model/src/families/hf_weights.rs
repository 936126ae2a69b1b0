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
    config.validate()?;
    let c = &config;
    let mut take = |name: &str| -> Result<Tensor> {
        src.take(name)?
            .ok_or_else(|| ModelError::MissingWeight(name.to_string()))
    };
    let embedding = Embedding::new(
        "model.embed_tokens.weight",
        take("model.embed_tokens.weight")?,
    )?;
    check_2d(
        "model.embed_tokens.weight",
        embedding.weight(),
        c.vocab_size,
        c.hidden_size,
    )?;
    let mut layers = Vec::with_capacity(c.num_layers);
    for i in 0..c.num_layers {
        layers.push(layer_from_hf(c, i, &mut take)?);
    }
    let final_layernorm = RmsNorm::new(
        "model.norm.weight",
        take("model.norm.weight")?,
        c.hidden_size,
        c.layernorm_epsilon,
    )?;
    let output_layer = if c.untie_embeddings_and_output_weights {
        let w = take("lm_head.weight")?;
        check_2d("lm_head.weight", &w, c.vocab_size, c.hidden_size)?;
        Some(Linear::new("lm_head.weight", w, None)?)
    } else {
        None
    };
    let unused: Vec<String> = src
        .remaining()
        .into_iter()
        .filter(|n| !is_ignorable(n))
        .collect();
    if !unused.is_empty() {
        return Err(ModelError::UnusedWeights(unused));
    }
    GptModel::new(config, embedding, layers, final_layernorm, output_layer)
}

fn layer_from_hf(
    c: &TransformerConfig,
    i: usize,
    take: &mut dyn FnMut(&str) -> Result<Tensor>,
) -> Result<TransformerLayer> {
    let p = format!("model.layers.{i}");
    let (h, d, a, g, f) = (
        c.hidden_size,
        c.kv_channels,
        c.num_attention_heads,
        c.num_query_groups,
        c.ffn_hidden_size,
    );
    let mut proj =
        |name: &str, rows: usize, cols: usize, bias: bool| -> Result<(Tensor, Option<Tensor>)> {
            let wname = format!("{p}.{name}.weight");
            let w = take(&wname)?;
            check_2d(&wname, &w, rows, cols)?;
            let b = if bias {
                let bname = format!("{p}.{name}.bias");
                let b = take(&bname)?;
                check_len(&bname, &b, rows)?;
                Some(b.reshape(&[rows, 1])?)
            } else {
                None
            };
            Ok((w, b))
        };
    let (wq, bq) = proj("self_attn.q_proj", a * d, h, c.add_qkv_bias)?;
    let (wk, bk) = proj("self_attn.k_proj", g * d, h, c.add_qkv_bias)?;
    let (wv, bv) = proj("self_attn.v_proj", g * d, h, c.add_qkv_bias)?;
    let (wo, bo) = proj("self_attn.o_proj", h, a * d, c.add_proj_bias)?;
    let (wg, bg) = proj("mlp.gate_proj", f, h, c.add_mlp_bias)?;
    let (wu, bu) = proj("mlp.up_proj", f, h, c.add_mlp_bias)?;
    let (wd, bd) = proj("mlp.down_proj", h, f, c.add_mlp_bias)?;
    let qkv_name = format!("{p}.self_attn.linear_qkv");
    let pack_qkv = |q: &Tensor, k: &Tensor, v: &Tensor| -> Result<Tensor> {
        let qpg = (a / g) * d;
        let mut pieces = Vec::with_capacity(3 * g);
        for gi in 0..g {
            pieces.push((q, gi * qpg..(gi + 1) * qpg));
            pieces.push((k, gi * d..(gi + 1) * d));
            pieces.push((v, gi * d..(gi + 1) * d));
        }
        Ok(Tensor::cat_rows(&pieces)?)
    };
    let qkv_w = pack_qkv(&wq, &wk, &wv)?;
    let qkv_b = match (&bq, &bk, &bv) {
        (Some(q), Some(k), Some(v)) => Some(pack_qkv(q, k, v)?.reshape(&[c.qkv_size()])?),
        _ => None,
    };
    let fc1_w = Tensor::cat_rows(&[(&wg, 0..f), (&wu, 0..f)])?;
    let fc1_b = match (&bg, &bu) {
        (Some(g), Some(u)) => Some(Tensor::cat_rows(&[(g, 0..f), (u, 0..f)])?.reshape(&[2 * f])?),
        _ => None,
    };
    let flat = |b: Option<Tensor>| {
        b.map(|t| {
            let n = t.numel();
            t.reshape(&[n])
        })
        .transpose()
    };
    let norm = |name: &str, take: &mut dyn FnMut(&str) -> Result<Tensor>| -> Result<RmsNorm> {
        let n = format!("{p}.{name}.weight");
        Ok(RmsNorm::new(&n, take(&n)?, h, c.layernorm_epsilon)?)
    };
    Ok(TransformerLayer {
        input_layernorm: norm("input_layernorm", take)?,
        linear_qkv: Linear::new(&qkv_name, qkv_w, qkv_b)?,
        linear_proj: Linear::new(&format!("{p}.self_attn.o_proj"), wo, flat(bo)?)?,
        pre_mlp_layernorm: norm("post_attention_layernorm", take)?,
        mlp: SwiGluMlp {
            linear_fc1: Linear::new(&format!("{p}.mlp.linear_fc1"), fc1_w, fc1_b)?,
            linear_fc2: Linear::new(&format!("{p}.mlp.down_proj"), wd, flat(bd)?)?,
        },
    })
}

fn check_2d(name: &str, t: &Tensor, rows: usize, cols: usize) -> Result<()> {
    if t.shape() != [rows, cols] {
        return Err(ferrotron_nn::NnError::ParamShape {
            name: name.to_string(),
            expected: vec![rows, cols],
            actual: t.shape().to_vec(),
        }
        .into());
    }
    Ok(())
}

fn check_len(name: &str, t: &Tensor, len: usize) -> Result<()> {
    if t.shape() != [len] {
        return Err(ferrotron_nn::NnError::ParamShape {
            name: name.to_string(),
            expected: vec![len],
            actual: t.shape().to_vec(),
        }
        .into());
    }
    Ok(())
}
