//! The balancing losses of an MoE layer's training pass (Megatron-Core's
//! `moe/router.py` `_apply_aux_loss` / `_apply_seq_aux_loss` / `_apply_global_aux_loss` and
//! `moe_utils.py`), their logged values, and where a pass collects them.

use std::collections::BTreeMap;
use std::sync::Mutex;

use super::forward::Pass;
use crate::config::LoadBalancing;
use crate::module::ParamId;
use crate::{ModelError, MoeConfig, Result};
use ferrotron_comm::{Collectives, ReduceOp};
use ferrotron_nn::moe::losses::{aux_loss_counts, switch_load_balancing_loss, z_loss};

/// The balancing losses of a pass's MoE layers, summed over the layers, each **divided by
/// its coefficient** (what Megatron's `save_to_aux_losses_tracker` records and logs: about 1
/// for an even load whatever the coefficient); the objective got `coeff ·` each.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MoeLosses {
    /// Σ over MoE layers of `moe_router_load_balancing_type`'s loss over
    /// `moe_aux_loss_coeff`.
    pub load_balancing_loss: f64,
    /// Σ over MoE layers of the router z-loss over `moe_z_loss_coeff`.
    pub z_loss: f64,
    /// MoE layers summed, in shares: a context-parallel rank's losses are its part of each
    /// layer's (they sum to the layer's over the group), so it counts `1/C` per layer.
    pub layers: f64,
}

impl MoeLosses {
    /// `self + other`.
    pub fn add(&mut self, other: &MoeLosses) {
        self.load_balancing_loss += other.load_balancing_loss;
        self.z_loss += other.z_loss;
        self.layers += other.layers;
    }
}

/// Where a training pass's MoE layers add their losses, and the scale of their gradient.
pub(crate) struct MoeLossSink {
    /// The micro-batch's loss scale (the LM loss's gradient scale).
    pub scale: f32,
    /// Summed over the MoE layers run in the forward.
    pub losses: Mutex<MoeLosses>,
    /// The forward's routed tokens count toward the expert biases' update (false when the
    /// backward re-runs layers under full recompute: counted once, as Megatron's).
    pub counts_expert_load: bool,
    /// `global_aux_loss`'s average counts and token total per MoE layer (keyed by router) of
    /// this micro-batch: recorded by its forward, read back by a backward that re-runs it
    /// (so the re-run computes the same loss).
    pub global_aux: Mutex<BTreeMap<ParamId, (Vec<f64>, f64)>>,
}

/// The balancing losses of the MoE layer routed by `router` over `logits: [rows, E]` (added
/// to `sink`) and their gradient wrt the logits times `sink.scale`.
///
/// # Errors
/// A failed all-reduce of `global_aux_loss`'s counts.
pub(super) fn balancing_losses(
    moe: &MoeConfig,
    router: ParamId,
    logits: &[f32],
    pass: &Pass<'_>,
    sink: &MoeLossSink,
) -> Result<Vec<f32>> {
    let e = moe.num_experts();
    let c = pass.model.context_parallel().map_or(1, |cp| cp.size());
    let rows = logits.len() / e;
    // Under context parallelism a rank holds a share of each sequence: the counts and token
    // totals the losses take are the group's sums, each rank's loss is the part over its own
    // rows (the parts sum to one rank's loss; Megatron sums them over TP x CP), and its
    // gradient scale (its share of the micro-batch's loss units) becomes the micro-batch's.
    let mut shared = match moe.load_balancing_type {
        LoadBalancing::AuxLoss => {
            let mut counts = aux_loss_counts(&moe.router, logits);
            counts.push(rows as f64);
            counts
        }
        LoadBalancing::SeqAuxLoss => sequence_counts(moe, logits, pass.seq, pass.micro_batch),
        LoadBalancing::GlobalAuxLoss | LoadBalancing::None => Vec::new(),
    };
    shared.push(f64::from(sink.scale));
    let shared = context_parallel_sum(pass, shared)?;
    let (&scale, counts) = shared.split_last().expect("the scale is shared");
    let mut layer = MoeLosses {
        layers: 1.0 / c as f64,
        ..MoeLosses::default()
    };
    // Each loss at coefficient 1 (the logged value), its gradient then times the coefficient.
    let (raw, mut d) = match moe.load_balancing_type {
        LoadBalancing::AuxLoss => {
            let (counts, total) = counts.split_at(e);
            let (loss, d) = switch_load_balancing_loss(&moe.router, logits, counts, total[0], 1.0);
            (f64::from(loss), d)
        }
        LoadBalancing::SeqAuxLoss => {
            let total = (pass.seq * c) as f64;
            seq_aux_loss(moe, logits, pass.micro_batch, counts, total)
        }
        LoadBalancing::GlobalAuxLoss => global_aux_loss(moe, router, logits, pass, sink)?,
        LoadBalancing::None => (0.0, vec![0f32; logits.len()]),
    };
    layer.load_balancing_loss = raw;
    let scale = scale as f32;
    let aux_scale = moe.aux_loss_coeff * scale;
    d.iter_mut().for_each(|d| *d *= aux_scale);
    if let Some(zc) = moe.z_loss_coeff {
        // The mean over this rank's rows, a 1/C part of the mean over the sequence.
        let (loss, dz) = z_loss(logits, e, 1.0);
        layer.z_loss = f64::from(loss) / c as f64;
        let z_scale = zc * scale / c as f32;
        d.iter_mut().zip(dz).for_each(|(d, z)| *d += z_scale * z);
    }
    sink.losses
        .lock()
        .expect("no MoE layer panics holding the sink")
        .add(&layer);
    Ok(d)
}

