//! Top-k routing of tokens to experts and the routers' auxiliary losses, as Megatron-Core's
//! `topk_routing_with_score_function`, `group_limited_topk`, `switch_load_balancing_loss_func`
//! and `z_loss_func` (`megatron/core/transformer/moe/moe_utils.py`), in f32 (Megatron's
//! `--moe-router-dtype fp32`), each with its backward.
//!
//! Per token, over its `E` router logits `z`:
//! - softmax (Mixtral): top-k of `z`, probabilities the softmax over the k chosen logits
//!   (renormalised);
//! - `pre_softmax` (Qwen2-MoE, OLMoE, DeepSeek-V2): `p = softmax(z)` over all `E`, top-k of
//!   `p`, probabilities `p` there (not renormalised);
//! - sigmoid (DeepSeek-V3): `s = sigmoid(z)`, top-k of `s + expert_bias` (aux-loss-free
//!   balancing), probabilities the unbiased `s` there, divided by their sum `+ 1e-20` when
//!   `k > 1`;
//!
//! then × `moe_router_topk_scaling_factor`. Group-limited routing keeps the `group_topk` best
//! of `num_groups` equal groups of experts before the top-k: a group scores the sum of its
//! best `k / group_topk` scores (Megatron) or its best score (DeepSeek-V2's
//! `group_limited_greedy`, [`GroupScore::Max`]). Ties go to the lower expert id.

use crate::{NnError, Result};

/// How routing scores come from the logits (`--moe-router-score-function`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScoreFunction {
    /// Softmax over the chosen k (or over all experts with `pre_softmax`).
    Softmax,
    /// Elementwise sigmoid, normalised over the chosen k.
    Sigmoid,
}

/// How a group of experts is scored in group-limited routing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupScore {
    /// The sum of the group's best `topk / group_topk` scores (Megatron's
    /// `group_limited_topk`).
    SumOfTop,
    /// The group's best score (DeepSeek-V2's `group_limited_greedy`, HF `deepseek_v2`).
    Max,
}

/// Group-limited routing (`--moe-router-num-groups`, `--moe-router-group-topk`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertGroups {
    /// Equal groups the experts split into, in id order.
    pub num_groups: usize,
    /// Groups each token may route into.
    pub group_topk: usize,
    /// How a group scores.
    pub score: GroupScore,
}

/// A router's routing rule (Megatron's `moe_router_*` options).
#[derive(Clone, Debug, PartialEq)]
pub struct RouterConfig {
    /// Experts `E` (`num_experts`).
    pub num_experts: usize,
    /// Experts per token `k` (`moe_router_topk`).
    pub topk: usize,
    /// `moe_router_score_function`.
    pub score_function: ScoreFunction,
    /// `moe_router_pre_softmax` (softmax only).
    pub pre_softmax: bool,
    /// Group-limited routing, if any.
    pub groups: Option<ExpertGroups>,
    /// `moe_router_topk_scaling_factor` (DeepSeek's `routed_scaling_factor`); 1 when `None`.
    pub scaling_factor: Option<f32>,
}

/// Where each token goes: `experts[t·k + j]` is token `t`'s `j`-th expert (best first) with
/// weight `probs[t·k + j]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    /// `[T, k]` expert ids.
    pub experts: Vec<u32>,
    /// `[T, k]` routing weights.
    pub probs: Vec<f32>,
    /// `[T, k]` slots dropped over an expert's capacity ([`Routing::drop_over_capacity`]):
    /// weight 0, not computed, no gradient.
    pub dropped: Vec<bool>,
    /// Experts per token `k`.
    topk: usize,
    /// `[T, E]` the scores the probabilities were read from (softmax over all experts with
    /// `pre_softmax`, over the chosen k otherwise, stored at their experts; sigmoid), for the
    /// backward.
    scores: Vec<f32>,
    /// Rows every expert computes, padded with weight-0 rows of other tokens
    /// ([`Routing::pad_to_capacity`]); `None`: only the routed ones.
    pad_rows: Option<usize>,
}

