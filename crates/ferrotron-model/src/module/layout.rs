//! [`ModelLayout`]: the module tree of a model (or of one pipeline stage) with every
//! parameter's declaration in table order — the one place the parameter order is decided.

use super::decl::{Declarer, ParamDecl, ParamId, ParamRole};
use super::layer::TransformerLayer;
use super::norm::{Norm, declare_vocab_table};
use crate::{OutputHead, ParamHome, TransformerConfig};

/// Which part of the model a layout covers (Megatron-Core `GPTModel(pre_process,
/// post_process)` on one pipeline rank).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelPart {
    /// Global indices of the decoder layers held, in order.
    pub layer_ids: Vec<usize>,
    /// Holds the word embedding and takes token ids.
    pub pre_process: bool,
    /// Holds the final norm and the output layer (the word embedding when tied).
    pub post_process: bool,
    /// The routed experts held: an expert-parallel rank's share, or all of them (`None`).
    pub experts: Option<ExpertShard>,
    /// How a tensor-parallel shard holds them.
    pub expert_tp: ExpertTensorParallel,
}

/// How tensor parallelism holds the routed experts (Megatron's
/// `expert_tensor_parallel_size`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertTensorParallel {
    /// `expert_tensor_parallel_size` = tp: every expert's width is split over the
    /// tensor-parallel ranks, which all run every routed row.
    #[default]
    Split,
    /// `expert_tensor_parallel_size` = 1: each tensor-parallel rank holds its experts whole
    /// and runs them over its own share of the rows (its sequence-parallel rows); their
    /// gradients are summed over the group.
    Whole,
}

/// Expert-parallel rank `rank` of `size` holds experts `rank·E/size .. (rank+1)·E/size` of
/// every MoE layer (Megatron-Core's placement, `expert_model_parallel_size`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertShard {
    pub rank: usize,
    pub size: usize,
}

impl ExpertShard {
    /// The global ids of the experts held out of `num_experts`.
    pub fn experts(self, num_experts: usize) -> std::ops::Range<usize> {
        let local = num_experts / self.size;
        self.rank * local..(self.rank + 1) * local
    }
}

impl ModelPart {
    /// The whole model of `num_layers` layers.
    pub fn whole(num_layers: usize) -> ModelPart {
        ModelPart {
            layer_ids: (0..num_layers).collect(),
            pre_process: true,
            post_process: true,
            experts: None,
            expert_tp: ExpertTensorParallel::Split,
        }
    }
}

/// The modules of a model part and the declarations of their parameters, in table order:
/// the word embedding (first stage, and the last stage of a tied model: its output weight),
/// the decoder layers, then `final_layernorm` and, when untied, `output_layer` (last stage).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelLayout {
    decls: Vec<ParamDecl>,
    /// `[v, h]` (HF `model.embed_tokens`).
    pub embedding: Option<ParamId>,
    /// `[h]` norm of the embeddings (Bloom's `word_embeddings_layernorm`; first stage).
    pub embedding_layernorm: Option<Norm>,
    /// The decoder layers held, in order.
    pub layers: Vec<TransformerLayer>,
    /// `[h]` (HF `model.norm`); set on the last stage.
    pub final_layernorm: Option<Norm>,
    /// `[v, h]`, untied models only (HF `lm_head`); `[1, h]` under
    /// [`OutputHead::Score`] (HF `score`).
    pub output_layer: Option<ParamId>,
    /// The config has LoRA: every parameter but the adapters is frozen.
    frozen_base: bool,
}

impl ModelLayout {
    /// Declares the parameters of `part` of a model of config `c` (assumed valid), the
    /// vocabulary tables split as `padded_vocab` rows over tensor-parallel ranks
    /// (`c.vocab_size` when unsplit).
    pub fn new(c: &TransformerConfig, padded_vocab: usize, part: &ModelPart) -> ModelLayout {
        let mut d = Declarer::new(c, padded_vocab, part.experts, part.expert_tp);
        // A score head is its own weight, whatever the tying of an LM head would be.
        let tied =
            !c.untie_embeddings_and_output_weights && c.output_head == OutputHead::LanguageModel;
        let hf = d.hf;
        let embedding = (part.pre_process || (part.post_process && tied)).then(|| {
            let name = format!("{}.weight", hf.embedding);
            declare_vocab_table(&mut d, "embedding.word_embeddings.weight", &name)
        });
        let embedding_layernorm =
            match hf.embedding_layernorm {
                Some(name) if part.pre_process && c.embedding_layernorm => Some(
                    Norm::declare_hidden(&mut d, "embedding.word_embeddings_layernorm", name, None),
                ),
                _ => None,
            };
        let layers = part
            .layer_ids
            .iter()
            .map(|&i| TransformerLayer::declare(&mut d, i))
            .collect();
        let final_layernorm = part.post_process.then(|| {
            Norm::declare_hidden(&mut d, "decoder.final_layernorm", hf.final_layernorm, None)
        });
        let output_layer = (part.post_process && !tied).then(|| match c.output_head {
            OutputHead::LanguageModel => {
                let name = format!("{}.weight", hf.output_layer);
                declare_vocab_table(&mut d, "output_layer.weight", &name)
            }
            OutputHead::Score => declare_score(&mut d),
        });
        ModelLayout {
            decls: d.finish(),
            embedding,
            embedding_layernorm,
            layers,
            final_layernorm,
            output_layer,
            frozen_base: c.lora.is_some(),
        }
    }

