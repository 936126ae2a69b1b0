//! llama.cpp tensor names -> HF `LlamaForCausalLM` names and shapes, and the q/k row permutation.
//!
//! Names mirror llama.cpp's `gguf-py/gguf/tensor_mapping.py` (LLaMA rows) and transformers'
//! `GGUF_TO_TRANSFORMERS` weight map. The permutation mirrors `LlamaModel.permute` in llama.cpp's
//! `convert_hf_to_gguf.py` and its inverse `LlamaTensorProcessor._reverse_permute_weights` in
//! transformers' `modeling_gguf_pytorch_utils.py`.

use std::collections::BTreeSet;

use super::config::LlamaGgufConfig;
use super::reader::{GgufFile, tensor_err};
use crate::CheckpointError;

/// How one GGUF tensor becomes one HF tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorPlan {
    /// Name in the GGUF file, e.g. `blk.0.attn_q.weight`.
    pub gguf_name: String,
    /// HF name, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub hf_name: String,
    /// HF (row-major) shape, e.g. `[a * d, h]` for q_proj; the GGUF dims are this reversed.
    pub hf_shape: Vec<u64>,
    /// `Some(n_head)` when the rows must be un-permuted with [`unpermute_qk_rows`] (q uses the
    /// attention head count, k the kv head count).
    pub unpermute_heads: Option<u64>,
}

/// Reorders the rows of a `[rows, cols]` row-major matrix the way llama.cpp's converter does for
/// q_proj/k_proj (`w.reshape(n_head, 2, rows/n_head/2, cols).swapaxes(1, 2)`): within each head,
/// the two rotary halves are interleaved, so output row `h*hd + 2*i + j` is input row
/// `h*hd + j*hd/2 + i` (hd = rows / n_head).
///
/// Returns `None` when `data.len() != rows * cols` or `rows` is not a multiple of `2 * n_head`.
pub fn permute_qk_rows(data: &[f32], rows: usize, cols: usize, n_head: usize) -> Option<Vec<f32>> {
    reorder_rows(data, rows, cols, n_head, false)
}

/// The inverse of [`permute_qk_rows`]: turns llama.cpp's row order back into HF's (transformers'
/// `_reverse_permute_weights`: `w.reshape(n_head, hd/2, 2, cols).swapaxes(2, 1)`). Output row
/// `h*hd + j*hd/2 + i` is input row `h*hd + 2*i + j`.
///
/// Returns `None` when `data.len() != rows * cols` or `rows` is not a multiple of `2 * n_head`.
pub fn unpermute_qk_rows(
    data: &[f32],
    rows: usize,
    cols: usize,
    n_head: usize,
) -> Option<Vec<f32>> {
    reorder_rows(data, rows, cols, n_head, true)
}

/// For each HF row of a `[rows, ..]` q_proj/k_proj with `n_head` heads, the GGUF row it is
/// stored in (the inverse permutation of [`permute_qk_rows`]); `None` when `rows` is not a
/// multiple of `2 * n_head`.
pub fn qk_gguf_rows(rows: usize, n_head: usize) -> Option<Vec<usize>> {
    if n_head == 0 || !rows.is_multiple_of(2 * n_head) {
        return None;
    }
    let hd = rows / n_head;
    let half = hd / 2;
    Some(
        (0..rows)
            .map(|hf_row| {
                let (h, r) = (hf_row / hd, hf_row % hd);
                let (j, i) = (r / half, r % half);
                h * hd + 2 * i + j
            })
            .collect(),
    )
}

fn reorder_rows(
    data: &[f32],
    rows: usize,
    cols: usize,
    n_head: usize,
    inverse: bool,
) -> Option<Vec<f32>> {
    if rows.checked_mul(cols)? != data.len() {
        return None;
    }
    let order = qk_gguf_rows(rows, n_head)?;
    let mut out = vec![0f32; data.len()];
    for (hf_row, &gguf_row) in order.iter().enumerate() {
        let (dst, src) = if inverse {
            (hf_row, gguf_row)
        } else {
            (gguf_row, hf_row)
        };
        out[dst * cols..(dst + 1) * cols].copy_from_slice(&data[src * cols..(src + 1) * cols]);
    }
    Some(out)
}

/// The per-layer tensors: (GGUF suffix, HF suffix).
const LAYER_TENSORS: [(&str, &str); 9] = [
    ("attn_norm.weight", "input_layernorm.weight"),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
];

