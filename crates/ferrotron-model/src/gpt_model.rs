use crate::module::{LinearParams, ModelLayout, ModelPart, ParamId, TransformerLayer};
use crate::param_table::{ParamTable, ParamValue, dense};
use crate::{
    ModelError, PositionEmbedding, RecomputeGranularity, Result, StageInfo, TpInfo,
    TransformerConfig,
};
use ferrotron_nn::attention::alibi_slopes;
use ferrotron_nn::{Embedding, Linear, LoraAdapter, NnError};
use ferrotron_tensor::ops::{RopeTable, RotaryLayout};
use ferrotron_tensor::{DType, Device, Tensor, TensorView};
use std::borrow::Cow;

/// A decoder-only transformer (Megatron `GPTModel`): embedding, decoder layers, final norm
/// and the output layer (the embedding table itself when tied) — the whole model, or one
/// rank's part of it: a tensor-parallel shard ([`GptModel::tensor_parallel_shard`]) and/or a
/// pipeline stage ([`GptModel::pipeline_stage`]).
///
/// The module tree ([`ModelLayout`]) says where each parameter sits in the parameter table;
/// the table holds this rank's values (local shapes) in that order.
#[derive(Clone, Debug)]
pub struct GptModel {
    /// The whole model's config.
    pub(crate) config: TransformerConfig,
    /// The sizes this rank computes with: heads, query groups, FFN size and (padded)
    /// vocabulary divided by the tensor-parallel size, `num_layers` the layers held.
    pub(crate) local: TransformerConfig,
    layout: ModelLayout,
    /// Parameter values in table order, each of its declaration's local shape, in one
    /// flat storage of one dtype.
    params: ParamTable,
    /// Rotary tables (`position_embedding_type` rope).
    rope: Option<RopeTable>,
    /// ALiBi slopes of this rank's query heads `[a/t]` (`position_embedding_type` alibi).
    alibi_slopes: Option<Vec<f32>>,
    /// Set on a tensor-parallel shard.
    pub(crate) tp: Option<TpInfo>,
    /// Set on a pipeline stage.
    pub(crate) stage: Option<StageInfo>,
    /// Set on an expert-parallel shard.
    pub(crate) ep: Option<crate::ExpertParallel>,
    /// Set on a context-parallel rank (`crate::context_parallel`).
    pub(crate) cp: Option<ferrotron_nn::ContextParallel>,
    /// The LoRA adapters take part in the passes (PEFT's `disable_adapter()` turns this off
    /// for a DPO reference forward); true when built.
    adapters_enabled: bool,
    /// The routed-token counts of the training forwards for the expert biases (Megatron's
    /// router `local_tokens_per_expert`); empty in a clone.
    pub(crate) expert_load: crate::expert_bias::ExpertLoad,
    /// The `global_aux_loss` counts of the step so far and their group.
    pub(crate) global_aux: crate::global_aux::GlobalAux,
}

/// Checks `params` (this rank's values, table order) against their declarations over `t`
/// tensor-parallel ranks: count, local shapes, one storage dtype for the embedding and matmul
/// weights. Returns them packed in a table of that dtype: norm gains and biases in another
/// dtype are converted to it (as HF's `model.to(dtype)` and Megatron's bf16 params do).
fn check_params(layout: &ModelLayout, params: Vec<ParamValue>, t: usize) -> Result<ParamTable> {
    let decls = layout.decls();
    if params.len() != decls.len() {
        return Err(ModelError::Input(format!(
            "{} parameter tensors given, the model declares {}",
            params.len(),
            decls.len()
        )));
    }
    let dense = |p: &ParamValue| match p {
        ParamValue::Dense(t) => Some(t.dtype()),
        ParamValue::Quantized(_) => None,
    };
    let dtype = decls
        .iter()
        .zip(&params)
        .filter(|(d, _)| d.role.uses_params_dtype())
        .find_map(|(_, p)| dense(p))
        .unwrap_or(DType::F32);
    for (decl, p) in decls.iter().zip(&params) {
        let want = decl.local_shape(t);
        if p.shape() != want {
            return Err(NnError::ParamShape {
                name: decl.name.clone(),
                expected: want,
                actual: p.shape(),
            }
            .into());
        }
        if let ParamValue::Quantized(_) = p
            && !decl.role.uses_params_dtype()
        {
            return Err(ModelError::Input(format!(
                "{}: only matmul and embedding weights can stay quantized",
                decl.name
            )));
        }
        if let Some(p_dtype) = dense(p)
            && decl.role.uses_params_dtype()
            && p_dtype != dtype
        {
            return Err(ModelError::Input(format!(
                "{}: stored as {p_dtype:?}, the model's other weights as {dtype:?}",
                decl.name,
            )));
        }
    }
    let homes: Vec<_> = (0..decls.len()).map(|i| layout.home(i)).collect();
    Ok(ParamTable::packed(params, dtype, &homes))
}