    /// The storage of the parameter at table position `index`: a buffer
    /// ([`ParamRole::Buffer`], f32); frozen under LoRA, every one but the adapters
    /// ([`ParamRole::Adapter`]) and a reward model's score head (trained in full, as PEFT's
    /// `modules_to_save` does for sequence classification); trainable otherwise.
    pub fn home(&self, index: usize) -> ParamHome {
        let head = self.output_layer.is_some_and(|id| id.0 == index)
            && self.decls[index].name == SCORE_WEIGHT;
        match self.decls[index].role {
            ParamRole::Buffer => ParamHome::Buffer,
            role if self.frozen_base && role != ParamRole::Adapter && !head => ParamHome::Frozen,
            _ => ParamHome::Trainable,
        }
    }

    /// Whether the parameter at table position `index` is not trained (see
    /// [`ModelLayout::home`]).
    pub fn is_frozen(&self, index: usize) -> bool {
        self.home(index) != ParamHome::Trainable
    }

    /// Every parameter's declaration, in table order.
    pub fn decls(&self) -> &[ParamDecl] {
        &self.decls
    }

    /// The declarations, consumed.
    pub fn into_decls(self) -> Vec<ParamDecl> {
        self.decls
    }

    /// The declaration of `id`.
    pub fn decl(&self, id: ParamId) -> &ParamDecl {
        &self.decls[id.0]
    }

    /// The id of the parameter at table position `index`, if any.
    pub fn id(&self, index: usize) -> Option<ParamId> {
        (index < self.decls.len()).then_some(ParamId(index))
    }

    /// The logits' weight `[v, h]`: the output layer, or the word embedding when tied
    /// (`None` before the last stage).
    pub fn output_weight(&self) -> Option<ParamId> {
        self.output_layer
            .or(self.embedding.filter(|_| self.final_layernorm.is_some()))
    }

    /// Replicated parameters whose whole gradient one tensor-parallel rank computes while
    /// the others add nothing (the sum over the group in
    /// [`crate::GptModel::finalize_grads`] is that rank's): a reward model's score head and
    /// the MoE routers and shared-expert gates, which read all rows on every rank.
    pub fn single_contributor_params(&self) -> Vec<usize> {
        let score = self
            .output_layer
            .filter(|id| self.decls[id.0].name == SCORE_WEIGHT);
        let moe = self.layers.iter().flat_map(|l| match l.mlp {
            super::LayerMlp::Moe(m) => vec![Some(m.router), m.shared_expert_gate],
            super::LayerMlp::Dense(_) => Vec::new(),
        });
        score
            .into_iter()
            .chain(moe.flatten())
            .map(|id| id.0)
            .collect()
    }

    /// Replicated parameters whose gradient each tensor-parallel rank computes a part of,
    /// even without sequence parallelism: multi-latent attention's down projections and
    /// latent norms (from the rank's heads), and routed experts held whole
    /// ([`super::ExpertTensorParallel::Whole`]: from the rank's share of the rows).
    /// [`crate::GptModel::finalize_grads`] sums them over the group.
    pub fn partial_grad_params(&self) -> Vec<usize> {
        let latents = self.layers.iter().flat_map(|l| match &l.self_attention {
            super::LayerAttention::MultiLatent(m) => m.replicated_params(),
            super::LayerAttention::SelfAttention(_) => Vec::new(),
        });
        let whole_experts = self
            .expert_stacks()
            .filter(|&i| self.decls[i].split == crate::TpSplit::Replicated);
        latents.map(|id| id.0).chain(whole_experts).collect()
    }

    /// Table indices of every MoE layer's routed-expert stacks (`experts.linear_fc1`, then
    /// `experts.linear_fc2`), in layer order.
    pub fn expert_stacks(&self) -> impl Iterator<Item = usize> + '_ {
        self.layers.iter().flat_map(|l| match l.mlp {
            super::LayerMlp::Moe(m) => vec![m.experts_fc1.index(), m.experts_fc2.index()],
            super::LayerMlp::Dense(_) => Vec::new(),
        })
    }

    /// Parameter count, the embedding counted once when tied.
    pub fn num_parameters(&self) -> usize {
        self.decls.iter().map(ParamDecl::numel).sum()
    }

    /// Elements of every matmul weight (the `[out, in]` linear weights of the layers, not the
    /// vocabulary tables): each token costs `2·this` forward FLOPs in them.
    pub fn matmul_weight_elements(&self) -> usize {
        self.decls
            .iter()
            .filter(|d| d.role == ParamRole::Weight)
            .map(ParamDecl::numel)
            .sum()
    }
}

/// The score head's name (Megatron and HF alike).
const SCORE_WEIGHT: &str = "score.weight";

/// The `[1, h]` score head of a reward model (HF `score.weight`, `nn.Linear(h, 1, bias=False)`,
/// init `N(0, σ)` as HF's `initializer_range`), replicated over tensor-parallel ranks.
fn declare_score(d: &mut Declarer<'_>) -> ParamId {
    d.push(super::decl::whole(
        SCORE_WEIGHT.into(),
        SCORE_WEIGHT.into(),
        vec![1, d.c.hidden_size],
        crate::TpSplit::Replicated,
        super::decl::Init::Normal,
        ParamRole::Weight,
        None,
    ))
}
