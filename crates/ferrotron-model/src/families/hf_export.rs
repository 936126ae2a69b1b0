//! The inverse of `hf_config` / `hf_weights`: a [`TransformerConfig`] -> an HF `config.json`,
//! and a [`GptModel`]'s Megatron-layout parameters -> HF-named tensors (`linear_qkv` unpacked
//! into `q_proj`/`k_proj`/`v_proj` per query group, `linear_fc1` into `gate_proj`/`up_proj`), as
//! Pai-Megatron-Patch's `mcore2hf` converters and transformers' `save_pretrained` lay them out.

use super::hf_rope::{legacy_rope_scaling, rope_json};
use super::schema::{Biases, ConfigSchema, KvHeads, activation_from_hf, activation_to_hf};
use super::{HfModelInfo, parse_hf_config};
use crate::config::field_error;
use crate::{GptModel, ModelError, ModelFamily, PositionEmbedding, Result, TransformerConfig};
use ferrotron_tensor::{DType, TensorView};
use serde_json::{Map, Value, json};
use std::ops::Range;

/// What `config.json` needs beyond the [`TransformerConfig`]: special token ids and, when the
/// model was loaded from an HF directory, that directory's `config.json`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HfConfigInputs {
    /// The source `config.json`. Its fields that the mapping does not own (e.g.
    /// `initializer_range`, `unk_token_id`, `attention_dropout`, `use_cache`, custom keys) are
    /// kept, because they carry information the model cannot reconstruct; every field derived
    /// from the model is rewritten (see [`hf_config_json`]).
    pub original: Option<Value>,
    /// `bos_token_id`.
    pub bos_token_id: Option<u32>,
    /// `eos_token_id`: written as an integer when there is one, a list when several.
    pub eos_token_ids: Vec<u32>,
    /// `pad_token_id`.
    pub pad_token_id: Option<u32>,
}

impl HfConfigInputs {
    /// Token ids from a parsed config, with no original `config.json` to keep fields of.
    pub fn from_info(info: &HfModelInfo) -> HfConfigInputs {
        HfConfigInputs {
            original: None,
            bos_token_id: info.bos_token_id,
            eos_token_ids: info.eos_token_ids.clone(),
            pad_token_id: None,
        }
    }

    /// Keeps `original` (a source `config.json`) and takes its token ids.
    ///
    /// # Errors
    /// Whatever [`parse_hf_config`] reports for `original`, or a `pad_token_id` that is not a
    /// non-negative integer.
    pub fn from_original(original: Value) -> Result<HfConfigInputs> {
        let info = parse_hf_config(&original)?;
        let pad_token_id =
            match original.get("pad_token_id") {
                None | Some(Value::Null) => None,
                Some(v) => Some(v.as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(
                    || field_error("pad_token_id", format!("expected a token id, got {v}")),
                )?),
            };
        Ok(HfConfigInputs {
            bos_token_id: info.bos_token_id,
            eos_token_ids: info.eos_token_ids,
            pad_token_id,
            original: Some(original),
        })
    }
}

/// Fields of an original `config.json` that are dropped rather than kept: they are derived from
/// fields this mapping rewrites (`layer_types` from the sliding window and layer count, the dtype
/// from the export dtype), or describe the writer (`transformers_version`).
const DERIVED_FIELDS: [&str; 4] = [
    "layer_types",
    "transformers_version",
    "dtype",
    "torch_dtype",
];