impl GptModel {
    /// The whole model of `config` from its parameter values in table order
    /// ([`ModelLayout::new`] of the whole model: [`GptModel::parameters`]' order). Embedding
    /// and matmul weights share one storage dtype; norm gains and biases are widened to f32.
    ///
    /// # Errors
    /// An invalid config, a count or shape that disagrees with the declarations (naming the
    /// parameter), or weights of mixed dtypes.
    pub fn new(config: TransformerConfig, params: Vec<Tensor>) -> Result<GptModel> {
        GptModel::from_values(config, dense(params))
    }

    /// As [`GptModel::new`], with weights that may stay quantized ([`ParamValue::Quantized`]:
    /// a GGUF file's blocks, multiplied by int8 dot kernels and never dequantized whole).
    /// Dense values share one storage dtype as in [`GptModel::new`].
    ///
    /// # Errors
    /// As [`GptModel::new`]; a quantized value for a norm gain or a bias.
    pub fn from_values(config: TransformerConfig, params: Vec<ParamValue>) -> Result<GptModel> {
        config.validate()?;
        let layout = ModelLayout::new(
            &config,
            config.vocab_size,
            &ModelPart::whole(config.num_layers),
        );
        GptModel::assemble(config, layout, params, None, None)
    }

    /// A model part from `layout` (built for `config`, `tp` and `stage`) and its local
    /// values; checks every value against its declaration.
    pub(crate) fn assemble(
        config: TransformerConfig,
        layout: ModelLayout,
        params: Vec<ParamValue>,
        tp: Option<TpInfo>,
        stage: Option<StageInfo>,
    ) -> Result<GptModel> {
        let t = tp.as_ref().map_or(1, |tp| tp.group.size());
        let params = check_params(&layout, params, t)?;
        let mut local = config.clone();
        if let Some(tp) = &tp {
            local.num_attention_heads /= t;
            local.num_query_groups /= t;
            local.ffn_hidden_size /= t;
            local.vocab_size = tp.padded_vocab / t;
            if let Some(moe) = local.moe.as_mut() {
                // Megatron's expert tensor parallelism (`expert_tensor_parallel_size` = tp):
                // each expert's inner width split (or whole at 1); the shared expert's
                // always, as a dense MLP's.
                if tp.experts == crate::module::ExpertTensorParallel::Split {
                    moe.moe_ffn_hidden_size /= t;
                }
                moe.shared_expert_intermediate_size =
                    moe.shared_expert_intermediate_size.map(|f| f / t);
            }
        }
        local.num_layers = layout.layers.len();
        let (rope, alibi_slopes) = match local.position_embedding_type {
            PositionEmbedding::Rope => (
                Some(
                    RopeTable::new(
                        local.rotary_dim(),
                        local.rotary_base,
                        &local.rope_scaling,
                        local.max_position_embeddings,
                    )
                    .with_layout(if local.rotary_interleaved {
                        RotaryLayout::Interleaved
                    } else {
                        RotaryLayout::RotateHalf
                    }),
                ),
                None,
            ),
            PositionEmbedding::Alibi => {
                let (heads, rank) = (
                    local.num_attention_heads,
                    tp.as_ref().map_or(0, |tp| tp.group.rank()),
                );
                let all = alibi_slopes(config.num_attention_heads);
                (None, Some(all[rank * heads..][..heads].to_vec()))
            }
        };
        Ok(GptModel {
            config,
            local,
            layout,
            params,
            rope,
            alibi_slopes,
            tp,
            stage,
            ep: None,
            cp: None,
            adapters_enabled: true,
            expert_load: Default::default(),
            global_aux: Default::default(),
        })
    }

    /// The whole model's config (also on a shard or a stage).
    pub fn config(&self) -> &TransformerConfig {
        &self.config
    }

    /// The sizes this rank computes with: on a tensor-parallel shard heads, query groups, FFN
    /// size and (padded) vocabulary divided by the tensor-parallel size; `num_layers` the
    /// decoder layers held (a pipeline stage's). The whole model's own config otherwise.
    pub fn local_config(&self) -> &TransformerConfig {
        &self.local
    }