/// The HF name, HF shape and permutation for GGUF tensor `name`, or `None` if a LLaMA model of
/// this config has no such tensor.
fn map_name(name: &str, c: &LlamaGgufConfig) -> Option<TensorPlan> {
    let (h, v, f) = (c.hidden_size, c.vocab_size, c.intermediate_size);
    let q = c.num_attention_heads.checked_mul(c.head_dim)?;
    let kv = c.num_key_value_heads.checked_mul(c.head_dim)?;
    let plan = |hf: String, shape: Vec<u64>, heads: Option<u64>| TensorPlan {
        gguf_name: name.to_string(),
        hf_name: hf,
        hf_shape: shape,
        unpermute_heads: heads,
    };
    match name {
        "token_embd.weight" => {
            return Some(plan("model.embed_tokens.weight".into(), vec![v, h], None));
        }
        "output_norm.weight" => return Some(plan("model.norm.weight".into(), vec![h], None)),
        "output.weight" => return Some(plan("lm_head.weight".into(), vec![v, h], None)),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, suffix) = rest.split_once('.')?;
    // Only the canonical spelling of the index ("3", not "03" or "+3").
    let i: u64 = layer.parse().ok()?;
    if i.to_string() != layer || i >= c.num_hidden_layers {
        return None;
    }
    let (_, hf_suffix) = LAYER_TENSORS.iter().find(|(g, _)| *g == suffix)?;
    let (shape, heads) = match suffix {
        "attn_norm.weight" | "ffn_norm.weight" => (vec![h], None),
        "attn_q.weight" => (vec![q, h], Some(c.num_attention_heads)),
        "attn_k.weight" => (vec![kv, h], Some(c.num_key_value_heads)),
        "attn_v.weight" => (vec![kv, h], None),
        "attn_output.weight" => (vec![h, q], None),
        "ffn_gate.weight" | "ffn_up.weight" => (vec![f, h], None),
        _ => (vec![h, f], None), // ffn_down.weight
    };
    Some(plan(format!("model.layers.{i}.{hf_suffix}"), shape, heads))
}

/// Plans the conversion of every tensor in `f`, sorted by HF name.
///
/// # Errors
/// [`CheckpointError::Tensor`] for a tensor name a LLaMA model of this config does not have
/// (nothing is silently dropped), a tensor whose shape differs from the config's, or a tensor the
/// model needs that is missing; [`CheckpointError::UnsupportedType`] for a tensor whose ggml type
/// cannot be dequantized.
pub fn plan_llama_tensors(
    f: &GgufFile,
    c: &LlamaGgufConfig,
) -> Result<Vec<TensorPlan>, CheckpointError> {
    let file = f.file_name();
    let mut plans = Vec::with_capacity(f.tensors().len());
    for t in f.tensors() {
        let plan = map_name(&t.name, c).ok_or_else(|| {
            tensor_err(
                file,
                &t.name,
                format!(
                    "unexpected tensor for a llama model with {} layers (refusing to drop it)",
                    c.num_hidden_layers
                ),
            )
        })?;
        if t.shape() != plan.hf_shape {
            return Err(tensor_err(
                file,
                &t.name,
                format!(
                    "GGUF dims {:?} (HF shape {:?}) do not match the config: expected HF shape {:?} for {}",
                    t.dims,
                    t.shape(),
                    plan.hf_shape,
                    plan.hf_name
                ),
            ));
        }
        if !t.ggml_type.is_dequantizable() {
            return Err(CheckpointError::UnsupportedType {
                file: file.to_string(),
                tensor: t.name.clone(),
                ggml_type: t.ggml_type.to_string(),
            });
        }
        plans.push(plan);
    }
    // Every tensor the model needs must be there. Walk the names lazily: the layer count comes
    // from the file and must not size an allocation; the walk stops at the first missing name,
    // which is at most one layer past the number of tensors the file has.
    let present: BTreeSet<&str> = f.tensors().iter().map(|t| t.name.as_str()).collect();
    let fixed = ["token_embd.weight", "output_norm.weight"].map(String::from);
    let layers = (0..c.num_hidden_layers).flat_map(|i| {
        LAYER_TENSORS
            .iter()
            .map(move |(g, _)| format!("blk.{i}.{g}"))
    });
    if let Some(missing) = fixed
        .into_iter()
        .chain(layers)
        .find(|n| !present.contains(n.as_str()))
    {
        return Err(tensor_err(
            file,
            &missing,
            format!(
                "missing: a llama model with {} layers needs it",
                c.num_hidden_layers
            ),
        ));
    }
    plans.sort_by(|a, b| a.hf_name.cmp(&b.hf_name));
    Ok(plans)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_matches_numpy_formula() {
        // n_head = 2, hd = 4, cols = 1: HF rows [0..8). llama.cpp's reshape(2, 2, 2, 1)
        // .swapaxes(1, 2) gives per head [r0, r2, r1, r3].
        let hf: Vec<f32> = (0..8).map(|x| x as f32).collect();
        let g = permute_qk_rows(&hf, 8, 1, 2).unwrap();
        assert_eq!(g, vec![0., 2., 1., 3., 4., 6., 5., 7.]);
        assert_eq!(unpermute_qk_rows(&g, 8, 1, 2).unwrap(), hf);
    }

    #[test]
    fn permutation_round_trip_wide() {
        let (rows, cols, heads) = (24, 5, 3);
        let x: Vec<f32> = (0..rows * cols).map(|x| x as f32 * 0.5).collect();
        let p = permute_qk_rows(&x, rows, cols, heads).unwrap();
        assert_ne!(p, x);
        assert_eq!(unpermute_qk_rows(&p, rows, cols, heads).unwrap(), x);
        assert!(permute_qk_rows(&x, rows, cols, 5).is_none());
        assert!(permute_qk_rows(&x[1..], rows, cols, heads).is_none());
        assert!(permute_qk_rows(&x, rows, cols, 0).is_none());
    }
}