/// The HF `config.json` of `config` for its family, with `torch_dtype` the dtype the weights
/// are written in, spelled as the family's schema (`families/schema.rs`) says.
///
/// Written in the form transformers 5.x saves (`rope_parameters` with `rope_theta` and
/// `rope_type`, `dtype`) plus the 4.x spellings (`rope_theta`, `rope_scaling`, `torch_dtype`),
/// which 5.x also reads, so either version loads it. f32 values (epsilon, rope numbers) are
/// written as the shortest decimal that rounds to the same f32 (`1e-5`, not
/// `9.999999747378752e-6`). `head_dim` is written for the families whose config reads it, and
/// for Qwen2 only when it differs from `hidden_size / num_attention_heads`. Fields of
/// `inputs.original` that this mapping does not own are kept (see
/// [`HfConfigInputs::original`]).
///
/// # Errors
/// An invalid config; switches, biases, head counts, MLP size or a sliding window the
/// family's HF config cannot express; a non-finite rope or epsilon value; an original
/// `config.json` of another family. Errors name the field.
pub fn hf_config_json(
    config: &TransformerConfig,
    inputs: &HfConfigInputs,
    torch_dtype: DType,
) -> Result<Value> {
    let c = config;
    c.validate()?;
    let schema = c.family.config_schema();
    schema.switches.check(c)?;
    check_expressible(c, &schema)?;
    let mut obj = match &inputs.original {
        Some(orig) => kept_fields(orig, c.family)?,
        None => Map::new(),
    };
    let owned = json!({
        "architectures": [c.family.hf_architecture_with(c.output_head)],
        "model_type": c.family.model_type(),
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": !c.untie_embeddings_and_output_weights,
        "dtype": torch_dtype.hf_name(),
        "torch_dtype": torch_dtype.hf_name(),
        "bos_token_id": inputs.bos_token_id,
        "eos_token_id": match inputs.eos_token_ids.as_slice() {
            [] => Value::Null,
            [one] => json!(one),
            many => json!(many),
        },
        "pad_token_id": inputs.pad_token_id,
    });
    let Value::Object(owned) = owned else {
        unreachable!("json! of an object literal is an object")
    };
    obj.extend(owned);
    if c.output_head == crate::OutputHead::Score {
        // One label, as transformers writes `num_labels = 1`.
        obj.insert("id2label".into(), json!({"0": "LABEL_0"}));
        obj.insert("label2id".into(), json!({"LABEL_0": 0}));
    }
    insert_schema_fields(&mut obj, c, &schema)?;
    if c.family == ModelFamily::DeepseekV2 {
        super::hf_deepseek::insert_deepseek_fields(&mut obj, c)?;
    } else {
        super::hf_moe::insert_moe_fields(&mut obj, c)?;
    }
    Ok(Value::Object(obj))
}

/// The fields whose key names the family's schema decides.
fn insert_schema_fields(
    obj: &mut Map<String, Value>,
    c: &TransformerConfig,
    schema: &ConfigSchema,
) -> Result<()> {
    obj.insert(schema.num_layers.into(), json!(c.num_layers));
    obj.insert(schema.num_heads.into(), json!(c.num_attention_heads));
    match schema.kv_heads {
        KvHeads::Key => obj.insert("num_key_value_heads".into(), json!(c.num_query_groups)),
        KvHeads::MultiQuery => obj.insert("multi_query".into(), json!(c.num_query_groups == 1)),
        KvHeads::PerHead => None,
    };
    if let Some(key) = schema.ffn {
        obj.insert(key.into(), json!(c.ffn_hidden_size));
    }
    if let (Some(key), _) = schema.eps {
        obj.insert(
            key.into(),
            finite_f32("layernorm_epsilon", c.layernorm_epsilon)?,
        );
    }
    if let (Some(key), _) = schema.activation {
        obj.insert(key.into(), json!(activation_to_hf(c.activation_func)));
    }
    if c.position_embedding_type == PositionEmbedding::Rope {
        let rope = rope_json(c)?;
        obj.insert("rope_theta".into(), rope["rope_theta"].clone());
        obj.insert("rope_scaling".into(), legacy_rope_scaling(&rope));
        obj.insert("rope_parameters".into(), rope);
    }
    if c.position_embedding_type != PositionEmbedding::Alibi {
        obj.insert(
            "max_position_embeddings".into(),
            json!(c.max_position_embeddings),
        );
    }
    match schema.biases {
        Biases::AttentionAndMlp => {
            obj.insert("attention_bias".into(), json!(c.add_qkv_bias));
            obj.insert("mlp_bias".into(), json!(c.add_mlp_bias));
        }
        Biases::Attention => {
            obj.insert("attention_bias".into(), json!(c.add_qkv_bias));
        }
        Biases::AllLinears(key) | Biases::QkvFlag(key) => {
            obj.insert(key.into(), json!(c.add_qkv_bias));
        }
        Biases::Qkv | Biases::Always | Biases::Never => {}
    }
    let default_head_dim = c.hidden_size / c.num_attention_heads;
    if schema.head_dim && (c.family != ModelFamily::Qwen2 || c.kv_channels != default_head_dim) {
        obj.insert("head_dim".into(), json!(c.kv_channels));
    } else {
        obj.remove("head_dim");
    }
    if schema.sliding_window {
        // Mistral's config defaults to a 4096 window: "no window" must be an explicit null.
        obj.insert("sliding_window".into(), json!(c.sliding_window));
    }
    match c.family {
        ModelFamily::Qwen2 | ModelFamily::Qwen2Moe => {
            obj.insert("use_sliding_window".into(), json!(false));
            obj.insert("sliding_window".into(), Value::Null);
        }
        ModelFamily::Falcon => {
            obj.insert("alibi".into(), json!(false));
            obj.insert("new_decoder_architecture".into(), json!(false));
            obj.insert("parallel_attn".into(), json!(true));
        }
        _ => {}
    }
    Ok(())
}

