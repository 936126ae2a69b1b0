//! The model's one layer forward ([`layer_forward`], Megatron `TransformerLayer.forward` /
//! `SelfAttention` / `MLP`), used by training and by generation alike: the KV cache is a
//! mode of attention ([`KeysValues`]). Training keeps each layer's activations for the
//! backward (what Megatron's autograd graph saves), then the fused cross entropy turns the
//! logits into their gradient; what is kept per layer follows
//! [`TransformerConfig::recompute_granularity`] (see [`super::recompute`]). Generation
//! ([`GptModel::forward`]) drops them as it goes.

use super::TrainBatch;
use super::attention::attention_forward;
use super::core_attention::KeysValues;
use super::layer_acts::LayerActs;
use super::lora::PassDropout;
use super::memory::Ledger;
use super::mlp::mlp_forward;
use super::moe::{MoeLossSink, MoeLosses};
use super::norm::{NormLayer, NormStats};
use super::recompute::Keep;
use super::stored::Kept;
use super::tp_ops::{EmbeddingActs, column_input};
use crate::lora::LoraWeights;
use crate::module::{LinearParams, Norm, TransformerLayer};
use crate::pipeline_stage::ChunkPart;
use crate::{GptModel, Result, TpInfo, TransformerConfig};
use ferrotron_nn::attention::DocumentStarts;
use ferrotron_nn::{ContextParallel, Linear};
use ferrotron_tensor::gemm::matmul_weight_t;
use ferrotron_tensor::ops::{RopeTable, add_inplace};
use ferrotron_tensor::quant::QuantRows;
use ferrotron_tensor::{Buffer, DType, Device};
use std::ops::Range;

/// What every layer of one training pass shares: the config, the rotary tables, the position
/// of each row and the batch shape.
pub(crate) struct Pass<'a> {
    /// The model (or stage, or shard) running the pass: its parameters.
    pub model: &'a GptModel,
    /// The sizes this rank computes with.
    pub c: &'a TransformerConfig,
    /// The rotary tables (`None` under ALiBi).
    pub rope: Option<&'a RopeTable>,
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
    /// The context-parallel group of a training pass over a rank's share of the sequence
    /// (`None`: the whole sequence; always for generation).
    pub cp: Option<&'a ContextParallel>,
    /// Keep activations in bf16 (the model trains in bf16; see [`super::stored`]).
    pub narrow: bool,
    /// Where the activations live (the model's device).
    pub device: Device,
    /// Row ranges that take a LoRA adapter apart from the model's own (serving several
    /// adapters over one base, [`crate::lora::LoraWeights`]); empty in training.
    pub adapter_rows: Vec<(Range<usize>, &'a LoraWeights)>,
    /// The LoRA adapters' input dropout of a training pass (from
    /// [`TrainBatch::dropout_keys`]); `None`: no dropout.
    pub lora_dropout: Option<PassDropout>,
    /// Where a training pass's MoE layers add their balancing losses, and their gradient's
    /// scale; `None` in generation (no losses).
    pub moe_losses: Option<MoeLossSink>,
    /// How quantized weights multiply each range of rows (an inference pass's
    /// [`crate::NewTokens`]; covering every row in order); empty: by their number.
    pub quant_rows: Vec<(Range<usize>, QuantRows)>,
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
            cp: model.context_parallel(),
            narrow: model.activation_dtype() == DType::BF16,
            device: model.device(),
            adapter_rows: Vec::new(),
            lora_dropout: PassDropout::new(model, batch),
            moe_losses: None,
            quant_rows: Vec::new(),
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
            cp: None,
            narrow: false,
            device: model.device(),
            adapter_rows: Vec::new(),
            lora_dropout: None,
            moe_losses: None,
            quant_rows: Vec::new(),
        }
    }

    /// This pass with its MoE layers' balancing losses on, their gradient times `scale`
    /// (the micro-batch's loss scale); off for `None` (a forward without a backward).
    pub(crate) fn with_moe_losses(mut self, scale: Option<f32>) -> Pass<'a> {
        if let (Some(scale), Some(_)) = (scale, &self.c.moe) {
            self.moe_losses = Some(MoeLossSink {
                scale,
                losses: Default::default(),
                counts_expert_load: true,
                global_aux: Default::default(),
            });
        }
        self
    }

    /// This pass re-running layers whose forward already ran (full recompute in the
    /// backward): their routed tokens are not counted again, and `global_aux_loss` reads the
    /// counts the forward recorded (`recorded`, [`Activations::global_aux`]).
    pub(crate) fn rerun(mut self, recorded: GlobalAuxCounts) -> Pass<'a> {
        if let Some(sink) = self.moe_losses.as_mut() {
            sink.counts_expert_load = false;
            sink.global_aux = std::sync::Mutex::new(recorded);
        }
        self
    }

    /// The `global_aux_loss` counts this pass's MoE layers recorded.
    pub(crate) fn global_aux_counts(&self) -> GlobalAuxCounts {
        self.moe_losses.as_ref().map_or_else(Default::default, |s| {
            s.global_aux
                .lock()
                .expect("no MoE layer panics holding the sink")
                .clone()
        })
    }

    /// The MoE layers' losses summed so far (zero without MoE layers or losses).
    pub(crate) fn moe_losses(&self) -> MoeLosses {
        self.moe_losses.as_ref().map_or(MoeLosses::default(), |s| {
            *s.losses
                .lock()
                .expect("no MoE layer panics holding the sink")
        })
    }

    /// The linear layer `p` of the pass's model, its adapter's input dropout on in a
    /// training pass with dropout, and the adapters of [`Pass::adapter_rows`] on their rows.
    pub(crate) fn linear(&self, p: LinearParams) -> Linear<'_> {
        let mut linear = self.model.linear(p);
        if let (Some(d), Some(a)) = (&self.lora_dropout, p.lora)
            && linear.lora().is_some()
        {
            let dropout = d.of_adapter(self.model, a, self.tp, linear.in_features());
            linear = linear.with_lora_dropout(dropout);
        }
        if !self.quant_rows.is_empty() {
            linear = linear.with_row_paths(self.quant_rows.clone());
        }
        if self.adapter_rows.is_empty() {
            return linear;
        }
        let adapters = self
            .adapter_rows
            .iter()
            .filter_map(|(rows, w)| Some((rows.clone(), w.adapter(p.weight)?)))
            .collect();
        linear.with_row_lora(adapters)
    }
}