impl RouterConfig {
    /// Checks the options against each other.
    ///
    /// # Errors
    /// [`NnError::BadInput`] naming the option: no experts, `topk` 0 or above `E`,
    /// `pre_softmax` with sigmoid, groups that do not divide `E` or leave fewer than `topk`
    /// experts, a non-finite scaling factor.
    pub fn validate(&self) -> Result<()> {
        let (e, k) = (self.num_experts, self.topk);
        if e == 0 || k == 0 || k > e {
            return bad(
                "moe_router_topk",
                format!("{k} must be in 1..={e} (num_experts)"),
            );
        }
        if self.pre_softmax && self.score_function == ScoreFunction::Sigmoid {
            let reason = "applies to the softmax score function, not sigmoid";
            return bad("moe_router_pre_softmax", reason.into());
        }
        if let Some(g) = self.groups {
            let per = e.checked_div(g.num_groups).unwrap_or(0);
            if per == 0 || e % g.num_groups != 0 || g.group_topk == 0 || g.group_topk > g.num_groups
            {
                return bad(
                    "moe_router_num_groups",
                    format!(
                        "{} must divide num_experts {e} and moe_router_group_topk {} be in \
                         1..=num_groups",
                        g.num_groups, g.group_topk
                    ),
                );
            }
            if g.group_topk * per < k || (g.score == GroupScore::SumOfTop && k % g.group_topk != 0)
            {
                return bad(
                    "moe_router_group_topk",
                    format!(
                        "{} groups of {per} experts cannot hold topk {k} (and topk must be a \
                         multiple of group_topk for the sum-of-top group score)",
                        g.group_topk
                    ),
                );
            }
        }
        if self.scaling_factor.is_some_and(|f| !f.is_finite()) {
            return bad("moe_router_topk_scaling_factor", "must be finite".into());
        }
        Ok(())
    }

    /// Routes `T` tokens from their logits `[T, E]`; `expert_bias` (`[E]`, sigmoid routers
    /// only) shifts the choice, not the weights.
    ///
    /// # Errors
    /// [`RouterConfig::validate`]'s; [`NnError::BadInput`] for logits not `T·E` long, a
    /// bias not `E` long or on a softmax router.
    pub fn route(&self, logits: &[f32], expert_bias: Option<&[f32]>) -> Result<Routing> {
        self.validate()?;
        let (e, k) = (self.num_experts, self.topk);
        if !logits.len().is_multiple_of(e) {
            let reason = format!("{} values are not rows of num_experts {e}", logits.len());
            return bad("router logits", reason);
        }
        match expert_bias {
            Some(b) if b.len() != e || self.score_function != ScoreFunction::Sigmoid => {
                let reason = format!(
                    "needs the sigmoid score function and num_experts {e} values (got {})",
                    b.len()
                );
                return bad("expert_bias", reason);
            }
            _ => {}
        }
        let t = logits.len() / e;
        let mut out = Routing {
            experts: vec![0; t * k],
            probs: vec![0.0; t * k],
            dropped: vec![false; t * k],
            topk: k,
            scores: vec![0.0; t * e],
            pad_rows: None,
        };
        for (i, z) in logits.chunks_exact(e).enumerate() {
            let scores = &mut out.scores[i * e..][..e];
            let chosen = self.route_token(z, expert_bias, scores);
            let probs = &mut out.probs[i * k..][..k];
            for (j, &x) in chosen.iter().enumerate() {
                out.experts[i * k + j] = x as u32;
                probs[j] = scores[x];
            }
            let f = self.scaling_factor.unwrap_or(1.0);
            if self.score_function == ScoreFunction::Sigmoid && k > 1 {
                let sum: f32 = probs.iter().sum::<f32>() + 1e-20;
                probs.iter_mut().for_each(|p| *p /= sum);
            }
            probs.iter_mut().for_each(|p| *p *= f);
        }
        Ok(out)
    }

    /// One token: fills `scores` ([`Routing::scores`]'s row) and returns the chosen experts,
    /// best first.
    fn route_token(&self, z: &[f32], bias: Option<&[f32]>, scores: &mut [f32]) -> Vec<usize> {
        match (self.score_function, self.pre_softmax) {
            (ScoreFunction::Softmax, false) => {
                let chosen = self.topk(z);
                let picked: Vec<f32> = chosen.iter().map(|&x| z[x]).collect();
                for (&x, p) in chosen.iter().zip(softmax(&picked)) {
                    scores[x] = p;
                }
                chosen
            }
            (ScoreFunction::Softmax, true) => {
                scores.copy_from_slice(&softmax(z));
                self.topk(scores)
            }
            (ScoreFunction::Sigmoid, _) => {
                scores.iter_mut().zip(z).for_each(|(s, &v)| *s = sigmoid(v));
                match bias {
                    Some(b) => {
                        let biased: Vec<f32> = scores.iter().zip(b).map(|(s, b)| s + b).collect();
                        self.topk(&biased)
                    }
                    None => self.topk(scores),
                }
            }
        }
    }