/// Errors for configs whose sizes, biases or window the family's HF config cannot state.
fn check_expressible(c: &TransformerConfig, schema: &ConfigSchema) -> Result<()> {
    let arch = c.family.hf_architecture();
    let bad = |field: &str, why: &str| Err(field_error(field, format!("{arch}: {why}")));
    let (qkv, mlp) = (c.add_qkv_bias, c.add_mlp_bias);
    // The biases the family's flags can state, given the q/k/v bias (and the MLP's, for
    // LLaMA's separate `mlp_bias`).
    let expressible = match schema.biases {
        Biases::AttentionAndMlp => [qkv, qkv, mlp],
        Biases::Attention => [qkv, qkv, false],
        Biases::Qkv => [true, false, false],
        Biases::QkvFlag(_) => [qkv, false, false],
        Biases::AllLinears(_) => [qkv, qkv, qkv],
        Biases::Always => [true; 3],
        Biases::Never => [false; 3],
    };
    let have = [
        ("add_qkv_bias", c.add_qkv_bias),
        ("add_proj_bias", c.add_proj_bias),
        ("add_mlp_bias", c.add_mlp_bias),
    ];
    if let Some(((field, value), _)) = have
        .iter()
        .zip(expressible)
        .find(|((_, have), want)| have != want)
    {
        return bad(
            field,
            &format!(
                "{value} is not expressible (the family's biases: {:?})",
                schema.biases
            ),
        );
    }
    let groups_ok = match schema.kv_heads {
        KvHeads::Key => true,
        KvHeads::MultiQuery => {
            c.num_query_groups == 1 || c.num_query_groups == c.num_attention_heads
        }
        KvHeads::PerHead => c.num_query_groups == c.num_attention_heads,
    };
    if !groups_ok {
        return bad(
            "num_query_groups",
            "only the head layouts the family's config names",
        );
    }
    if schema.ffn.is_none() && c.ffn_hidden_size != 4 * c.hidden_size {
        return bad("ffn_hidden_size", "the MLP is always 4 x hidden_size");
    }
    if c.rotary_interleaved != (c.family == ModelFamily::DeepseekV2) {
        return bad("rotary_interleaved", "the rope layout is fixed");
    }
    if !schema.head_dim
        && c.multi_latent_attention.is_none()
        && c.kv_channels != c.hidden_size / c.num_attention_heads
    {
        return bad(
            "kv_channels",
            "the head dim is always hidden_size / num_attention_heads",
        );
    }
    if schema.activation.0.is_none()
        && activation_from_hf(schema.activation.1) != Some(c.activation_func)
    {
        return bad("activation_func", "the activation is fixed");
    }
    if let (None, eps) = schema.eps
        && c.layernorm_epsilon != eps as f32
    {
        return bad(
            "layernorm_epsilon",
            &format!("the norm epsilon is fixed at {eps}"),
        );
    }
    if !schema.sliding_window && c.sliding_window.is_some() {
        return bad(
            "sliding_window",
            "sliding-window attention is not expressible",
        );
    }
    Ok(())
}

