//! Aux-loss-free load balancing (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing
//! Strategy for Mixture-of-Experts"; Megatron-Core's `moe_router_enable_expert_bias`): each
//! MoE layer's router adds an `[E]` bias to the sigmoid scores when choosing its experts,
//! and after every training step the bias moves toward an even load,
//! `bias += rate · sign(mean − count)` per expert, the counts being the step's routed tokens
//! summed over the data-parallel ranks (Megatron's `get_updated_expert_bias`, fp32).
//!
//! As Megatron's router keeps `local_tokens_per_expert` in the module, the model keeps the
//! counts of its training forwards ([`ExpertLoad`]) until the trainer applies them.

use std::collections::BTreeMap;
use std::sync::Mutex;

use crate::module::{LayerMlp, ParamId};
use crate::{GptModel, Result};

/// The routed-token counts of a model's training forwards since the last update, per MoE
/// layer with an expert bias (keyed by the bias parameter). A clone starts empty.
#[derive(Debug, Default)]
pub(crate) struct ExpertLoad {
    counts: Mutex<BTreeMap<ParamId, Vec<f64>>>,
}

impl Clone for ExpertLoad {
    fn clone(&self) -> Self {
        ExpertLoad::default()
    }
}

impl ExpertLoad {
    /// Adds one layer's routed tokens per expert (`experts`: each kept slot's expert).
    pub(crate) fn add(
        &self,
        bias: ParamId,
        num_experts: usize,
        experts: impl Iterator<Item = u32>,
    ) {
        let mut counts = self
            .counts
            .lock()
            .expect("no pass panics holding the counts");
        let c = counts.entry(bias).or_insert_with(|| vec![0.0; num_experts]);
        experts.for_each(|e| c[e as usize] += 1.0);
    }

    fn take(&self) -> BTreeMap<ParamId, Vec<f64>> {
        std::mem::take(
            &mut self
                .counts
                .lock()
                .expect("no pass panics holding the counts"),
        )
    }
}

/// Megatron's `get_updated_expert_bias` for one layer: `bias + rate · sign(mean − count)`
/// (`sign(0)` = 0), the mean over the experts.
pub fn updated_expert_bias(bias: &[f32], counts: &[f64], rate: f32) -> Vec<f32> {
    let mean = counts.iter().sum::<f64>() / counts.len().max(1) as f64;
    bias.iter()
        .zip(counts)
        .map(|(b, c)| {
            let offset = mean - c;
            let sign = if offset > 0.0 {
                1.0
            } else if offset < 0.0 {
                -1.0
            } else {
                0.0
            };
            b + sign * rate
        })
        .collect()
}

impl GptModel {
    /// The expert-bias buffers of the MoE layers this model holds, in layer order.
    fn expert_biases(&self) -> Vec<ParamId> {
        self.layout()
            .layers
            .iter()
            .filter_map(|l| match l.mlp {
                LayerMlp::Moe(m) => m.expert_bias,
                LayerMlp::Dense(_) => None,
            })
            .collect()
    }

    /// Whether parameter `i` (table order) is a buffer: not trained, saved in checkpoints.
    pub fn is_buffer(&self, i: usize) -> bool {
        self.layout().decls()[i].role == crate::module::ParamRole::Buffer
    }

    /// Whether the model's MoE layers route with an expert bias.
    pub fn has_expert_bias(&self) -> bool {
        !self.expert_biases().is_empty()
    }

    /// Applies the routed-token counts of the training forwards since the last call to the
    /// expert biases (see the module docs) and forgets them: `reduce` first sums the counts
    /// (all layers' back to back, layer order) over the ranks that routed other tokens (the
    /// data-parallel group). Every rank holding the layers calls it (collective through
    /// `reduce`); nothing happens without expert biases.
    ///
    /// The biases are kept in f32 whatever the weights' dtype (a
    /// [`crate::ParamHome::Buffer`], as Megatron's fp32 `expert_bias`).
    ///
    /// # Errors
    /// `reduce`'s error.
    pub fn update_expert_bias(
        &mut self,
        reduce: impl FnOnce(&mut [f64]) -> Result<()>,
    ) -> Result<()> {
        let Some((rate, e)) = self
            .config()
            .moe
            .as_ref()
            .and_then(|m| Some((m.expert_bias_update_rate?, m.num_experts())))
        else {
            return Ok(());
        };
        let biases = self.expert_biases();
        if biases.is_empty() {
            return Ok(());
        }
        let mut counts = self.expert_load.take();
        let mut flat: Vec<f64> = biases
            .iter()
            .flat_map(|b| counts.remove(b).unwrap_or_else(|| vec![0.0; e]))
            .collect();
        reduce(&mut flat)?;
        for (id, c) in biases.into_iter().zip(flat.chunks_exact(e)) {
            let bias = self.f32_param(id).into_owned();
            let name = self.layout().decls()[id.index()].name.clone();
            let updated = updated_expert_bias(&bias, c, rate);
            self.param_table_mut()
                .set_from_f32(id.index(), &name, &updated)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::updated_expert_bias;

    /// Megatron's rule: below-average experts gain `rate`, above-average ones lose it, an
    /// exactly average one keeps its bias.
    #[test]
    fn bias_moves_toward_an_even_load() {
        let got = updated_expert_bias(&[0.0, 0.5, -0.25, 1.0], &[2.0, 6.0, 4.0, 4.0], 1e-3);
        assert_eq!(got, vec![0.001, 0.499, -0.25, 1.0]);
    }
}
