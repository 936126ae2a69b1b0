//! The model's one layer forward ([`layer_forward`], Megatron `TransformerLayer.forward` /
//! `SelfAttention` / `MLP`), used by training and by generation alike: the KV cache is a
//! mode of attention ([`KeysValues`]). Training keeps each layer's activations for the
//! backward (what Megatron's autograd graph saves), then the fused cross entropy turns the
//! logits into their gradient; what is kept per layer follows
//! [`TransformerConfig::recompute_granularity`] (see [`super::recompute`]). Generation
//! ([`GptModel::forward`]) drops them as it goes.

use super::TrainBatch;
use super::core_attention::{CoreAttnOut, KeysValues};
use super::memory::Ledger;
use super::recompute::Keep;
use super::stored::{Kept, Stored, element_bytes};
use super::tp_ops::{column_input, row_parallel_forward};
use crate::module::{TransformerLayer, split_qkv};
use crate::pipeline_stage::ChunkPart;
use crate::{GptModel, Result, TpInfo, TransformerConfig};
use ferrotron_nn::attention::DocumentStarts;
use ferrotron_tensor::DType;
use ferrotron_tensor::gemm::matmul_weight_t;
use ferrotron_tensor::ops::{RopeTable, add_inplace, rms_norm, swiglu_packed};
use std::ops::Range;

/// What every layer of one training pass shares: the config, the rotary tables, the position
/// of each row and the batch shape.
pub(crate) struct Pass<'a> {
    /// The model (or stage, or shard) running the pass: its parameters.
    pub model: &'a GptModel,
    /// The sizes this rank computes with.
    pub c: &'a TransformerConfig,
    pub rope: &'a RopeTable,
    /// Rotary position of each row `[rows]`.
    pub positions: &'a [usize],
    /// New tokens per sequence `s`.
    pub seq: usize,
    /// Sequences `b`.
    pub micro_batch: usize,
    /// The batch's document starts, checked once per pass (not per attention call).
    pub documents: Option<DocumentStarts<'a>>,
    /// The tensor-parallel group of a model shard (`None`: a full model).
    pub tp: Option<&'a TpInfo>,
    /// Keep activations in bf16 (the model trains in bf16; see [`super::stored`]).
    pub narrow: bool,
}

impl<'a> Pass<'a> {
    /// The pass of `model` over `batch` (rows at `positions`).
    pub(crate) fn new(
        model: &'a GptModel,
        positions: &'a [usize],
        batch: &'a TrainBatch,
    ) -> Pass<'a> {
        let (c, rope, tp) = (model.local_config(), model.rope(), model.tp.as_ref());
        // Checked by TrainBatch::validate before any pass.
        let documents = batch
            .document_starts
            .as_deref()
            .map(|d| DocumentStarts::new(d, batch.micro_batch).expect("validated document starts"));
        Pass {
            model,
            c,
            rope,
            positions,
            seq: batch.seq,
            micro_batch: batch.micro_batch,
            documents,
            tp,
            narrow: model.activation_dtype() == DType::BF16,
        }
    }

    /// A generation pass of `model` over `s` new tokens of `b` sequences at `positions`
    /// (`[s·b]`): activations stay f32 whatever the weights' dtype (the math HF runs on
    /// upcast weights), no document masks.
    pub(crate) fn generation(
        model: &'a GptModel,
        positions: &'a [usize],
        s: usize,
        b: usize,
    ) -> Pass<'a> {
        Pass {
            model,
            c: model.local_config(),
            rope: model.rope(),
            positions,
            seq: s,
            micro_batch: b,
            documents: None,
            tp: model.tp.as_ref(),
            narrow: false,
        }
    }
}

