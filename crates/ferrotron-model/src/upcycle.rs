//! Upcycling a dense model into a mixture of experts (Komatsuzaki et al. 2023, "Sparse
//! Upcycling"; granular upcycling after He et al. 2024, arXiv:2410.07524), as Megatron-Core's
//! `--moe-use-upcycling` does it (`megatron/core/transformer/moe/upcycling_utils.py`):
//!
//! - every parameter outside the MLPs is copied;
//! - with granularity `G` (`moe_upcycling_granularity`) the dense SwiGLU of width `f` splits
//!   into `G` slices of width `f/G` (slice `j`: gate and up rows `j·f/G ..`, `linear_fc2`
//!   columns `j·f/G ..`), and the `E` experts are `E/G` copies of the `G` slices (expert `e`
//!   is slice `e mod G`); every expert weight is scaled by `s^(1/3)` (a SwiGLU is of degree 3
//!   in its weights), `s = G` for softmax routing over the top-k, `s = (E/G)·G²/k` for
//!   `pre_softmax` routing (whose k weights sum to about `k/E`);
//! - the router is drawn `N(0, σ)` (Megatron keeps the MoE model's random init), then expert
//!   `e` takes row `⌊e/G⌋` of it, so the slices of one copy always score alike.
//!
//! With `G = 1` and softmax routing (Mixtral's) the MoE layer computes exactly the dense MLP:
//! its `k` experts are the same MLP and their weights sum to 1.

use crate::config::{LoadBalancing, MoeConfig, RouterConfig, ScoreFunction};
use crate::init::{InitConfig, init_param};
use crate::module::{LayerMlp, ModelLayout, ModelPart};
use crate::{ActivationFunc, GptModel, ModelError, ModelFamily, Result};
use ferrotron_tensor::Tensor;
use std::collections::HashMap;

/// How [`GptModel::upcycle`] builds the MoE model (Megatron's `--num-experts`,
/// `--moe-router-topk`, `--moe-upcycling-granularity`, ...).
#[derive(Clone, Debug, PartialEq)]
pub struct UpcycleOptions {
    /// Routed experts `E` per layer (a multiple of `granularity`).
    pub num_experts: usize,
    /// Experts per token `k`.
    pub topk: usize,
    /// `G`: each expert is `1/G` of the dense MLP's width (1: whole copies).
    pub granularity: usize,
    /// Route by softmax over all experts without renormalising (Qwen2-MoE style) instead of
    /// over the chosen k (Mixtral). Not expressible as a Mixtral HF model.
    pub pre_softmax: bool,
    /// `moe_aux_loss_coeff` of the result (Megatron's Mixtral recipe: 1e-2).
    pub aux_loss_coeff: f32,
    /// The router's random init (`seed`, `init_method_std`); its dtype is the model's.
    pub init: InitConfig,
}