/// What the forward keeps of one layer or group of layers (see [`super::recompute`]).
// One entry per layer at most: the inline `LayerActs` costs a few hundred bytes each.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Saved {
    /// Layer `index` with its activations (all but core attention's under selective recompute).
    Layer { index: usize, acts: LayerActs },
    /// Only the input `[rows, h]` of `layers`, which the backward re-runs (full recompute).
    Input {
        layers: Range<usize>,
        x: Buffer<f32>,
    },
}

/// Everything the backward of one micro-batch reads.
pub(crate) struct Activations {
    /// The model chunk the forward ran.
    pub part: ChunkPart,
    /// The embedding norm's input `[local rows, h]` and statistics (first stage, under
    /// `embedding_layernorm`).
    pub embedding: EmbeddingActs,
    /// Per layer or recomputed group, in layer order.
    pub saved: Vec<Saved>,
    /// Rotary position of each row `[rows]`.
    pub positions: Vec<usize>,
    /// Residual stream after the last layer `[rows, h]`.
    pub x_final: Buffer<f32>,
    /// The final norm's statistics over `x_final` (last stage).
    pub final_stats: Option<NormStats>,
    /// `final_layernorm(x_final)` `[rows, h]` (input of the output layer).
    pub normed_final: Buffer<f32>,
    /// Logits `[rows, v]`, turned into `∂(loss_scale·loss)/∂logits` by the loss.
    pub dlogits: Buffer<f32>,
    /// The loss scale of the micro-batch (the MoE balancing losses' gradient scale, for
    /// layers the backward re-runs); `None` for a forward without a backward.
    pub loss_scale: Option<f32>,
    /// The balancing losses of the MoE layers the forward ran.
    pub moe_losses: MoeLosses,
    /// `global_aux_loss`'s counts of this micro-batch per MoE layer, for a backward that
    /// re-runs layers.
    pub global_aux: GlobalAuxCounts,
}

/// `global_aux_loss`'s average expert counts and global token total of one micro-batch per
/// MoE layer (keyed by its router).
pub(crate) type GlobalAuxCounts =
    std::collections::BTreeMap<crate::module::ParamId, (Vec<f64>, f64)>;

