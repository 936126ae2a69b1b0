//! LoRA adapters held apart from the base model, so that one base serves many (S-LoRA, Sheng
//! et al. 2023; vLLM's `LoRAModel` beside its `LoRAModelManager`): a [`LoraWeights`] holds
//! one adapter's matrices for the base's linear layers, and each sequence of a ragged batch
//! names the adapter its rows take ([`crate::RaggedSeq::adapter`]). The base weights are
//! multiplied once for all rows; each adapter adds `scale·(x·Aᵀ)·Bᵀ` to its own rows.
//!
//! The up-projection runs on `Bᵀ` ([`TransposedLoraAdapter`]), so a sequence's logits agree
//! with those of a model with the adapter built in ([`GptModel::with_lora`]) to float
//! rounding, and bit for bit with [`GptModel::forward_with_lora`] of the same adapter (what
//! `generate` runs).

use crate::lora::PeftTensor;
use crate::module::ParamId;
use crate::{GptModel, ModelError, Result};
use ferrotron_nn::TransposedLoraAdapter;
use ferrotron_tensor::Tensor;

/// One LoRA adapter's matrices for the linear layers of a base model (see the module doc).
#[derive(PartialEq)]
pub struct LoraWeights {
    /// `alpha / r`.
    scale: f32,
    rank: usize,
    /// By the base's parameter index: `(A: [r, in], Bᵀ: [r, out])` of each adapted linear
    /// weight, in the base's dtype (`B` transposed for the serving kernel,
    /// [`TransposedLoraAdapter`]).
    adapters: Vec<Option<(Tensor, Tensor)>>,
}

impl std::fmt::Debug for LoraWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoraWeights")
            .field("rank", &self.rank)
            .field("scale", &self.scale)
            .field("num_adapted", &self.num_adapted())
            .field("bytes", &self.bytes())
            .finish()
    }
}

impl LoraWeights {
    /// The rank `r` (a fused layer whose projections have distinct `lora_A`s takes a
    /// multiple of it).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// `alpha / r`.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Linear layers the adapter adapts.
    pub fn num_adapted(&self) -> usize {
        self.adapters.iter().flatten().count()
    }

    /// Bytes of the adapter's matrices.
    pub fn bytes(&self) -> usize {
        let size = |t: &Tensor| t.numel() * t.dtype().size_in_bytes();
        self.adapters
            .iter()
            .flatten()
            .map(|(a, b)| size(a) + size(b))
            .sum()
    }

    /// The adapter of the linear layer whose weight is `weight`, if it adapts that layer.
    pub(crate) fn adapter(&self, weight: ParamId) -> Option<TransposedLoraAdapter<'_>> {
        let (a, b_t) = self.adapters.get(weight.index())?.as_ref()?;
        Some(TransposedLoraAdapter {
            linear_in: a.view(),
            linear_out_t: b_t.view(),
            scale: self.scale,
        })
    }

    /// Checks that the adapter was made for `model`'s parameter table: as many parameters,
    /// and each adapted weight `[out, in]` with `A: [w, in]`, `Bᵀ: [w, out]`, `w` a multiple
    /// of the rank.
    ///
    /// # Errors
    /// [`ModelError::Input`] when it does not fit.
    pub fn check_fits(&self, model: &GptModel) -> Result<()> {
        let decls = model.layout().decls();
        let fits = self.adapters.len() == decls.len()
            && self.adapters.iter().zip(decls).all(|(pair, d)| match pair {
                None => true,
                Some((a, b)) => {
                    let w = a.shape()[0];
                    d.shape.len() == 2
                        && w % self.rank == 0
                        && a.shape() == [w, d.shape[1]]
                        && b.shape() == [w, d.shape[0]]
                }
            });
        match fits {
            true => Ok(()),
            false => Err(ModelError::Input(
                "a LoRA adapter made for another base model was given to this one".into(),
            )),
        }
    }
}

impl GptModel {
    /// A PEFT adapter of rank `r` and `lora_alpha` `alpha` for this base model, from its
    /// tensors (`get(name)` gives the tensor of that name): any subset of the HF projections,
    /// each with its own `lora_A` as PEFT trains them, mapped onto the fused layers exactly
    /// ([`GptModel::stacked_from_peft`]: a fused layer whose projections have distinct
    /// `lora_A`s takes them stacked, rank a multiple of `r`). Stored in the base's dtype, as
    /// [`GptModel::with_lora`] stores adapters, `B` transposed.
    ///
    /// # Errors
    /// A shard or stage, a model that has adapters built in, `r` of 0, a missing or
    /// misshapen tensor (named), or an adapter that adapts no linear layer.
    pub fn lora_weights_from_peft(
        &self,
        r: usize,
        alpha: f32,
        mut get: impl FnMut(&str) -> Option<PeftTensor>,
    ) -> Result<LoraWeights> {
        self.require_whole("LoRA adapters are served")?;
        if self.config().lora.is_some() {
            return Err(ModelError::Input(
                "a model with LoRA adapters built in cannot serve others (use the base)".into(),
            ));
        }
        if r == 0 {
            return Err(ModelError::Input(
                "a LoRA adapter's rank must be > 0".into(),
            ));
        }
        let mut adapters: Vec<Option<(Tensor, Tensor)>> = vec![None; self.layout().decls().len()];
        for p in self.linear_params() {
            let Some((a, b)) = self.stacked_from_peft(p.weight, r, &mut get)? else {
                continue;
            };
            let decl = self.layout().decl(p.weight);
            let [out, inp] = [decl.shape[0], decl.shape[1]];
            let width = a.len() / inp;
            let b_t: Vec<f32> = (0..width * out)
                .map(|i| b[(i % out) * width + i / out])
                .collect();
            let dtype = self.dtype();
            let a = Tensor::from_f32(&[width, inp], a)?.to_dtype(dtype);
            let b_t = Tensor::from_f32(&[width, out], b_t)?.to_dtype(dtype);
            adapters[p.weight.index()] = Some((a, b_t));
        }
        if adapters.iter().all(Option::is_none) {
            return Err(ModelError::Input(
                "the PEFT adapter adapts none of the model's linear layers".into(),
            ));
        }
        Ok(LoraWeights {
            scale: alpha / r as f32,
            rank: r,
            adapters,
        })
    }
}
