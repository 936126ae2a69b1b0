//! [`GptModel::update_moe`]: the routing and loss options of a model's MoE layers, changed
//! after it is built (a training run's `[moe]` options on a loaded model).

use crate::{GptModel, ModelError, Result};

impl GptModel {
    /// Changes how the MoE layers train (Megatron's routing and loss options:
    /// `moe_router_load_balancing_type`, the coefficients, capacity and drop policy, the
    /// routing rule); the experts, their sizes and which layers are MoE stay as they are.
    ///
    /// # Errors
    /// A model without MoE layers, an `update` that changes the parameters' layout (experts,
    /// widths, layer pattern, shared expert), or settings [`crate::MoeConfig::validate`]
    /// rejects; the model is unchanged then.
    pub fn update_moe(&mut self, update: impl Fn(&mut crate::MoeConfig)) -> Result<()> {
        let Some(old) = &self.config.moe else {
            return Err(ModelError::Input(
                "MoE options given for a model without MoE layers".into(),
            ));
        };
        let mut new = old.clone();
        update(&mut new);
        let layout = |m: &crate::MoeConfig| {
            (
                m.num_experts(),
                m.moe_ffn_hidden_size,
                m.layer_pattern.clone(),
                m.shared_expert_intermediate_size,
                m.shared_expert_gate,
            )
        };
        if layout(&new) != layout(old) {
            return Err(ModelError::Input(
                "MoE options may change routing and losses, not the experts or which layers                  have them"
                    .into(),
            ));
        }
        new.validate(self.config.num_layers)?;
        // A shard's local settings keep their local widths.
        if let Some(local) = self.local.moe.as_mut() {
            update(local);
        }
        self.config.moe = Some(new);
        Ok(())
    }
}
