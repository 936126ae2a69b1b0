//! [`ParamDecl`]: everything about one parameter that follows from the config alone — its
//! Megatron name, full shape, tensor-parallel split, init, role and HF tensors. Module kinds
//! push their declarations through a [`Declarer`], which hands back the [`ParamId`] the
//! module keeps to find the parameter's values in the model's table.

use std::ops::Range;

use crate::families::HfNames;
use crate::{TpSplit, TransformerConfig};

/// Index of a parameter in its model's table (the order of
/// [`GptModel::parameters`](crate::GptModel::parameters)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParamId(pub(crate) usize);

impl ParamId {
    /// The position in the parameter table (and in every flat per-parameter list: gradients,
    /// optimizer state).
    pub fn index(self) -> usize {
        self.0
    }
}

/// What a parameter is, for the optimizer (weight decay), the storage dtype and init.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamRole {
    /// A `[v, h]` vocabulary table: the word embedding or the untied output layer. Stored in
    /// the model's params dtype.
    Embedding,
    /// A matmul weight (`[out, in]`). Stored in the model's params dtype.
    Weight,
    /// A norm gain, stored in the model's params dtype too (converted to it when loaded in
    /// another); widened to f32 where used. No weight decay by default.
    Norm,
    /// A bias, stored and used as a norm gain. No weight decay by default.
    Bias,
    /// A LoRA adapter matrix (`linear_in: [r, in]` or `linear_out: [out, r]`): the only
    /// trainable parameters of a model with [`crate::TransformerConfig::lora`]. Stored in
    /// the model's params dtype; weight decay as a matmul weight.
    Adapter,
    /// A persistent state tensor that is not trained (Megatron's registered buffers: the MoE
    /// router's `expert_bias`): frozen for the optimizer (no gradient, no state), written by
    /// the trainer, saved in checkpoints. Stored in the params dtype.
    Buffer,
}

impl ParamRole {
    /// Norm gains and biases (Megatron's `no_weight_decay_cond` default: no decay).
    pub fn is_norm_or_bias(self) -> bool {
        matches!(self, ParamRole::Norm | ParamRole::Bias)
    }

    /// Decides the model's params dtype (bf16 under bf16 training): these must all come in
    /// one dtype, and the norm gains and biases are converted to it.
    pub fn uses_params_dtype(self) -> bool {
        matches!(
            self,
            ParamRole::Embedding | ParamRole::Weight | ParamRole::Adapter
        )
    }
}

/// Megatron-Core's initialization of a parameter (`TransformerConfig.init_method` /
/// `output_layer_init_method`; see [`crate::InitConfig`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Init {
    /// `N(0, σ)` (`init_method_normal`).
    Normal,
    /// `N(0, σ / √(2·num_layers))` (`scaled_init_method_normal`): the projections that write
    /// into the residual stream.
    ScaledNormal,
    /// All ones (norm gains).
    Ones,
    /// All zeros (biases, LoRA's `linear_out`).
    Zeros,
    /// `N(0, √(2/(fan_in + fan_out)))` (`torch.nn.init.xavier_normal_`): NeMo's init of
    /// LoRA's `linear_in`.
    XavierNormal,
}

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

/// One parameter of the full model, as its module kind declares it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamDecl {
    /// Megatron name with the global layer index, e.g.
    /// `decoder.layers.0.self_attention.linear_qkv.weight`.
    pub name: String,
    /// Full (unsharded, unpadded) shape.
    pub shape: Vec<usize>,
    /// How tensor parallelism divides it ([`TpSplit::Vocab`] carries the padded vocabulary).
    pub split: TpSplit,
    /// Megatron's initialization.
    pub init: Init,
    /// Embedding table, matmul weight, norm gain or bias.
    pub role: ParamRole,
    /// The decoder layer it belongs to (global index); `None` for the embedding, final norm
    /// and output layer.
    pub layer: Option<usize>,
    /// The HF tensors whose rows make it up (q/k/v interleaved per query group for
    /// `linear_qkv`, gate then up for `linear_fc1`).
    pub hf: Vec<HfPart>,
}

impl ParamDecl {
    /// Element count of the full parameter.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The shape one of `t` tensor-parallel ranks holds.
    pub fn local_shape(&self, t: usize) -> Vec<usize> {
        self.split.local_shape(&self.shape, t)
    }

    /// Whether pipeline stage `stage` of `stages`, holding `layers`, stores it: layers on
    /// their stage, the embedding (and its norm) on the first stage, the final norm and
    /// output layer on the last (a tied model's last-stage embedding copy is a replica,
    /// stored by stage 0).
    pub fn on_stage(&self, stage: usize, stages: usize, layers: &Range<usize>) -> bool {
        match self.layer {
            Some(l) => layers.contains(&l),
            None if self.name.starts_with("embedding.") => stage == 0,
            None => stage + 1 == stages,
        }
    }
}

/// Collects the declarations of one model (or pipeline stage) in table order.
pub(crate) struct Declarer<'c> {
    /// The full model's config.
    pub c: &'c TransformerConfig,
    /// Vocabulary rows after tensor-parallel padding (`c.vocab_size` when unsplit).
    pub padded_vocab: usize,
    /// The family's HF tensor names.
    pub hf: HfNames,
    /// The routed experts declared (an expert-parallel rank's; all when `None`).
    pub experts: Option<super::ExpertShard>,
    /// Whether tensor parallelism splits the experts' widths.
    pub expert_tp: super::ExpertTensorParallel,
    decls: Vec<ParamDecl>,
}

impl<'c> Declarer<'c> {
    pub(crate) fn new(
        c: &'c TransformerConfig,
        padded_vocab: usize,
        experts: Option<super::ExpertShard>,
        expert_tp: super::ExpertTensorParallel,
    ) -> Declarer<'c> {
        Declarer {
            c,
            padded_vocab: padded_vocab.max(c.vocab_size),
            hf: c.family.hf_names(),
            experts,
            expert_tp,
            decls: Vec::new(),
        }
    }

    /// Appends `decl`, returning its id.
    pub(crate) fn push(&mut self, decl: ParamDecl) -> ParamId {
        self.decls.push(decl);
        ParamId(self.decls.len() - 1)
    }

    /// HF prefix of global decoder layer `layer`'s module `name`.
    pub(crate) fn hf_layer(&self, layer: usize, name: &str) -> String {
        format!("{}.{layer}.{name}", self.hf.layers)
    }

    /// Parameters declared so far.
    pub(crate) fn len(&self) -> usize {
        self.decls.len()
    }

    /// The declarations, in table order.
    pub(crate) fn finish(self) -> Vec<ParamDecl> {
        self.decls
    }
}

/// A parameter that is one HF tensor, rows as is.
pub(crate) fn whole(
    name: String,
    hf: String,
    shape: Vec<usize>,
    split: TpSplit,
    init: Init,
    role: ParamRole,
    layer: Option<usize>,
) -> ParamDecl {
    ParamDecl {
        hf: vec![HfPart {
            name: hf,
            shape: shape.clone(),
            rows: super::linear::block(0..shape[0]),
        }],
        name,
        shape,
        split,
        init,
        role,
        layer,
    }
}
