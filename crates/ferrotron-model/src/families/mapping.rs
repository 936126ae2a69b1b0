//! The Megatron <-> HF tensor mapping of a LLaMA-family model from its config alone (no
//! weights): every Megatron parameter in the order of [`crate::GptModel::parameters`], its
//! full shape, how tensor parallelism splits it, and which HF tensors make up its rows
//! (Pai-Megatron-Patch's `hf2mcore` / `mcore2hf` name maps). Converters stream with it; the
//! HF export of a loaded model ([`super::hf_tensors`]) uses it too.

use std::ops::Range;

use crate::{Result, TpSplit, TransformerConfig};

/// One HF tensor inside a Megatron parameter: its rows are the parameter's rows `rows`,
/// concatenated in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HfPart {
    /// HF name, e.g. `model.layers.0.self_attn.k_proj.weight`.
    pub name: String,
    /// HF shape (`[out, in]`, `[v, h]` or `[n]`).
    pub shape: Vec<usize>,
    /// Row ranges of the Megatron parameter (each row `shape[1..]` elements).
    pub rows: Vec<Range<usize>>,
}

/// One Megatron parameter of the full model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamMapping {
    /// Megatron name, e.g. `decoder.layers.0.self_attention.linear_qkv.weight`.
    pub name: String,
    /// Full shape.
    pub shape: Vec<usize>,
    /// Split over tensor-parallel ranks (the vocabulary padded to the `padded_vocab` given
    /// to [`param_mapping`]).
    pub split: TpSplit,
    /// The decoder layer it belongs to; `None` for the embedding, final norm and output
    /// layer.
    pub layer: Option<usize>,
    /// The HF tensors whose rows make it up (q/k/v interleaved per query group for
    /// `linear_qkv`, gate then up for `linear_fc1`).
    pub hf: Vec<HfPart>,
}

impl ParamMapping {
    /// Element count.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether pipeline stage `stage` of `stages`, holding `layers`, stores it: layers on
    /// their stage, the embedding on the first stage, the final norm and output layer on
    /// the last (a tied model's last-stage embedding copy is a replica, stored by stage 0).
    pub fn on_stage(&self, stage: usize, stages: usize, layers: &Range<usize>) -> bool {
        match self.layer {
            Some(l) => layers.contains(&l),
            None if self.name.starts_with("embedding.") => stage == 0,
            None => stage + 1 == stages,
        }
    }
}

/// Every parameter of a model of config `c` (order of [`crate::GptModel::parameters`]) with
/// its HF tensors; `padded_vocab` rows for the [`TpSplit::Vocab`] splits (`c.vocab_size`
/// when not split, else [`crate::padded_vocab_size`]).
///
/// # Errors
/// An invalid config.
pub fn param_mapping(c: &TransformerConfig, padded_vocab: usize) -> Result<Vec<ParamMapping>> {
    c.validate()?;
    let (h, v) = (c.hidden_size, c.vocab_size);
    let vocab = TpSplit::Vocab {
        padded: padded_vocab.max(v),
    };
    let mut out = vec![whole(
        "embedding.word_embeddings.weight",
        "model.embed_tokens.weight",
        &[v, h],
        vocab,
        None,
    )];
    for i in 0..c.num_layers {
        push_layer(&mut out, c, i);
    }
    out.push(whole(
        "decoder.final_layernorm.weight",
        "model.norm.weight",
        &[h],
        TpSplit::Replicated,
        None,
    ));
    if c.untie_embeddings_and_output_weights {
        out.push(whole(
            "output_layer.weight",
            "lm_head.weight",
            &[v, h],
            vocab,
            None,
        ));
    }
    Ok(out)
}

/// A parameter that is one HF tensor.
fn whole(
    name: &str,
    hf: &str,
    shape: &[usize],
    split: TpSplit,
    layer: Option<usize>,
) -> ParamMapping {
    ParamMapping {
        name: name.into(),
        shape: shape.to_vec(),
        split,
        layer,
        hf: vec![HfPart {
            name: hf.into(),
            shape: shape.to_vec(),
            rows: block(0..shape[0]),
        }],
    }
}

