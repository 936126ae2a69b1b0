//! Megatron's model FLOPs count per training iteration (`num_floating_point_operations` in
//! `megatron/training/training.py`), used for the `throughput per GPU (TFLOP/s/GPU)` of the
//! log line. The GEMM sizes come from the model's parameter declarations
//! ([`ferrotron_model::ModelLayout`]), so a new module kind is counted without a new term.

use ferrotron_model::TransformerConfig;
use ferrotron_model::module::{LayerMlp, ModelLayout, ModelPart};

/// The sizes the FLOPs count looks at.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlopsModel {
    /// Elements of every decoder-layer matmul weight (`[out, in]`) a token goes through: a
    /// token costs 2 FLOPs per element in the forward. An MoE layer's experts count
    /// `topk / E` of their elements (the `topk` experts a token is routed to, Megatron's
    /// `moe_ffn_hidden_size · num_experts_routed_to`), its router in full.
    pub matmul_weights: u64,
    /// `v·h`, the logits' GEMM (the output layer, or the tied embedding).
    pub logit_weights: u64,
    /// `num_layers · a · (d_qk + d_v)`: the widths of core attention's `QKᵀ` (`d_qk`) and
    /// `AV` (`d_v`) products, summed over the layers; each costs `2·s·a·d_x` FLOPs per
    /// token (`d_qk = d_v = d`, but multi-latent attention's `qk_head_dim +
    /// qk_pos_emb_head_dim` and `v_head_dim`).
    pub attention_width: u64,
    /// Elements of the LoRA adapter matrices (0 without LoRA).
    pub adapter_weights: u64,
    /// The matmul weights and the logits' weight are frozen (LoRA): their weight-gradient
    /// GEMMs are not run.
    pub frozen_base: bool,
    /// Each step also runs a forward of the reference model (DPO).
    pub reference_forward: bool,
}

impl From<&TransformerConfig> for FlopsModel {
    fn from(c: &TransformerConfig) -> Self {
        let layout = ModelLayout::new(c, c.vocab_size, &ModelPart::whole(c.num_layers));
        let adapters = (0..layout.decls().len()).filter(|&i| {
            !layout.is_frozen(i)
                && layout.decls()[i].role == ferrotron_model::module::ParamRole::Adapter
        });
        FlopsModel {
            matmul_weights: (layout.matmul_weight_elements() - inactive_experts(c, &layout)) as u64,
            logit_weights: (c.vocab_size * c.hidden_size) as u64,
            attention_width: attention_width(c),
            adapter_weights: adapters.map(|i| layout.decls()[i].numel() as u64).sum(),
            frozen_base: c.lora.is_some(),
            reference_forward: false,
        }
    }
}

/// [`FlopsModel::attention_width`] of `c`.
fn attention_width(c: &TransformerConfig) -> u64 {
    let d_qk = c
        .multi_latent_attention
        .map_or(c.kv_channels, |m| m.query_head_dim());
    (c.num_layers * c.num_attention_heads * (d_qk + c.value_head_dim())) as u64
}

/// Elements of the routed experts a token does not go through: `(E - k) / E` of every MoE
/// layer's expert stacks.
fn inactive_experts(c: &TransformerConfig, layout: &ModelLayout) -> usize {
    let Some(moe) = &c.moe else {
        return 0;
    };
    let (e, k) = (moe.num_experts(), moe.router.topk);
    layout
        .layers
        .iter()
        .filter_map(|l| match l.mlp {
            LayerMlp::Moe(m) => Some(m),
            LayerMlp::Dense(_) => None,
        })
        .map(|m| {
            let n = layout.decl(m.experts_fc1).numel() + layout.decl(m.experts_fc2).numel();
            n / e * (e - k)
        })
        .sum()
}

