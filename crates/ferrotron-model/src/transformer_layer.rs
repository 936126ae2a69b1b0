use crate::{KvCache, TransformerConfig};
use ferrotron_nn::attention::{
    AttentionDims, AttentionMask, core_attention, core_attention_forward_train,
};
use ferrotron_nn::{Linear, RmsNorm, SwiGluMlp};
use ferrotron_tensor::ops::{RopeTable, add_inplace};

/// One pre-norm decoder layer (Megatron `TransformerLayer` with the LLaMA spec):
/// `x += proj(attn(rope(qkv(norm1(x)))))`, then `x += mlp(norm2(x))`.
///
/// `linear_qkv: [g·(a/g + 2)·d, h]` packs, per query group, its `a/g` query heads, then its key
/// head, then its value head (Megatron's layout, so tensor parallelism splits whole groups);
/// `linear_proj: [h, a·d]`.
#[derive(Clone, Debug)]
pub struct TransformerLayer {
    pub input_layernorm: RmsNorm,
    pub linear_qkv: Linear,
    pub linear_proj: Linear,
    pub pre_mlp_layernorm: RmsNorm,
    pub mlp: SwiGluMlp,
}

/// Per-call activation buffers for one forward over `rows = s·b` tokens, reused across layers.
pub(crate) struct LayerScratch {
    norm: Vec<f32>, // [rows, h]
    qkv: Vec<f32>,  // [rows, g·(a/g+2)·d]
    q: Vec<f32>,    // [rows, a, d]
    k: Vec<f32>,    // [rows, g, d]
    v: Vec<f32>,    // [rows, g, d]
    ctx: Vec<f32>,  // [rows, a·d]
    out: Vec<f32>,  // [rows, h]
    fc1: Vec<f32>,  // [rows, 2f]
    act: Vec<f32>,  // [rows, f]
    lse: Vec<f32>,  // [rows, a], prefill only
}

impl LayerScratch {
    pub(crate) fn new(c: &TransformerConfig, rows: usize) -> LayerScratch {
        let (h, d, a, g, f) = (
            c.hidden_size,
            c.kv_channels,
            c.num_attention_heads,
            c.num_query_groups,
            c.ffn_hidden_size,
        );
        LayerScratch {
            norm: vec![0.0; rows * h],
            qkv: vec![0.0; rows * c.qkv_size()],
            q: vec![0.0; rows * a * d],
            k: vec![0.0; rows * g * d],
            v: vec![0.0; rows * g * d],
            ctx: vec![0.0; rows * a * d],
            out: vec![0.0; rows * h],
            fc1: vec![0.0; rows * 2 * f],
            act: vec![0.0; rows * f],
            lse: Vec::new(),
        }
    }
}

/// What every layer of one forward call shares.
pub(crate) struct LayerInputs<'a> {
    pub config: &'a TransformerConfig,
    pub rope: &'a RopeTable,
    /// Position of each of the `s` new tokens (shared by the `b` sequences).
    pub positions: &'a [usize],
    pub batch: usize,
}

impl TransformerLayer {
    /// Runs the layer on the residual stream `x: [s·b, h]` in place, appending this step's keys
    /// and values to `cache` (layer `index`).
    pub(crate) fn forward(
        &self,
        index: usize,
        x: &mut [f32],
        inputs: &LayerInputs<'_>,
        cache: &mut KvCache,
        scratch: &mut LayerScratch,
    ) {
        let c = inputs.config;
        let (a, g, d) = (c.num_attention_heads, c.num_query_groups, c.kv_channels);
        let (s, b) = (inputs.positions.len(), inputs.batch);
        self.input_layernorm.forward(x, &mut scratch.norm);
        self.linear_qkv.forward(&scratch.norm, &mut scratch.qkv);
        split_qkv(
            &scratch.qkv,
            c,
            &mut scratch.q,
            &mut scratch.k,
            &mut scratch.v,
        );
        let row_positions: Vec<usize> = inputs
            .positions
            .iter()
            .flat_map(|&p| std::iter::repeat_n(p, b))
            .collect();
        inputs.rope.apply(&mut scratch.q, &row_positions, a);
        inputs.rope.apply(&mut scratch.k, &row_positions, g);
        let q_offset = cache.len();
        let (keys, values) = cache.append(index, &scratch.k, &scratch.v);
        let dims = AttentionDims {
            sq: s,
            skv: q_offset + s,
            batch: b,
            heads: a,
            groups: g,
            head_dim: d,
            q_offset,
        };
        let mask = AttentionMask {
            sliding_window: c.sliding_window,
            documents: None,
        };
        if s * b > 1 {
            // Prefill: the register-tiled training kernel is ~3x faster on many query rows
            // (its logsumexp output is not needed here).
            scratch.lse.resize(s * b * a, 0.0);
            core_attention_forward_train(
                &scratch.q,
                keys,
                values,
                &mut scratch.ctx,
                &mut scratch.lse,
                dims,
                mask,
            );
        } else {
            // Decode: one query row; the simple kernel avoids transposing the whole cache.
            core_attention(&scratch.q, keys, values, &mut scratch.ctx, dims, mask);
        }
        self.linear_proj.forward(&scratch.ctx, &mut scratch.out);
        add_inplace(x, &scratch.out);
        self.pre_mlp_layernorm.forward(x, &mut scratch.norm);
        self.mlp.forward(
            &scratch.norm,
            &mut scratch.fc1,
            &mut scratch.act,
            &mut scratch.out,
        );
        add_inplace(x, &scratch.out);
    }
}

/// Unpacks `qkv: [rows, g, a/g + 2, d]` into `q: [rows, a, d]`, `k, v: [rows, g, d]`.
fn split_qkv(qkv: &[f32], c: &TransformerConfig, q: &mut [f32], k: &mut [f32], v: &mut [f32]) {
    let (g, hpg, d) = (c.num_query_groups, c.heads_per_group(), c.kv_channels);
    let group = (hpg + 2) * d;
    for (r, row) in qkv.chunks_exact(g * group).enumerate() {
        for (gi, grp) in row.chunks_exact(group).enumerate() {
            let qdst = &mut q[(r * g + gi) * hpg * d..][..hpg * d];
            qdst.copy_from_slice(&grp[..hpg * d]);
            k[(r * g + gi) * d..][..d].copy_from_slice(&grp[hpg * d..(hpg + 1) * d]);
            v[(r * g + gi) * d..][..d].copy_from_slice(&grp[(hpg + 1) * d..]);
        }
    }
}