impl GptModel {
    /// The MoE model upcycled from this dense model (see the module docs): a Mixtral from a
    /// LLaMA or Mistral model, every layer an MoE layer with Megatron's `aux_loss` at
    /// `options.aux_loss_coeff`, weights in this model's dtype.
    ///
    /// # Errors
    /// A shard or stage; a model that already has experts, or LoRA; an MLP that is not a
    /// bias-free SwiGLU; a family without an MoE counterpart; a granularity that does not
    /// divide the MLP width and the expert count; routing options the result rejects.
    pub fn upcycle(&self, options: &UpcycleOptions) -> Result<GptModel> {
        self.require_whole("a model is upcycled")?;
        let c = self.config();
        let bad = |what: String| Err(ModelError::Input(format!("upcycling: {what}")));
        if c.moe.is_some() || c.lora.is_some() {
            return bad("the model must be dense, without LoRA".into());
        }
        if !c.gated_linear_unit || c.activation_func != ActivationFunc::Silu || c.add_mlp_bias {
            return bad("experts are bias-free SwiGLU MLPs; the model's MLP is not".into());
        }
        let family = match c.family {
            ModelFamily::Llama | ModelFamily::Mistral => ModelFamily::Mixtral,
            other => {
                return bad(format!(
                    "{} has no MoE counterpart (LLaMA and Mistral become Mixtral)",
                    other.hf_architecture()
                ));
            }
        };
        let (g, e, f) = (options.granularity, options.num_experts, c.ffn_hidden_size);
        if g == 0 || !f.is_multiple_of(g) || !e.is_multiple_of(g) {
            return bad(format!(
                "moe_upcycling_granularity {g} must divide ffn_hidden_size {f} and \
                 num_experts {e}"
            ));
        }
        let mut config = c.clone();
        config.family = family;
        config.moe = Some(MoeConfig {
            router: RouterConfig {
                num_experts: e,
                topk: options.topk,
                score_function: ScoreFunction::Softmax,
                pre_softmax: options.pre_softmax,
                groups: None,
                scaling_factor: None,
            },
            moe_ffn_hidden_size: f / g,
            layer_pattern: vec![true; c.num_layers],
            shared_expert_intermediate_size: None,
            shared_expert_gate: false,
            load_balancing_type: LoadBalancing::AuxLoss,
            aux_loss_coeff: options.aux_loss_coeff,
            z_loss_coeff: None,
            capacity: None,
            token_dispatcher: Default::default(),
            expert_bias_update_rate: None,
        });
        config.validate()?;
        let layout = ModelLayout::new(
            &config,
            config.vocab_size,
            &ModelPart::whole(config.num_layers),
        );
        let experts = Experts::new(&config, options);
        // Every parameter outside the MLPs: the dense model's of the same name.
        let dense: HashMap<&str, usize> = (self.layout().decls().iter().enumerate())
            .map(|(i, d)| (d.name.as_str(), i))
            .collect();
        let mut params: Vec<Option<Tensor>> = (layout.decls().iter())
            .map(|d| {
                dense
                    .get(d.name.as_str())
                    .map(|&i| self.param_table().view(i).to_tensor())
            })
            .collect();
        // Each MoE layer from the dense layer's MLP.
        for (moe, dense) in layout.layers.iter().zip(self.layers()) {
            let (LayerMlp::Moe(m), LayerMlp::Dense(mlp)) = (moe.mlp, dense.mlp) else {
                return bad(format!("layer {} is not a dense MLP layer", dense.number));
            };
            let router = experts.router(layout.decl(m.router))?;
            let fc1 = experts.fc1(&self.param(mlp.linear_fc1.weight).to_f32());
            let fc2 = experts.fc2(&self.param(mlp.linear_fc2.weight).to_f32());
            for (id, values) in [
                (m.router, router),
                (m.experts_fc1, fc1),
                (m.experts_fc2, fc2),
            ] {
                let t = Tensor::from_f32(&layout.decl(id).shape, values)?.to_dtype(self.dtype());
                params[id.index()] = Some(t);
            }
        }
        let params = params
            .into_iter()
            .zip(layout.decls())
            .map(|(p, d)| {
                p.ok_or_else(|| ModelError::Input(format!("upcycling: no value for {}", d.name)))
            })
            .collect::<Result<Vec<_>>>()?;
        GptModel::new(config, params)
    }
}

/// How the dense MLP becomes the experts.
struct Experts<'o> {
    options: &'o UpcycleOptions,
    /// The dense MLP's width `f`.
    ffn: usize,
    hidden: usize,
    /// The scale of every expert weight, `s^(1/3)`.
    scale: f32,
}

impl Experts<'_> {
    fn new<'o>(c: &crate::TransformerConfig, options: &'o UpcycleOptions) -> Experts<'o> {
        let (g, e, k) = (
            options.granularity as f64,
            options.num_experts as f64,
            options.topk as f64,
        );
        let s = if options.pre_softmax {
            (e / g) * g * g / k
        } else {
            g
        };
        Experts {
            options,
            ffn: c.ffn_hidden_size,
            hidden: c.hidden_size,
            scale: s.cbrt() as f32,
        }
    }

    /// The router `[E, h]` (declared `d`): the MoE model's random init, expert `e` taking
    /// row `e / G`.
    fn router(&self, d: &crate::ParamDecl) -> Result<Vec<f32>> {
        let (g, e, h) = (
            self.options.granularity,
            self.options.num_experts,
            self.hidden,
        );
        let init = InitConfig {
            params_dtype: ferrotron_tensor::DType::F32,
            ..self.options.init
        };
        let random = init_param(d, &init, init.init_method_std)?.to_f32_vec();
        Ok((0..e)
            .flat_map(|x| random[(x / g) * h..][..h].to_vec())
            .collect())
    }

    /// The experts' `linear_fc1` `[E·2f/G, h]` from the dense `[2f, h]` (gate rows, then up
    /// rows): expert `e` holds slice `e mod G` of each, scaled.
    fn fc1(&self, dense: &[f32]) -> Vec<f32> {
        let (g, e, h) = (
            self.options.granularity,
            self.options.num_experts,
            self.hidden,
        );
        let fs = self.ffn / g;
        let rows = |start: usize| dense[start * h..(start + fs) * h].iter();
        (0..e)
            .flat_map(|x| {
                let j = x % g;
                rows(j * fs).chain(rows(self.ffn + j * fs))
            })
            .map(|v| v * self.scale)
            .collect()
    }

    /// The experts' `linear_fc2` `[E·h, f/G]` from the dense `[h, f]`: expert `e` holds
    /// columns slice `e mod G`, scaled.
    fn fc2(&self, dense: &[f32]) -> Vec<f32> {
        let (g, e) = (self.options.granularity, self.options.num_experts);
        let fs = self.ffn / g;
        (0..e)
            .flat_map(|x| {
                let j = x % g;
                dense
                    .chunks_exact(self.ffn)
                    .flat_map(move |row| row[j * fs..(j + 1) * fs].iter())
            })
            .map(|v| v * self.scale)
            .collect()
    }
}
