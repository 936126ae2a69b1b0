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
use crate::module::{ModelLayout, ModelPart};
use crate::{ActivationFunc, GptModel, ModelError, ModelFamily, Result};
use ferrotron_tensor::Tensor;

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
        });
        config.validate()?;
        let layout = ModelLayout::new(
            &config,
            config.vocab_size,
            &ModelPart::whole(config.num_layers),
        );
        let experts = Experts::new(&config, options);
        let dense = self.layout();
        let mut params = Vec::with_capacity(layout.decls().len());
        for d in layout.decls() {
            let copied = dense.decls().iter().position(|x| x.name == d.name);
            let value = match copied {
                Some(i) => self.param_table().view(i).to_tensor(),
                None => experts.param(self, d)?,
            };
            params.push(value);
        }
        GptModel::new(config, params)
    }
}

/// The MoE parameters of the upcycled model, from the dense ones.
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

    /// The value of MoE parameter `d` (a router, or a layer's stacked experts), in `dense`'s
    /// dtype.
    fn param(&self, dense: &GptModel, d: &crate::ParamDecl) -> Result<Tensor> {
        let layer = d.layer.ok_or_else(|| {
            ModelError::Input(format!("upcycling: unexpected parameter {}", d.name))
        })?;
        let mlp = format!("decoder.layers.{layer}.mlp");
        let dense_value = |name: &str| -> Result<Vec<f32>> {
            let i = dense
                .layout()
                .decls()
                .iter()
                .position(|x| x.name == format!("{mlp}.{name}"))
                .ok_or_else(|| ModelError::Input(format!("upcycling: no {mlp}.{name}")))?;
            Ok(dense.param_table().view(i).to_f32().into_owned())
        };
        let (g, e, h) = (
            self.options.granularity,
            self.options.num_experts,
            self.hidden,
        );
        let fs = self.ffn / g;
        let values = if d.name == format!("{mlp}.router.weight") {
            // The MoE model's random router; expert e takes row e / G.
            let init = InitConfig {
                params_dtype: ferrotron_tensor::DType::F32,
                ..self.options.init
            };
            let random = init_param(d, &init, init.init_method_std)?.to_f32_vec();
            (0..e)
                .flat_map(|x| random[(x / g) * h..][..h].to_vec())
                .collect()
        } else if d.name == format!("{mlp}.experts.linear_fc1.weight") {
            let fc1 = dense_value("linear_fc1.weight")?;
            let rows = |start: usize| fc1[start * h..(start + fs) * h].iter();
            (0..e)
                .flat_map(|x| {
                    let j = x % g;
                    rows(j * fs).chain(rows(self.ffn + j * fs))
                })
                .map(|v| v * self.scale)
                .collect()
        } else if d.name == format!("{mlp}.experts.linear_fc2.weight") {
            let fc2 = dense_value("linear_fc2.weight")?;
            (0..e)
                .flat_map(|x| {
                    let j = x % g;
                    fc2.chunks_exact(self.ffn)
                        .flat_map(move |row| row[j * fs..(j + 1) * fs].iter())
                })
                .map(|v| v * self.scale)
                .collect()
        } else {
            return Err(ModelError::Input(format!(
                "upcycling: no rule for {}",
                d.name
            )));
        };
        Ok(Tensor::from_f32(&d.shape, values)?.to_dtype(dense.dtype()))
    }
}