impl GptModel {
    /// Embedding (or, after the first virtual pipeline stage, the previous stage's output
    /// `input`: `[local rows, h]`), the layers of `part` and, on the last virtual stage, the
    /// final norm and the logits (in `dlogits`), saving activations as the config's
    /// recompute setting says (recorded in `ledger`). Before the last stage `x_final` is the
    /// stage's output. `loss_scale` is the balancing losses' gradient scale of a pass a
    /// backward follows; without one (`None`) the MoE layers compute no balancing losses.
    ///
    /// # Errors
    /// Bad token ids, an input of the wrong length or given to the first stage, a failed
    /// collective.
    pub(crate) fn train_forward(
        &self,
        batch: &TrainBatch,
        part: ChunkPart,
        input: Option<Vec<f32>>,
        loss_scale: Option<f32>,
        ledger: &mut Ledger,
    ) -> Result<Activations> {
        let (x, embedding) = self.stage_input(batch, &part, input)?;
        if let Some((e, stats)) = &embedding {
            ledger.hold(e.bytes() + stats.bytes());
        }
        let positions = batch.row_positions();
        ledger.hold(usize_bytes(&positions));
        let (saved, x, moe_losses, global_aux) = {
            let pass = Pass::new(self, &positions, batch).with_moe_losses(loss_scale);
            let (saved, x) = self.layers_forward(&pass, &part, x, ledger)?;
            (saved, x, pass.moe_losses(), pass.global_aux_counts())
        };
        let mut acts = Activations {
            part,
            embedding,
            saved,
            positions,
            x_final: x,
            final_stats: None,
            normed_final: Buffer::default(),
            dlogits: Buffer::default(),
            loss_scale,
            moe_losses,
            global_aux,
        };
        if !acts.part.post_process {
            ledger.hold(acts.x_final.bytes());
            return Ok(acts);
        }
        let (normed, stats) = self.final_norm(acts.x_final.host())?;
        acts.normed_final = column_input(self.tp.as_ref(), normed)?;
        let weight = self.output_weight()?;
        // `v` outputs per row: the (local) vocabulary, or 1 for a score head.
        let (h, v, rows) = (weight.shape()[1], weight.shape()[0], batch.tokens.len());
        acts.dlogits = Buffer::zeros(self.device(), rows * v);
        let (normed, logits) = (acts.normed_final.host(), acts.dlogits.host_mut());
        matmul_weight_t(normed, weight.weight_ref(), logits, rows, v, h, false);
        for t in [&acts.x_final, &acts.normed_final, &acts.dlogits] {
            ledger.hold(t.bytes());
        }
        ledger.hold(stats.bytes());
        acts.final_stats = Some(stats);
        Ok(acts)
    }

    /// The residual stream entering the stage: the embedding (with its norm's input and
    /// statistics) on the first, the previous stage's output `input` after it.
    fn stage_input(
        &self,
        batch: &TrainBatch,
        part: &ChunkPart,
        input: Option<Vec<f32>>,
    ) -> Result<(Buffer<f32>, EmbeddingActs)> {
        let h = self.local_config().hidden_size;
        if let Some(tp) = &self.tp {
            tp.group.local_rows(batch.seq, batch.micro_batch)?;
            let v = self.config().vocab_size;
            if let Some(&bad) = batch.tokens.iter().find(|&&id| id as usize >= v) {
                return Err(crate::ModelError::Input(format!(
                    "train batch: token id {bad} >= vocabulary size {v}"
                )));
            }
        }
        match (input, part.pre_process) {
            (None, true) => self.embed_forward(&batch.tokens),
            (Some(x), false) => {
                let want = self.local_rows(batch)? * h;
                if x.len() != want {
                    return Err(crate::ModelError::Input(format!(
                        "pipeline stage input of {} values, expected {want} (rows x hidden)",
                        x.len()
                    )));
                }
                Ok((Buffer::from_host(x), None))
            }
            (Some(_), true) => Err(crate::ModelError::Input(
                "the first pipeline stage takes token ids, not activations".into(),
            )),
            (None, false) => Err(crate::ModelError::Input(
                "a later pipeline stage needs the previous stage's activations".into(),
            )),
        }
    }

    /// The layers of `part` over the residual stream `x`, saving what the recompute setting
    /// keeps; returns the saved activations and the stage's output.
    fn layers_forward(
        &self,
        pass: &Pass<'_>,
        part: &ChunkPart,
        mut x: Buffer<f32>,
        ledger: &mut Ledger,
    ) -> Result<(Vec<Saved>, Buffer<f32>)> {
        let mut saved = Vec::with_capacity(part.layers.len());
        let c = pass.c;
        for run in c.recompute_runs_within(part.chunk.clone(), &part.layers) {
            match run.keep {
                Keep::Each { core_attention } => {
                    for index in run.layers {
                        let layer = &self.layers()[index];
                        let (acts, y) =
                            layer_forward(layer, pass, x, core_attention, KeysValues::Fresh)?;
                        ledger.hold(acts.bytes());
                        saved.push(Saved::Layer { index, acts });
                        x = y;
                    }
                }
                Keep::Input => {
                    let mut input = None;
                    for index in run.layers.clone() {
                        let layer = &self.layers()[index];
                        let (acts, y) = layer_forward(layer, pass, x, true, KeysValues::Fresh)?;
                        if input.is_none() {
                            input = Some(acts.into_input());
                        }
                        x = y;
                    }
                    if let Some(x) = input {
                        ledger.hold(x.bytes());
                        saved.push(Saved::Input {
                            layers: run.layers,
                            x,
                        });
                    }
                }
            }
        }
        Ok((saved, x))
    }