/// FLOPs of one training iteration (forward + backward) over `batch_size` sequences of
/// `seq_length` tokens: per token `3 · (2·W + 2·v·h + 2·2·s·L·a·d)`, `W` the matmul weight
/// elements. This is Megatron's
/// `12·b·s·L·h² · ((1 + g/n + s/h)·(d·n/h) + (ffn/h)·(3/2 if swiglu) + V/(2·L·h))`
/// written per GEMM: 3 for the forward, weight-gradient and data-gradient GEMMs, 2 FLOPs per
/// multiply-add; attention counts the full `s x s` score matrix (no causal halving), as
/// Megatron does; norms, softmax and element-wise ops are not counted.
///
/// With a frozen base (LoRA) the base's weight-gradient GEMMs are left out (the forward and
/// the data-gradient GEMMs stay; attention's backward is still twice its forward), the
/// adapters count like any weight (`3 · 2·A`); a reference forward (DPO) adds one forward
/// without the adapters.
pub fn num_floating_point_operations(m: &FlopsModel, batch_size: u64, seq_length: u64) -> f64 {
    let s = seq_length as f64;
    let base = 2.0 * m.matmul_weights as f64 + 2.0 * m.logit_weights as f64;
    let attention = 2.0 * s * m.attention_width as f64;
    let adapters = 2.0 * m.adapter_weights as f64;
    let weight_grads = if m.frozen_base { 0.0 } else { base };
    let mut per_token = (base + adapters + attention) // forward
        + (base + adapters + 2.0 * attention) // data gradients
        + (weight_grads + adapters); // weight gradients
    if m.reference_forward {
        per_token += base + attention;
    }
    per_token * batch_size as f64 * s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// L=2, h=64, n=4 heads of d=16, g=2 groups, ffn=128, V=256, SwiGLU, b=2, s=32, counted
    /// GEMM by GEMM: per token and layer QKV `2·64·(64+2·32)` = 16384, output projection
    /// `2·64·64` = 8192, scores + context `2·2·32·64` = 8192, MLP `3·2·64·128` = 49152;
    /// two layers 163840, plus logits `2·64·256` = 32768: 196608 forward FLOPs per token,
    /// x3 for the backward, x64 tokens = 37,748,736 — Megatron's formula gives the same.
    #[test]
    fn matches_a_hand_count_and_megatrons_formula() {
        let c = TransformerConfig::llama(2, 64, 128, 4, 2, 256, 64).unwrap();
        let m = FlopsModel::from(&c);
        assert_eq!(num_floating_point_operations(&m, 2, 32), 37_748_736.0);
        let (b, s, l, h, n, g, d, ffn, v) = (2.0, 32.0, 2.0, 64.0, 4.0, 2.0, 16.0, 128.0, 256.0);
        let megatron = 12.0
            * b
            * s
            * l
            * h
            * h
            * ((1.0 + g / n + s / h) * (d * n / h) + (ffn / h) * 1.5 + v / (2.0 * l * h));
        assert_eq!(num_floating_point_operations(&m, 2, 32), megatron);
        // LoRA: forward and data gradients of everything, no weight gradients of the base,
        // the adapters 3 times. Per token: matmuls 2·W = 163840 - 2·8192 (two layers'
        // attention products), logits 32768, attention 16384.
        let lora = ferrotron_model::LoraConfig {
            rank: 4,
            ..Default::default()
        };
        let mut c = c;
        c.lora = Some(lora);
        let m = FlopsModel::from(&c);
        let (w, v, att) = (163840.0 - 16384.0, 32768.0, 16384.0);
        let a = m.adapter_weights as f64;
        assert!(a > 0.0);
        let want = (w + v + 2.0 * a + att) + (w + v + 2.0 * a + 2.0 * att) + 2.0 * a;
        assert_eq!(num_floating_point_operations(&m, 2, 32), want * 64.0);
        let dpo = FlopsModel {
            reference_forward: true,
            ..m
        };
        let want = want + w + v + att;
        assert_eq!(num_floating_point_operations(&dpo, 2, 32), want * 64.0);
    }

    /// An MoE layer counts the router and `topk` of its `E` experts: 8 experts of width 128,
    /// top-2, cost what a dense MLP of width 256 does, plus the router's `2·h·E` per token.
    #[test]
    fn moe_layers_count_the_experts_a_token_is_routed_to() {
        let mut dense = TransformerConfig::llama(2, 64, 256, 4, 2, 256, 64).unwrap();
        dense.set_family(ferrotron_model::ModelFamily::Mixtral);
        let mut c = dense.clone();
        c.ffn_hidden_size = 128;
        c.moe = Some(ferrotron_model::MoeConfig {
            router: ferrotron_model::RouterConfig {
                num_experts: 8,
                topk: 2,
                score_function: ferrotron_model::ScoreFunction::Softmax,
                pre_softmax: false,
                groups: None,
                scaling_factor: None,
            },
            moe_ffn_hidden_size: 128,
            layer_pattern: vec![true, true],
            shared_expert_intermediate_size: None,
            shared_expert_gate: false,
            load_balancing_type: ferrotron_model::LoadBalancing::AuxLoss,
            aux_loss_coeff: 0.0,
            z_loss_coeff: None,
            capacity: None,
            token_dispatcher: Default::default(),
            expert_bias_update_rate: None,
        });
        dense.set_family(ferrotron_model::ModelFamily::Llama);
        let (moe, dense) = (FlopsModel::from(&c), FlopsModel::from(&dense));
        assert_eq!(moe.matmul_weights, dense.matmul_weights + 2 * 8 * 64);
    }
}