    /// The `k` best experts of `scores` (ties to the lower id), within the best groups when
    /// routing is group-limited.
    fn topk(&self, scores: &[f32]) -> Vec<usize> {
        let allowed: Vec<bool> = match self.groups {
            None => vec![true; scores.len()],
            Some(g) => {
                let per = scores.len() / g.num_groups;
                let group_score = |grp: &[f32]| match g.score {
                    GroupScore::Max => grp.iter().copied().fold(f32::NEG_INFINITY, f32::max),
                    GroupScore::SumOfTop => best(grp, self.topk / g.group_topk)
                        .iter()
                        .map(|&i| grp[i])
                        .sum(),
                };
                let by_group: Vec<f32> = scores.chunks_exact(per).map(group_score).collect();
                let keep = best(&by_group, g.group_topk);
                (0..scores.len())
                    .map(|x| keep.contains(&(x / per)))
                    .collect()
            }
        };
        let masked: Vec<f32> = scores
            .iter()
            .zip(&allowed)
            .map(|(&s, &a)| if a { s } else { f32::NEG_INFINITY })
            .collect();
        best(&masked, self.topk)
    }

    /// `dlogits [T, E]` from `dprobs [T, k]` (the gradient of [`Routing::probs`]).
    ///
    /// # Panics
    /// When `dprobs` is not `routing`'s shape (a caller bug).
    pub fn backward(&self, routing: &Routing, dprobs: &[f32]) -> Vec<f32> {
        let (e, k) = (self.num_experts, self.topk);
        assert_eq!(dprobs.len(), routing.probs.len());
        let f = self.scaling_factor.unwrap_or(1.0);
        let mut dz = vec![0f32; routing.scores.len()];
        for (i, dz) in dz.chunks_exact_mut(e).enumerate() {
            let s = &routing.scores[i * e..][..e];
            let chosen = &routing.experts[i * k..][..k];
            let dp: Vec<f32> = dprobs[i * k..][..k]
                .iter()
                .zip(&routing.dropped[i * k..][..k])
                .map(|(d, &dropped)| if dropped { 0.0 } else { d * f })
                .collect();
            match self.score_function {
                ScoreFunction::Softmax => {
                    // Softmax backward over the experts the scores cover (the chosen k, or all
                    // with pre_softmax): dz = p ⊙ (g − Σ p·g), g = dp at the chosen.
                    let mut g = vec![0f32; e];
                    chosen
                        .iter()
                        .zip(&dp)
                        .for_each(|(&x, &d)| g[x as usize] = d);
                    let dot: f32 = s.iter().zip(&g).map(|(p, g)| p * g).sum();
                    dz.iter_mut()
                        .zip(s.iter().zip(&g))
                        .for_each(|(dz, (p, g))| *dz = p * (g - dot));
                }
                ScoreFunction::Sigmoid => {
                    let q: Vec<f32> = chosen.iter().map(|&x| s[x as usize]).collect();
                    let dq: Vec<f32> = if k > 1 {
                        let sum: f32 = q.iter().sum::<f32>() + 1e-20;
                        let dot: f32 = dp.iter().zip(&q).map(|(d, q)| d * q).sum();
                        dp.iter().map(|d| d / sum - dot / (sum * sum)).collect()
                    } else {
                        dp
                    };
                    for (&x, d) in chosen.iter().zip(dq) {
                        let sx = s[x as usize];
                        dz[x as usize] = d * sx * (1.0 - sx);
                    }
                }
            }
        }
        dz
    }
}

fn bad<T>(field: &str, reason: String) -> Result<T> {
    Err(NnError::BadInput {
        field: field.into(),
        reason,
    })
}

pub(super) fn softmax(z: &[f32]) -> Vec<f32> {
    let m = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let ex: Vec<f32> = z.iter().map(|v| (v - m).exp()).collect();
    let sum: f32 = ex.iter().sum();
    ex.into_iter().map(|v| v / sum).collect()
}

pub(super) fn sigmoid(v: f32) -> f32 {
    1.0 / (1.0 + (-v).exp())
}

/// Indices of the `k` largest values, largest first, ties to the lower index.
pub(super) fn best(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// Which routed tokens an expert over capacity keeps (`--moe-token-drop-policy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropPolicy {
    /// Those with the highest routing weights (ties to the earlier token).
    Probs,
    /// The earliest tokens.
    Position,
}

