//! LoRA (Hu et al. 2021) on the Megatron module tree, as NeMo's `LoRA` transform and
//! `LoRAMerge` (`nemo/collections/llm/peft/lora.py`): [`GptModel::with_lora`] adds adapters
//! to a model and freezes the rest, [`GptModel::merge_lora`] folds them into the base
//! weights, and `peft` maps them to and from a HuggingFace PEFT adapter's tensors.
//!
//! The adapters are parameters declared by the module tree ([`LoraParams`]), so tensor
//! parallelism, pipeline stages, checkpoints and the optimizer's buffer follow from their
//! declarations like any other parameter's; the forward adds `s·(x·Aᵀ)·Bᵀ` to the layer's
//! output and the backward gives `A` and `B` their gradients (`train/lora.rs`).

mod config;
mod peft;
mod served;

pub use config::{LORA_MODULES, LoraConfig};
pub use peft::{PeftTensor, peft_module_names};
pub use served::LoraWeights;

use crate::module::{LinearParams, LoraParams, ModelLayout, ModelPart, ParamRole};
use crate::param_table::ParamValue;
use crate::{GptModel, InitConfig, ModelError, Result};
use ferrotron_tensor::Tensor;

impl GptModel {
    /// This whole model with LoRA adapters on the linear layers `lora` targets: adapters
    /// initialized as NeMo does (`linear_in` Xavier-normal from `init.seed`, `linear_out`
    /// zeros, so the outputs are unchanged), every other parameter frozen (kept as it is,
    /// quantized weights too).
    ///
    /// # Errors
    /// A shard or stage (apply LoRA to the whole model, then split it), a model that has
    /// adapters already, an invalid `lora` (naming the field), or a target that matches no
    /// linear layer of the model (naming it).
    pub fn with_lora(self, lora: LoraConfig, init: &InitConfig) -> Result<GptModel> {
        self.require_whole("LoRA adapters are added")?;
        if self.config().lora.is_some() {
            return Err(ModelError::Input(
                "the model has LoRA adapters already".into(),
            ));
        }
        let mut config = self.config().clone();
        config.lora = Some(lora.clone());
        config.validate()?;
        let layout = ModelLayout::new(
            &config,
            config.vocab_size,
            &ModelPart::whole(config.num_layers),
        );
        self.check_lora_targets(&lora)?;
        let scaled = init.output_layer_init_std(config.num_layers);
        let mut base = self.into_param_table().into_values().into_iter();
        let values = layout
            .decls()
            .iter()
            .map(|d| match d.role {
                ParamRole::Adapter => {
                    Ok(ParamValue::Dense(crate::init::init_param(d, init, scaled)?))
                }
                _ => base
                    .next()
                    .ok_or_else(|| ModelError::Input(format!("{}: no base value", d.name))),
            })
            .collect::<Result<Vec<_>>>()?;
        GptModel::from_values(config, values)
    }

    /// This whole model with every adapter folded into its base weight,
    /// `W += (alpha/rank)·B·A` (NeMo's `LoRAMerge`), in the weights' dtype (rounded to
    /// nearest-even when narrower; a quantized base weight becomes a dense one), and no
    /// adapters: the model HF export and serving without adapters take.
    ///
    /// # Errors
    /// A shard or stage, or a model without adapters.
    pub fn merge_lora(&self) -> Result<GptModel> {
        self.require_whole("LoRA adapters are merged")?;
        let lora =
            self.config().lora.as_ref().ok_or_else(|| {
                ModelError::Input("the model has no LoRA adapters to merge".into())
            })?;
        let scale = lora.scale();
        let mut config = self.config().clone();
        config.lora = None;
        let table = self.param_table();
        let mut values = Vec::new();
        for (i, d) in self.layout().decls().iter().enumerate() {
            if d.role == ParamRole::Adapter {
                continue;
            }
            let adapter = self
                .linear_params()
                .find(|p| p.weight.index() == i)
                .and_then(|p| p.lora);
            let value = match adapter {
                Some(a) => {
                    let mut w = table.f32_values(i).into_owned();
                    self.add_adapter_product(a, scale, &mut w);
                    let dense = Tensor::from_f32(&d.shape, w)?;
                    ParamValue::Dense(dense.to_dtype(self.dtype()))
                }
                None => table.value(i),
            };
            values.push(value);
        }
        GptModel::from_values(config, values)
    }

    /// `w[out, in] += scale·B·A` for adapter `a`.
    fn add_adapter_product(&self, a: LoraParams, scale: f32, w: &mut [f32]) {
        let (a_in, b_out) = (self.param(a.linear_in), self.param(a.linear_out));
        let (r, k) = (a_in.shape()[0], a_in.shape()[1]);
        let n = b_out.shape()[0];
        let b: Vec<f32> = b_out.to_f32().iter().map(|v| v * scale).collect();
        let b = ferrotron_tensor::gemm_bf16::Operand::F32(&b);
        ferrotron_tensor::gemm::matmul_weight(b, a_in.weight_ref(), w, n, r, k, true);
    }

    /// Checks that each of `lora`'s targets matches a linear layer of the model.
    ///
    /// # Errors
    /// [`ModelError::ConfigField`] `lora.target_modules` naming the first target that
    /// matches none.
    fn check_lora_targets(&self, lora: &LoraConfig) -> Result<()> {
        let modules: Vec<&str> = self
            .linear_params()
            .map(|p| {
                let name = &self.layout().decl(p.weight).name;
                name.strip_suffix(".weight").unwrap_or(name)
            })
            .collect();
        match lora
            .target_modules
            .iter()
            .find(|t| !modules.iter().any(|m| config::target_matches(t, m)))
        {
            Some(target) => Err(ModelError::ConfigField {
                field: "lora.target_modules".into(),
                message: format!("`{target}` matches no linear layer of the model"),
            }),
            None => Ok(()),
        }
    }

    /// Every linear layer of the model's layers, in table order.
    pub(crate) fn linear_params(&self) -> impl Iterator<Item = LinearParams> + '_ {
        self.layers().iter().flat_map(|l| l.linears())
    }
}