/// `values` summed over the pass's context-parallel group (as they are without one).
fn context_parallel_sum(pass: &Pass<'_>, mut values: Vec<f64>) -> Result<Vec<f64>> {
    if let Some(cp) = pass.model.context_parallel() {
        cp.comm()
            .all_reduce(&mut values, ReduceOp::Sum)
            .map_err(|e| {
                ModelError::Comm(format!("MoE balancing losses over context parallel: {e}"))
            })?;
    }
    Ok(values)
}

/// Rows `i·b + j` of sequence `j` of `[s·b, E]` `logits` in `[s, b]` order.
fn sequence_rows(e: usize, logits: &[f32], b: usize, j: usize) -> Vec<f32> {
    logits
        .chunks_exact(e)
        .skip(j)
        .step_by(b)
        .flatten()
        .copied()
        .collect()
}

/// `seq_aux_loss`'s counts `[b, E]`: each sequence's [`aux_loss_counts`].
fn sequence_counts(moe: &MoeConfig, logits: &[f32], s: usize, b: usize) -> Vec<f64> {
    let e = moe.num_experts();
    debug_assert_eq!(logits.len(), s * b * e);
    (0..b)
        .flat_map(|j| aux_loss_counts(&moe.router, &sequence_rows(e, logits, b, j)))
        .collect()
}

/// Megatron's `seq_aux_loss` at coefficient 1 over `logits: [s·b, E]` in `[s, b]` row order:
/// the aux loss of each sequence's rows with that sequence's expert `counts` (`[b, E]`) and
/// `total` tokens, averaged over the `b` sequences; the loss and its gradient.
fn seq_aux_loss(
    moe: &MoeConfig,
    logits: &[f32],
    b: usize,
    counts: &[f64],
    total: f64,
) -> (f64, Vec<f32>) {
    let e = moe.num_experts();
    let mut d = vec![0f32; logits.len()];
    let mut sum = 0f64;
    for (j, counts) in counts.chunks_exact(e).enumerate() {
        let seq = sequence_rows(e, logits, b, j);
        let (loss, ds) = switch_load_balancing_loss(&moe.router, &seq, counts, total, 1.0);
        sum += f64::from(loss) / b as f64;
        let rows = d.chunks_exact_mut(e).skip(j).step_by(b);
        for (row, g) in rows.zip(ds.chunks_exact(e)) {
            row.iter_mut().zip(g).for_each(|(d, g)| *d = g / b as f32);
        }
    }
    (sum, d)
}