/// What one decoder layer's backward needs, all over `rows = s·b` tokens in `[s, b]` order.
/// q and k are saved **after** rotary embedding (what core attention consumed); the backward
/// rotates their gradients back with [`RopeTable::apply_inverse`].
pub(crate) struct LayerActs {
    /// Layer input (residual stream) `[local rows, h]`.
    pub x: Vec<f32>,
    /// `1/rms` of `x` per row `[local rows]`.
    pub rstd1: Vec<f32>,
    /// `input_layernorm(x)` `[rows, h]` (input of `linear_qkv`; all rows, gathered under
    /// sequence parallelism).
    pub norm1: Stored,
    /// Queries after rope `[rows, a, d]`.
    pub q: Stored,
    /// Keys after rope `[rows, g, d]`.
    pub k: Stored,
    /// Values `[rows, g, d]`.
    pub v: Stored,
    /// Core attention's output; `None` under selective recompute (recomputed in the backward).
    pub core_attn: Option<CoreAttnOut>,
    /// Residual stream after attention `[local rows, h]`.
    pub x_mid: Vec<f32>,
    /// `1/rms` of `x_mid` `[local rows]`.
    pub rstd2: Vec<f32>,
    /// `pre_mlp_layernorm(x_mid)` `[rows, h]` (input of `linear_fc1`, all rows).
    pub norm2: Stored,
    /// `linear_fc1` output `[rows, 2f]` (rows `[gate | up]`).
    pub fc1: Stored,
    /// SwiGLU output `[rows, f]` (input of `linear_fc2`).
    pub act: Stored,
}

impl LayerActs {
    /// Bytes held (core attention's output included when kept).
    pub(crate) fn bytes(&self) -> u128 {
        let wide = [&self.x, &self.rstd1, &self.x_mid, &self.rstd2];
        let stored = [
            &self.norm1,
            &self.q,
            &self.k,
            &self.v,
            &self.norm2,
            &self.fc1,
            &self.act,
        ];
        wide.iter().map(|t| f32_bytes(t)).sum::<u128>()
            + stored.iter().map(|t| t.bytes()).sum::<u128>()
            + self.core_attn.as_ref().map_or(0, CoreAttnOut::bytes)
    }

    /// Bytes [`layer_forward`] saves per token, core attention's output excluded: f32
    /// `x, x_mid` (`2h`) and `rstd1, rstd2` (2); `norm1, norm2` (`2h`), `q, k, v`
    /// (`(a + 2g)·d`) and `fc1, act` (`3f`) in bf16 when `narrow`, f32 otherwise (in u128, so
    /// no config overflows).
    pub(crate) fn bytes_per_row(c: &TransformerConfig, narrow: bool) -> u128 {
        let [h, a, g, d, f] = [
            c.hidden_size,
            c.num_attention_heads,
            c.num_query_groups,
            c.kv_channels,
            c.ffn_hidden_size,
        ]
        .map(|n| n as u128);
        4 * (2 * h + 2) + element_bytes(narrow) * (2 * h + (a + 2 * g) * d + 3 * f)
    }

    /// The layer input alone (what a recomputed group keeps), the rest freed.
    pub(crate) fn into_input(self) -> Vec<f32> {
        self.x
    }
}

/// What the forward keeps of one layer or group of layers (see [`super::recompute`]).
// One entry per layer at most: the inline `LayerActs` costs a few hundred bytes each.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Saved {
    /// Layer `index` with its activations (all but core attention's under selective recompute).
    Layer { index: usize, acts: LayerActs },
    /// Only the input `[rows, h]` of `layers`, which the backward re-runs (full recompute).
    Input { layers: Range<usize>, x: Vec<f32> },
}

/// Everything the backward of one micro-batch reads.
pub(crate) struct Activations {
    /// The model chunk the forward ran.
    pub part: ChunkPart,
    /// Per layer or recomputed group, in layer order.
    pub saved: Vec<Saved>,
    /// Rotary position of each row `[rows]`.
    pub positions: Vec<usize>,
    /// Residual stream after the last layer `[rows, h]`.
    pub x_final: Vec<f32>,
    /// `1/rms` of `x_final` `[rows]`.
    pub rstd_final: Vec<f32>,
    /// `final_layernorm(x_final)` `[rows, h]` (input of the output layer).
    pub normed_final: Vec<f32>,
    /// Logits `[rows, v]`, turned into `∂(loss_scale·loss)/∂logits` by the loss.
    pub dlogits: Vec<f32>,
}