    /// Sets Megatron's `recompute_granularity` for the training passes.
    ///
    /// # Errors
    /// A `recompute_num_layers` outside `1..=num_layers` of a model chunk.
    pub fn set_recompute_granularity(&mut self, r: Option<RecomputeGranularity>) -> Result<()> {
        let mut local = self.local.clone();
        local.recompute_granularity = r;
        local.validate_recompute()?;
        self.config.recompute_granularity = r;
        self.local = local;
        Ok(())
    }

    /// The module tree and every parameter's declaration.
    pub fn layout(&self) -> &ModelLayout {
        &self.layout
    }

    /// The decoder layers held, in order.
    pub fn layers(&self) -> &[TransformerLayer] {
        &self.layout.layers
    }

    /// Storage dtype of every parameter (norm gains and biases too; the kernels widen them
    /// to f32 where they are used).
    pub fn dtype(&self) -> DType {
        self.params.dtype()
    }

    /// Where the parameters, and so the activations, live.
    pub fn device(&self) -> Device {
        Device::Cpu
    }

    /// This rank's values of parameter `id`.
    pub fn param(&self, id: ParamId) -> TensorView<'_> {
        self.params.view(id.index())
    }

    /// Errors unless this is a whole model (not a shard or a stage): `what` happens on the
    /// whole model (a model transform, then split).
    pub(crate) fn require_whole(&self, what: &str) -> Result<()> {
        if self.tp.is_some() || self.stage.is_some() {
            return Err(ModelError::Input(format!(
                "{what} on the whole model, not a tensor-parallel shard or pipeline stage"
            )));
        }
        Ok(())
    }

    /// The parameter table, consumed.
    pub(crate) fn into_param_table(self) -> ParamTable {
        self.params
    }

    /// The parameter table (this rank's values in table order).
    pub fn param_table(&self) -> &ParamTable {
        &self.params
    }

    /// The parameter table, mutable: re-homing it into the optimizer's buffer and lending
    /// its storage ([`ParamTable::rehome`], [`ParamTable::take_storage`]).
    pub fn param_table_mut(&mut self) -> &mut ParamTable {
        &mut self.params
    }

    /// A norm gain or a bias as f32 (widened when the table is narrower).
    pub(crate) fn f32_param(&self, id: ParamId) -> Cow<'_, [f32]> {
        self.params.f32_values(id.index())
    }

    /// The linear layer `p` over this rank's values.
    pub(crate) fn linear(&self, p: LinearParams) -> Linear<'_> {
        let linear = Linear::new(self.param(p.weight), p.bias.map(|b| self.f32_param(b)));
        match self.lora_adapter(p) {
            Some(adapter) => linear.with_lora(adapter),
            None => linear,
        }
    }

    /// Turns the LoRA adapters on or off for the passes that follow (PEFT's
    /// `disable_adapter()`): with them off the model computes what its frozen base does, as
    /// DPO's reference. Backward passes must run with the setting of their forward.
    pub fn set_adapters_enabled(&mut self, enabled: bool) {
        self.adapters_enabled = enabled;
    }

    /// Whether the LoRA adapters take part in the passes.
    pub fn adapters_enabled(&self) -> bool {
        self.adapters_enabled
    }

    /// The LoRA adapter of the linear layer `p`, if it has one and adapters are enabled.
    pub(crate) fn lora_adapter(&self, p: LinearParams) -> Option<LoraAdapter<'_>> {
        if !self.adapters_enabled {
            return None;
        }
        let (a, lora) = (p.lora?, self.config.lora.as_ref()?);
        Some(LoraAdapter {
            linear_in: self.param(a.linear_in),
            linear_out: self.param(a.linear_out),
            scale: lora.scale(),
            dropout: None,
        })
    }

    /// The word embedding table (first stage, and the last stage of a tied model).
    pub(crate) fn word_embedding(&self) -> Result<Embedding<'_>> {
        let id = self.layout.embedding.ok_or_else(|| {
            ModelError::Input("this pipeline stage does not hold the word embedding".into())
        })?;
        Ok(Embedding::new(self.param(id)))
    }

    /// The logits' weight `[v, h]` (the embedding table when tied): last stage only.
    pub(crate) fn output_weight(&self) -> Result<TensorView<'_>> {
        let id = self.layout.output_weight().ok_or_else(|| {
            ModelError::Input("only the last pipeline stage computes logits".into())
        })?;
        Ok(self.param(id))
    }

    /// The rotary tables (`[max_position_embeddings, d/2]` cos and sin); `None` under ALiBi.
    pub fn rope(&self) -> Option<&RopeTable> {
        self.rope.as_ref()
    }

    /// The ALiBi slopes of this rank's query heads `[a/t]`; `None` under rope.
    pub fn alibi_slopes(&self) -> Option<&[f32]> {
        self.alibi_slopes.as_deref()
    }
}
