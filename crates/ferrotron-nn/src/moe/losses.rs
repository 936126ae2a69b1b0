//! The router's balancing losses (Megatron-Core `moe_utils.py`): the load-balancing
//! `aux_loss` (Switch Transformer), its counts and the general
//! `switch_load_balancing_loss_func` the per-sequence and global variants use, and the
//! router z-loss (ST-MoE), each with its gradient wrt the router logits.

use super::router::{RouterConfig, ScoreFunction, best, sigmoid, softmax};

/// Megatron's load-balancing `aux_loss` of one layer and its gradient `[T, E]`:
/// `coeff · E / (k · T²) · Σ_e (Σ_t p_te) · c_e`, with `p` the softmax over all experts of the
/// logits (the sigmoid scores normalised per token for sigmoid routers) and `c_e` the tokens
/// whose top-k of `p` holds expert `e` (constant; no group limit, expert bias or capacity:
/// Megatron's `compute_routing_scores_for_aux_loss`). `T` is every token the loss covers;
/// under tensor or context parallelism Megatron sums `T` and `c` over those groups first.
pub fn aux_loss(cfg: &RouterConfig, logits: &[f32], coeff: f32) -> (f32, Vec<f32>) {
    let counts = aux_loss_counts(cfg, logits);
    let t = (logits.len() / cfg.num_experts) as f64;
    switch_load_balancing_loss(cfg, logits, &counts, t, coeff)
}

/// The scores the balancing losses read (`[T]` rows of `[E]`): the softmax over all
/// experts, or the sigmoid scores normalised per token.
fn aux_loss_scores(cfg: &RouterConfig, logits: &[f32]) -> Vec<Vec<f32>> {
    logits
        .chunks_exact(cfg.num_experts)
        .map(|z| match cfg.score_function {
            ScoreFunction::Softmax => softmax(z),
            ScoreFunction::Sigmoid => {
                let s: Vec<f32> = z.iter().map(|&v| sigmoid(v)).collect();
                let sum: f32 = s.iter().sum::<f32>() + 1e-20;
                s.iter().map(|s| s / sum).collect()
            }
        })
        .collect()
}

/// `c_e` of [`aux_loss`] over the `[T, E]` `logits`: the tokens whose top-k of the loss's
/// scores holds expert `e` (Megatron's `routing_map_for_aux_loss` summed over the tokens).
pub fn aux_loss_counts(cfg: &RouterConfig, logits: &[f32]) -> Vec<f64> {
    let mut counts = vec![0f64; cfg.num_experts];
    for p in aux_loss_scores(cfg, logits) {
        best(&p, cfg.topk)
            .into_iter()
            .for_each(|x| counts[x] += 1.0);
    }
    counts
}

/// Megatron's `switch_load_balancing_loss_func` over this rank's `[T, E]` `logits` with the
/// expert counts `tokens_per_expert` and token total `total_tokens` of the level the loss is
/// taken at (the micro-batch for [`aux_loss`]; the global batch, averaged over the
/// micro-batches so far, for `global_aux_loss`): `coeff · E / (k · total²) · Σ_e (Σ_t p_te) ·
/// c_e`, and its gradient wrt the logits (the counts constant).
pub fn switch_load_balancing_loss(
    cfg: &RouterConfig,
    logits: &[f32],
    tokens_per_expert: &[f64],
    total_tokens: f64,
    coeff: f32,
) -> (f32, Vec<f32>) {
    let (e, k) = (cfg.num_experts, cfg.topk);
    let probs = aux_loss_scores(cfg, logits);
    let counts = tokens_per_expert;
    let scale = f64::from(coeff) * e as f64 / (k as f64 * total_tokens * total_tokens);
    // d loss / d p_te = scale · c_e
    let g: Vec<f32> = counts.iter().map(|c| (scale * c) as f32).collect();
    let mut loss = 0f64;
    let mut dz = vec![0f32; logits.len()];
    for ((z, dz), p) in logits
        .chunks_exact(e)
        .zip(dz.chunks_exact_mut(e))
        .zip(&probs)
    {
        loss += p
            .iter()
            .zip(counts)
            .map(|(p, c)| *p as f64 * c)
            .sum::<f64>()
            * scale;
        match cfg.score_function {
            ScoreFunction::Softmax => {
                let dot: f32 = p.iter().zip(&g).map(|(p, g)| p * g).sum();
                dz.iter_mut()
                    .zip(p.iter().zip(&g))
                    .for_each(|(dz, (p, g))| *dz = p * (g - dot));
            }
            ScoreFunction::Sigmoid => {
                // p = s / Σs: dp_i/ds_j = (δ_ij − p_i) / Σs, then ds/dz = s(1 − s).
                let s: Vec<f32> = z.iter().map(|&v| sigmoid(v)).collect();
                let sum: f32 = s.iter().sum::<f32>() + 1e-20;
                let dot: f32 = g.iter().zip(p).map(|(g, p)| g * p).sum();
                dz.iter_mut()
                    .zip(g.iter().zip(&s))
                    .for_each(|(dz, (g, s))| *dz = (g - dot) / sum * s * (1.0 - s));
            }
        }
    }
    (loss as f32, dz)
}

/// ST-MoE's router z-loss (Megatron's `z_loss_func`): `coeff · mean_t(logsumexp(z_t)²)` over
/// the `[T, E]` logits, and its gradient `coeff · 2 · lse_t · softmax(z_t) / T`.
pub fn z_loss(logits: &[f32], num_experts: usize, coeff: f32) -> (f32, Vec<f32>) {
    let t = logits.len() / num_experts;
    let mut loss = 0f64;
    let mut dz = vec![0f32; logits.len()];
    for (z, dz) in logits
        .chunks_exact(num_experts)
        .zip(dz.chunks_exact_mut(num_experts))
    {
        let m = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = m + z.iter().map(|v| (v - m).exp()).sum::<f32>().ln();
        loss += (lse * lse) as f64;
        let g = coeff * 2.0 * lse / t as f32;
        dz.iter_mut()
            .zip(softmax(z))
            .for_each(|(dz, p)| *dz = g * p);
    }
    ((f64::from(coeff) * loss / t as f64) as f32, dz)
}