impl GptModel {
    /// Embedding (or, after the first virtual pipeline stage, the previous stage's output
    /// `input`: `[local rows, h]`), the layers of `part` and, on the last virtual stage, the
    /// final norm and the logits (in `dlogits`), saving activations as the config's
    /// recompute setting says (recorded in `ledger`). Before the last stage `x_final` is the
    /// stage's output.
    ///
    /// # Errors
    /// Bad token ids, an input of the wrong length or given to the first stage, a failed
    /// collective.
    pub(crate) fn train_forward(
        &self,
        batch: &TrainBatch,
        part: ChunkPart,
        input: Option<Vec<f32>>,
        ledger: &mut Ledger,
    ) -> Result<Activations> {
        let c = self.local_config();
        let (h, v) = (c.hidden_size, c.vocab_size);
        let rows = batch.tokens.len();
        if let Some(tp) = &self.tp {
            tp.group.local_rows(batch.seq, batch.micro_batch)?;
            let v = self.config().vocab_size;
            if let Some(&bad) = batch.tokens.iter().find(|&&id| id as usize >= v) {
                return Err(crate::ModelError::Input(format!(
                    "train batch: token id {bad} >= vocabulary size {v}"
                )));
            }
        }
        let mut x = match (input, part.pre_process) {
            (None, true) => self.embed_train(&batch.tokens)?,
            (Some(x), false) => {
                let want = self.local_rows(batch)? * h;
                if x.len() != want {
                    return Err(crate::ModelError::Input(format!(
                        "pipeline stage input of {} values, expected {want} (rows x hidden)",
                        x.len()
                    )));
                }
                x
            }
            (Some(_), true) => {
                return Err(crate::ModelError::Input(
                    "the first pipeline stage takes token ids, not activations".into(),
                ));
            }
            (None, false) => {
                return Err(crate::ModelError::Input(
                    "a later pipeline stage needs the previous stage's activations".into(),
                ));
            }
        };
        let positions = batch.row_positions();
        ledger.hold(usize_bytes(&positions));
        let pass = Pass::new(self, &positions, batch);
        let mut saved = Vec::with_capacity(part.layers.len());
        for run in c.recompute_runs_within(part.chunk.clone(), &part.layers) {
            match run.keep {
                Keep::Each { core_attention } => {
                    for index in run.layers {
                        let (acts, y) = layer_forward(
                            &self.layers()[index],
                            &pass,
                            x,
                            core_attention,
                            KeysValues::Fresh,
                        )?;
                        ledger.hold(acts.bytes());
                        saved.push(Saved::Layer { index, acts });
                        x = y;
                    }
                }
                Keep::Input => {
                    let mut input = None;
                    for index in run.layers.clone() {
                        let (acts, y) = layer_forward(
                            &self.layers()[index],
                            &pass,
                            x,
                            true,
                            KeysValues::Fresh,
                        )?;
                        if input.is_none() {
                            input = Some(acts.into_input());
                        }
                        x = y;
                    }
                    if let Some(x) = input {
                        ledger.hold(f32_bytes(&x));
                        saved.push(Saved::Input {
                            layers: run.layers,
                            x,
                        });
                    }
                }
            }
        }
        if !part.post_process {
            ledger.hold(f32_bytes(&x));
            return Ok(Activations {
                part,
                saved,
                positions,
                x_final: x,
                rstd_final: Vec::new(),
                normed_final: Vec::new(),
                dlogits: Vec::new(),
            });
        }
        let local_rows = x.len() / h;
        let mut rstd_final = vec![0f32; local_rows];
        let mut normed_final = vec![0f32; local_rows * h];
        let fln = self.norm(self.layout().final_layernorm.expect("the last stage"));
        rms_norm(
            &x,
            fln.weight(),
            fln.eps(),
            &mut normed_final,
            Some(&mut rstd_final),
        );
        let normed_final = column_input(pass.tp, normed_final)?;
        let weight = self.output_weight()?;
        let mut dlogits = vec![0f32; rows * v];
        matmul_weight_t(
            &normed_final,
            weight.weight_ref(),
            &mut dlogits,
            rows,
            v,
            h,
            false,
        );
        for t in [&x, &rstd_final, &normed_final, &dlogits] {
            ledger.hold(f32_bytes(t));
        }
        Ok(Activations {
            part,
            saved,
            positions,
            x_final: x,
            rstd_final,
            normed_final,
            dlogits,
        })
    }
}