/// The original's fields minus [`DERIVED_FIELDS`], after checking it is of `family`.
fn kept_fields(orig: &Value, family: ModelFamily) -> Result<Map<String, Value>> {
    let obj = orig
        .as_object()
        .ok_or_else(|| field_error("<root>", "original config.json: expected a JSON object"))?;
    let orig_family = parse_hf_config(orig)?.config.family;
    if orig_family != family {
        return Err(field_error(
            "architectures",
            format!(
                "the original config.json is {}, the model is {}",
                orig_family.hf_architecture(),
                family.hf_architecture()
            ),
        ));
    }
    let mut kept = obj.clone();
    for key in DERIVED_FIELDS {
        kept.remove(key);
    }
    Ok(kept)
}

/// The shortest decimal that parses back to `x` (f32 `Display` is round-trip shortest).
pub(super) fn finite_f32(field: &str, x: f32) -> Result<Value> {
    if !x.is_finite() {
        return Err(field_error(field, format!("{x} is not a finite number")));
    }
    let shortest: f64 = x.to_string().parse().unwrap_or(f64::from(x));
    Ok(json!(shortest))
}

/// One HF tensor of a model, computed on demand by [`HfTensor::values`]: its rows are row
/// ranges of a Megatron parameter (the whole parameter, or one of q/k/v, gate/up).
#[derive(Clone, Debug)]
pub struct HfTensor<'a> {
    /// HF name, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub name: String,
    /// HF shape: `[out, in]` for linear weights, `[v, h]` for embeddings, `[n]` for norms and
    /// biases.
    pub shape: Vec<usize>,
    src: TensorView<'a>,
    /// Ranges of the source's rows (`shape[1..]` elements each), concatenated in order.
    rows: Vec<Range<usize>>,
}

impl HfTensor<'_> {
    /// Element count.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The values, row-major, widened to f32 (exact for every storage dtype). Allocates only
    /// this tensor.
    pub fn values(&self) -> Vec<f32> {
        let cols: usize = self.shape[1..].iter().product();
        let mut out = Vec::with_capacity(self.numel());
        for r in &self.rows {
            let span = r.start * cols..r.end * cols;
            out.extend_from_slice(&self.src.weight_ref().slice(span).to_f32());
        }
        out
    }
}

/// Every HF tensor of `model` in `save_pretrained`'s naming and order (the declarations'
/// [`crate::module::ParamDecl::hf`]): `model.embed_tokens.weight`, per layer
/// `input_layernorm`, `self_attn.{q,k,v}_proj` (weight, bias when the model has q/k/v
/// biases), `self_attn.o_proj`, `post_attention_layernorm`, `mlp.{gate,up,down}_proj`, then
/// `model.norm.weight` and, when untied, `lm_head.weight`. Nothing is copied until
/// [`HfTensor::values`] is called, so writing the tensors one at a time needs memory for one
/// tensor. This is the exact inverse of [`super::gpt_model_from_hf`].
///
/// # Errors
/// A model that is a tensor-parallel shard or a pipeline stage.
pub fn hf_tensors(model: &GptModel) -> Result<Vec<HfTensor<'_>>> {
    if model.tensor_parallel().is_some() || model.stage_info().is_some() {
        return Err(ModelError::Input(
            "HF export needs the whole model (gather tensor-parallel shards and pipeline stages first)"
                .into(),
        ));
    }
    let mut out = Vec::new();
    for (i, d) in model.layout().decls().iter().enumerate() {
        let src = model.param_table().view(i);
        for part in &d.hf {
            out.push(HfTensor {
                name: part.name.clone(),
                shape: part.shape.clone(),
                src,
                rows: part.rows.clone(),
            });
        }
    }
    Ok(out)
}