impl Routing {
    /// Experts per token `k` (slot `t·k + j` is token `t`'s `j`-th).
    pub fn topk(&self) -> usize {
        self.topk
    }

    /// Rows every expert computes when padded ([`Routing::pad_to_capacity`]).
    pub fn pad_rows(&self) -> Option<usize> {
        self.pad_rows
    }

    /// Tokens `rows` of this routing (their experts, weights, drop flags and scores), for
    /// running the experts over a share of the tokens routed together (not padded).
    ///
    /// # Panics
    /// `rows` past the routed tokens (a caller bug).
    pub fn rows(&self, rows: std::ops::Range<usize>) -> Routing {
        let (k, e) = (
            self.topk,
            self.scores.len() / (self.experts.len() / self.topk).max(1),
        );
        let slots = rows.start * k..rows.end * k;
        Routing {
            experts: self.experts[slots.clone()].to_vec(),
            probs: self.probs[slots.clone()].to_vec(),
            dropped: self.dropped[slots].to_vec(),
            topk: k,
            scores: self.scores[rows.start * e..rows.end * e].to_vec(),
            pad_rows: None,
        }
    }

    /// Bytes of the kept `[T, E]` scores (what the backward reads besides `probs`).
    pub fn scores_bytes(&self) -> u128 {
        std::mem::size_of_val(self.scores.as_slice()) as u128
    }

    /// Megatron's `apply_router_token_dropping`: each expert keeps at most
    /// `capacity = ceil(T·k / E · capacity_factor)` of the tokens routed to it, chosen by
    /// `policy`; the others are dropped (weight 0, not computed: a token keeps its other
    /// experts, its weights are not renormalised). Returns how many slots were dropped.
    /// Dropless (HF's models, Megatron's default) is not calling this.
    ///
    /// # Errors
    /// [`NnError::BadInput`] naming `moe_expert_capacity_factor` when it is not positive.
    pub fn drop_over_capacity(
        &mut self,
        num_experts: usize,
        capacity_factor: f32,
        policy: DropPolicy,
    ) -> Result<usize> {
        let capacity = self.capacity(num_experts, capacity_factor)?;
        let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); num_experts];
        for (slot, &x) in self.experts.iter().enumerate() {
            by_expert[x as usize].push(slot);
        }
        let mut dropped = 0;
        for mut slots in by_expert {
            if policy == DropPolicy::Probs {
                // Slots are in token order already: a stable sort keeps ties early-first.
                slots.sort_by(|&a, &b| self.probs[b].total_cmp(&self.probs[a]));
            }
            for &slot in slots.iter().skip(capacity) {
                self.dropped[slot] = true;
                self.probs[slot] = 0.0;
                dropped += 1;
            }
        }
        Ok(dropped)
    }

    /// Megatron's `get_capacity(T·k, E, capacity_factor)`: `ceil(T·k / E · capacity_factor)`.
    ///
    /// # Errors
    /// [`NnError::BadInput`] naming `moe_expert_capacity_factor` when it is not positive.
    pub fn capacity(&self, num_experts: usize, capacity_factor: f32) -> Result<usize> {
        if !(capacity_factor > 0.0 && capacity_factor.is_finite()) {
            return bad(
                "moe_expert_capacity_factor",
                format!("{capacity_factor} must be > 0"),
            );
        }
        let slots = self.experts.len() as f64;
        Ok((slots / num_experts as f64 * f64::from(capacity_factor)).ceil() as usize)
    }

    /// Megatron's `moe_pad_expert_input_to_capacity` (after [`Routing::drop_over_capacity`]):
    /// every expert computes exactly `min(capacity, T)` rows — its kept tokens, then the
    /// earliest other tokens at weight 0 (Megatron's map becomes the capacity mask, whose
    /// extra tokens carry probability 0) — so the experts' inputs and the expert-parallel
    /// exchange have the same shapes every step. The output and every gradient are those of
    /// the unpadded routing (padded rows weigh 0 and take no routing gradient).
    ///
    /// # Errors
    /// As [`Routing::capacity`].
    pub fn pad_to_capacity(&mut self, num_experts: usize, capacity_factor: f32) -> Result<()> {
        let tokens = self.experts.len() / self.topk.max(1);
        let capacity = self.capacity(num_experts, capacity_factor)?;
        self.pad_rows = Some(capacity.min(tokens));
        Ok(())
    }
}

#[cfg(test)]
#[path = "router_tests.rs"]
mod tests;