/// One layer on the residual stream `x: [local rows, h]` (consumed and saved); returns the
/// saved activations (core attention's output only when `keep_core_attention`) and the layer
/// output. Core attention reads its keys and values as `kv` says. On a tensor-parallel shard
/// the linears are column/row parallel: the norm outputs are all-gathered along `s` under
/// sequence parallelism (and saved gathered), the row-parallel outputs reduced.
///
/// # Errors
/// A failed tensor-parallel collective.
pub(crate) fn layer_forward(
    layer: &TransformerLayer,
    pass: &Pass<'_>,
    x: Vec<f32>,
    keep_core_attention: bool,
    kv: KeysValues<'_>,
) -> Result<(LayerActs, Vec<f32>)> {
    let c = pass.c;
    let (h, a, g, d, f) = (
        c.hidden_size,
        c.num_attention_heads,
        c.num_query_groups,
        c.kv_channels,
        c.ffn_hidden_size,
    );
    let rows = pass.positions.len();
    let local_rows = x.len() / h;
    let model = pass.model;
    let n1 = model.norm(layer.input_layernorm);
    let mut rstd1 = vec![0f32; local_rows];
    let mut norm1 = vec![0f32; local_rows * h];
    rms_norm(&x, n1.weight(), n1.eps(), &mut norm1, Some(&mut rstd1));
    let narrow = pass.narrow;
    let norm1 = Kept::new(column_input(pass.tp, norm1)?, narrow);
    let mut qkv = vec![0f32; rows * c.qkv_size()];
    model
        .linear(layer.self_attention.linear_qkv)
        .forward(norm1.values(), &mut qkv);
    let mut q = vec![0f32; rows * a * d];
    let mut k = vec![0f32; rows * g * d];
    let mut v = vec![0f32; rows * g * d];
    split_qkv(&qkv, c, &mut q, &mut k, &mut v);
    drop(qkv);
    pass.rope.apply(&mut q, pass.positions, a);
    pass.rope.apply(&mut k, pass.positions, g);
    let [q, k, v] = [q, k, v].map(|t| Kept::new(t, narrow));
    let (ctx, lse) = match kv {
        KeysValues::Fresh => CoreAttnOut::compute(q.values(), k.values(), v.values(), pass),
        KeysValues::Cached { cache, layer } => {
            CoreAttnOut::compute_cached(q.values(), k.values(), v.values(), cache, layer, pass)
        }
    };
    let proj = model.linear(layer.self_attention.linear_proj);
    let out = row_parallel_forward(pass, &proj, ctx.values())?;
    let core_attn = keep_core_attention.then_some(CoreAttnOut {
        ctx: ctx.stored,
        lse,
    });
    let mut x_mid = x.clone();
    add_inplace(&mut x_mid, &out);
    let n2 = model.norm(layer.pre_mlp_layernorm);
    let mut rstd2 = vec![0f32; local_rows];
    let mut norm2 = vec![0f32; local_rows * h];
    rms_norm(&x_mid, n2.weight(), n2.eps(), &mut norm2, Some(&mut rstd2));
    let norm2 = Kept::new(column_input(pass.tp, norm2)?, narrow);
    let mut fc1 = vec![0f32; rows * 2 * f];
    model
        .linear(layer.mlp.linear_fc1)
        .forward(norm2.values(), &mut fc1);
    let fc1 = Kept::new(fc1, narrow);
    let mut act = vec![0f32; rows * f];
    swiglu_packed(fc1.values(), &mut act, f);
    let act = Kept::new(act, narrow);
    let fc2 = model.linear(layer.mlp.linear_fc2);
    let out = row_parallel_forward(pass, &fc2, act.values())?;
    let mut y = x_mid.clone();
    add_inplace(&mut y, &out);
    let acts = LayerActs {
        x,
        rstd1,
        norm1: norm1.stored,
        q: q.stored,
        k: k.stored,
        v: v.stored,
        core_attn,
        x_mid,
        rstd2,
        norm2: norm2.stored,
        fc1: fc1.stored,
        act: act.stored,
    };
    Ok((acts, y))
}

/// Bytes of an f32 buffer.
pub(crate) fn f32_bytes(t: &[f32]) -> u128 {
    std::mem::size_of_val(t) as u128
}

/// Bytes of a usize buffer.
pub(crate) fn usize_bytes(t: &[usize]) -> u128 {
    std::mem::size_of_val(t) as u128
}