    /// `final_layernorm` over `x: [rows, h]` (last stage): the normed rows and statistics.
    pub(crate) fn final_norm(&self, x: &[f32]) -> Result<(Buffer<f32>, NormStats)> {
        let norm = self.layout().final_layernorm.ok_or_else(|| {
            crate::ModelError::Input("only the last pipeline stage holds the final norm".into())
        })?;
        NormLayer::new(self, norm).forward(x, self.local_config().hidden_size)
    }
}

/// One layer on the residual stream `x: [local rows, h]` (consumed and saved); returns the
/// saved activations (core attention's output only when `keep_core_attention`) and the layer
/// output. Core attention reads its keys and values as `kv` says. On a tensor-parallel shard
/// the linears are column/row parallel: the linears' inputs are all-gathered along `s` under
/// sequence parallelism (and saved gathered), the row-parallel outputs reduced.
///
/// # Errors
/// A failed tensor-parallel collective.
pub(crate) fn layer_forward(
    layer: &TransformerLayer,
    pass: &Pass<'_>,
    x: Buffer<f32>,
    keep_core_attention: bool,
    kv: KeysValues<'_>,
) -> Result<(LayerActs, Buffer<f32>)> {
    let c = pass.c;
    let (norm1, attn_in) = sublayer_input(pass, layer.input_layernorm, x.host())?;
    let (attn, out) = attention_forward(layer, pass, attn_in.values(), keep_core_attention, kv)?;
    let (post_attn, attn_out) = sublayer_output(pass, layer.post_self_attn_layernorm, out)?;
    let (x_mid, norm2, mlp_in) = if c.parallel_attention_mlp {
        (Buffer::default(), None, None)
    } else {
        let mut x_mid = x.clone();
        add_inplace(x_mid.host_mut(), attn_out.host());
        let (norm2, mlp_in) = sublayer_input(pass, layer.pre_mlp_layernorm, x_mid.host())?;
        (x_mid, norm2, Some(mlp_in))
    };
    let mlp_input = mlp_in.as_ref().unwrap_or(&attn_in).values();
    let (mlp, out) = mlp_forward(&layer.mlp, pass, mlp_input)?;
    let (post_mlp, mlp_out) = sublayer_output(pass, layer.post_mlp_layernorm, out)?;
    let y = if c.parallel_attention_mlp {
        // HF Falcon: `mlp_output += attention_output; output = mlp_output + residual`.
        let mut y = mlp_out;
        add_inplace(y.host_mut(), attn_out.host());
        add_inplace(y.host_mut(), x.host());
        y
    } else {
        let mut y = x_mid.clone();
        add_inplace(y.host_mut(), mlp_out.host());
        y
    };
    let acts = LayerActs {
        x,
        norm1,
        attn_in: attn_in.stored,
        attn,
        post_attn,
        x_mid,
        norm2,
        mlp_in: mlp_in.map(|m| m.stored),
        mlp,
        post_mlp,
    };
    Ok((acts, y))
}

/// A sublayer's input from the residual stream `x: [local rows, h]`: its pre-norm (with the
/// statistics) when the layer has one, then gathered to all rows for the column-parallel
/// linears and kept.
fn sublayer_input(
    pass: &Pass<'_>,
    norm: Option<Norm>,
    x: &[f32],
) -> Result<(Option<NormStats>, Kept)> {
    let (input, stats) = match norm {
        Some(n) => {
            let (out, stats) = NormLayer::new(pass.model, n).forward(x, pass.c.hidden_size)?;
            (out, Some(stats))
        }
        None => (Buffer::from_host(x.to_vec()), None),
    };
    Ok((stats, Kept::new(column_input(pass.tp, input)?, pass.narrow)))
}

/// A sublayer's output `[local rows, h]` through its post-norm when the layer has one:
/// returns (the norm's input and statistics, the output to add to the residual stream).
type PostNormed = (Option<(Buffer<f32>, NormStats)>, Buffer<f32>);
fn sublayer_output(pass: &Pass<'_>, norm: Option<Norm>, out: Buffer<f32>) -> Result<PostNormed> {
    match norm {
        Some(n) => {
            let h = pass.c.hidden_size;
            let (normed, stats) = NormLayer::new(pass.model, n).forward(out.host(), h)?;
            Ok((Some((out, stats)), normed))
        }
        None => Ok((None, out)),
    }
}

/// Bytes of a usize buffer.
pub(crate) fn usize_bytes(t: &[usize]) -> u128 {
    std::mem::size_of_val(t) as u128
}