/// A linear layer's weight (`[rows, cols]`) and, when `bias`, its bias (`[rows]`), each made
/// of the HF projections `parts` (HF prefix, row ranges of the Megatron parameter).
fn push_linear(
    out: &mut Vec<ParamMapping>,
    name: &str,
    [rows, cols]: [usize; 2],
    split: TpSplit,
    bias: Option<TpSplit>,
    layer: usize,
    parts: &[(String, Vec<Range<usize>>)],
) {
    let make = |suffix: &str, shape: Vec<usize>, split: TpSplit| ParamMapping {
        name: format!("{name}.{suffix}"),
        shape: shape.clone(),
        split,
        layer: Some(layer),
        hf: parts
            .iter()
            .map(|(prefix, r)| {
                let n: usize = r.iter().map(Range::len).sum();
                let mut hf_shape = vec![n];
                hf_shape.extend_from_slice(&shape[1..]);
                HfPart {
                    name: format!("{prefix}.{suffix}"),
                    shape: hf_shape,
                    rows: r.clone(),
                }
            })
            .collect(),
    };
    out.push(make("weight", vec![rows, cols], split));
    if let Some(bias_split) = bias {
        out.push(make("bias", vec![rows], bias_split));
    }
}

fn push_layer(out: &mut Vec<ParamMapping>, c: &TransformerConfig, i: usize) {
    let (h, d, a, g, f) = (
        c.hidden_size,
        c.kv_channels,
        c.num_attention_heads,
        c.num_query_groups,
        c.ffn_hidden_size,
    );
    let hf = format!("model.layers.{i}");
    let mg = format!("decoder.layers.{i}");
    let norm = |name: &str, hf_name: &str| {
        whole(
            &format!("{mg}.{name}.weight"),
            &format!("{hf}.{hf_name}.weight"),
            &[h],
            TpSplit::Replicated,
            Some(i),
        )
    };
    out.push(norm("input_layernorm", "input_layernorm"));
    // linear_qkv rows: per query group, a/g query heads, then its key head, then its value head.
    let q_rows = (a / g) * d;
    let stride = q_rows + 2 * d;
    let groups = |offset: usize, len: usize| -> Vec<Range<usize>> {
        (0..g)
            .map(|gi| gi * stride + offset..gi * stride + offset + len)
            .collect()
    };
    let rows = TpSplit::Rows { parts: 1 };
    let attn = format!("{hf}.self_attn");
    push_linear(
        out,
        &format!("{mg}.self_attention.linear_qkv"),
        [c.qkv_size(), h],
        rows,
        c.add_qkv_bias.then_some(rows),
        i,
        &[
            (format!("{attn}.q_proj"), groups(0, q_rows)),
            (format!("{attn}.k_proj"), groups(q_rows, d)),
            (format!("{attn}.v_proj"), groups(q_rows + d, d)),
        ],
    );
    push_linear(
        out,
        &format!("{mg}.self_attention.linear_proj"),
        [h, a * d],
        TpSplit::Columns,
        c.add_proj_bias.then_some(TpSplit::Replicated),
        i,
        &[(format!("{attn}.o_proj"), block(0..h))],
    );
    out.push(norm("pre_mlp_layernorm", "post_attention_layernorm"));
    let fc1 = TpSplit::Rows { parts: 2 };
    push_linear(
        out,
        &format!("{mg}.mlp.linear_fc1"),
        [2 * f, h],
        fc1,
        c.add_mlp_bias.then_some(fc1),
        i,
        &[
            (format!("{hf}.mlp.gate_proj"), block(0..f)),
            (format!("{hf}.mlp.up_proj"), block(f..2 * f)),
        ],
    );
    push_linear(
        out,
        &format!("{mg}.mlp.linear_fc2"),
        [h, f],
        TpSplit::Columns,
        c.add_mlp_bias.then_some(TpSplit::Replicated),
        i,
        &[(format!("{hf}.mlp.down_proj"), block(0..h))],
    );
}

/// One row range as a list.
fn block(rows: Range<usize>) -> Vec<Range<usize>> {
    std::iter::once(rows).collect()
}