/// Megatron's `global_aux_loss` at coefficient 1 (see `global_aux.rs`): this micro-batch's
/// expert counts join the step's global ones (a forward) or are read back (a backward's
/// re-run); the loss and its gradient.
fn global_aux_loss(
    moe: &MoeConfig,
    router: ParamId,
    logits: &[f32],
    pass: &Pass<'_>,
    sink: &MoeLossSink,
) -> Result<(f64, Vec<f32>)> {
    let recorded = sink
        .global_aux
        .lock()
        .expect("no MoE layer panics holding the sink")
        .get(&router)
        .cloned();
    let (counts, total) = match recorded {
        Some(r) => r,
        None => {
            let rows = logits.len() / moe.num_experts();
            let local = aux_loss_counts(&moe.router, logits);
            let averaged = pass.model.global_aux.average(router, local, rows)?;
            sink.global_aux
                .lock()
                .expect("no MoE layer panics holding the sink")
                .insert(router, averaged.clone());
            averaged
        }
    };
    let (loss, d) = switch_load_balancing_loss(&moe.router, logits, &counts, total, 1.0);
    Ok((f64::from(loss), d))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{RouterConfig, ScoreFunction};
    use ferrotron_nn::moe::losses::aux_loss;

    fn config() -> MoeConfig {
        MoeConfig {
            router: RouterConfig {
                num_experts: 4,
                topk: 2,
                score_function: ScoreFunction::Softmax,
                pre_softmax: false,
                groups: None,
                scaling_factor: None,
            },
            moe_ffn_hidden_size: 8,
            layer_pattern: vec![true],
            shared_expert_intermediate_size: None,
            shared_expert_gate: false,
            load_balancing_type: LoadBalancing::SeqAuxLoss,
            aux_loss_coeff: 1.0,
            z_loss_coeff: None,
            capacity: None,
            token_dispatcher: Default::default(),
            expert_bias_update_rate: None,
        }
    }

    /// Megatron's `sequence_load_balancing_loss_func` written out: per sequence `j` of `b`
    /// (rows `i·b + j`), `Σ_e (c_je · E / (s·k)) · mean_i p_ije`, averaged over the sequences.
    #[test]
    fn seq_aux_loss_is_megatrons_per_sequence_loss() {
        let (s, b, e, k) = (5, 3, 4, 2);
        let logits: Vec<f32> = (0..s * b * e)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
            .collect();
        let seq_aux_loss = |logits: &[f32], s: usize, b: usize| {
            let counts = sequence_counts(&config(), logits, s, b);
            seq_aux_loss(&config(), logits, b, &counts, s as f64)
        };
        let (loss, grad) = seq_aux_loss(&logits, s, b);
        let mut want = 0f64;
        for j in 0..b {
            let mut counts = vec![0f64; e];
            let mut mean_p = vec![0f64; e];
            for i in 0..s {
                let z = &logits[(i * b + j) * e..][..e];
                let m = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let ex: Vec<f64> = z.iter().map(|v| f64::from(v - m).exp()).collect();
                let sum: f64 = ex.iter().sum();
                let p: Vec<f64> = ex.iter().map(|v| v / sum).collect();
                let mut order: Vec<usize> = (0..e).collect();
                order.sort_by(|&x, &y| p[y].total_cmp(&p[x]).then(x.cmp(&y)));
                for &x in &order[..k] {
                    counts[x] += 1.0;
                }
                for x in 0..e {
                    mean_p[x] += p[x] / s as f64;
                }
            }
            let seq: f64 = (0..e)
                .map(|x| counts[x] * e as f64 / (s * k) as f64 * mean_p[x])
                .sum();
            want += seq / b as f64;
        }
        assert!((loss - want).abs() < 1e-6, "{loss} vs {want}");
        // One sequence is the plain aux loss.
        let (one, _) = seq_aux_loss(&logits[..s * e], s, 1);
        let (plain, _) = aux_loss(&config().router, &logits[..s * e], 1.0);
        assert!((one - f64::from(plain)).abs() < 1e-6);
        // Finite differences of the gradient.
        let h = 1e-3f32;
        for at in [0, 7, 29, s * b * e - 1] {
            let mut plus = logits.clone();
            plus[at] += h;
            let mut minus = logits.clone();
            minus[at] -= h;
            let numeric =
                (seq_aux_loss(&plus, s, b).0 - seq_aux_loss(&minus, s, b).0) / (2.0 * f64::from(h));
            assert!(
                (numeric - f64::from(grad[at])).abs() < 1e-3,
                "d/dz[{at}]: {numeric} vs {}",
                grad[at]
            );
        }
    }
}
