//! The MoE layer's training pass (Megatron-Core `MoELayer.forward`, `moe/moe_layer.py`):
//! router logits in f32 → top-k routing (then capacity, if any) → tokens permuted by expert →
//! the experts' grouped GEMMs → unpermuted with the routing weights, plus the shared expert
//! (scaled by its sigmoid gate); the balancing losses' gradient joins the router logits'
//! (Megatron's `MoEAuxLossAutoScaler`: scaled by the micro-batch's loss scale). The backward
//! sits beside it.

use super::backward::trainable;
use super::experts::{ExpertRun, routed_backward, routed_forward};
use super::forward::Pass;
use super::mlp::{DenseActs, dense_backward, dense_forward};
pub(crate) use super::moe_losses::MoeLossSink;
pub use super::moe_losses::MoeLosses;
use super::moe_losses::balancing_losses;
use super::stored::Stored;
use super::tp_ops::{adds_replicated_grads, reduce_partial_rows, row_parallel_output_grad};
use crate::module::MoeMlp;
use crate::{ModelError, MoeConfig, Result, TransformerConfig};
use ferrotron_nn::moe::Routing;
use ferrotron_nn::tensor_parallel::reduce_from_tensor_model_parallel_region;
use ferrotron_tensor::Buffer;
use ferrotron_tensor::gemm::{matmul_weight, matmul_weight_t, weight_grad};
use ferrotron_tensor::gemm_bf16::Operand;

/// What an MoE layer's backward needs, over `rows` tokens (all rows).
pub(crate) struct MoeActs {
    /// Each token's experts and weights (with the scores the router's backward reads).
    routing: Routing,
    /// The experts' permuted inputs and intermediate outputs.
    experts: ExpertRun,
    /// `[rows, E]` the balancing losses' gradient wrt the logits, times the loss scale
    /// (training passes of a model with such losses).
    daux: Option<Vec<f32>>,
    /// The shared expert's activations.
    shared: Option<SharedActs>,
}

/// The shared expert's activations.
struct SharedActs {
    mlp: DenseActs,
    /// `[rows, h]` its output before the gate.
    out: Buffer<f32>,
    /// `[rows]` `sigmoid(x·w_gate)` (absent without a gate).
    gate: Option<Vec<f32>>,
}

impl MoeActs {
    /// Bytes held.
    pub(crate) fn bytes(&self) -> u128 {
        let f32s = |n: usize| 4 * n as u128;
        let shared = self.shared.as_ref().map_or(0, |s| {
            s.mlp.bytes() + s.out.bytes() + f32s(s.gate.as_ref().map_or(0, Vec::len))
        });
        routing_bytes(&self.routing)
            + self.experts.bytes()
            + f32s(self.daux.as_ref().map_or(0, Vec::len))
            + shared
    }
}

/// Bytes an MoE layer of the full model `c` saves over `T = rows` tokens of a training pass
/// (what [`MoeActs::bytes`] measures): the routing (`[T, k]` ids, weights, drop flags, `[T, E]`
/// scores), the balancing losses' `[T, E]` logit gradient, the grouped experts over the
/// `R = T·k` routed rows (`[R, h]` permuted inputs and outputs, `[R, 2f_e]` and `[R, f_e]`
/// f32, the permutation's `R + E + 1` usize) and the shared expert's `fc1` / `act` (saved
/// dtype), output `[T, h]` and gate `[T]` f32.
///
/// # Errors
/// Token dropping (`moe_expert_capacity_factor`): the rows kept depend on the routing.
pub(crate) fn moe_acts_bytes(c: &TransformerConfig, rows: u128, narrow: bool) -> Result<u128> {
    let moe = c.moe.as_ref().expect("an MoE layer has an MoE config");
    if moe.capacity.is_some() {
        return Err(ModelError::Input(
            "activation memory: with moe_expert_capacity_factor the rows an MoE layer keeps \
             depend on the routing"
                .into(),
        ));
    }
    let [e, k, h, f] = [
        moe.num_experts(),
        moe.router.topk,
        c.hidden_size,
        moe.moe_ffn_hidden_size,
    ]
    .map(|n| n as u128);
    let (t, r) = (rows, rows * k);
    let usize_bytes = size_of::<usize>() as u128;
    let routing = r * (4 + 4 + 1) + 4 * t * e;
    let daux = 4 * t * e;
    let experts = 4 * r * (2 * h + 3 * f) + usize_bytes * (r + e + 1);
    let shared = moe.shared_expert_intermediate_size.map_or(0, |fs| {
        let gate = if moe.shared_expert_gate { 4 * t } else { 0 };
        DenseActs::bytes_for(2 * fs, fs, t, narrow) + 4 * t * h + gate
    });
    Ok(routing + daux + experts + shared)
}

/// Bytes of a routing: `[T, k]` ids, weights and drop flags, `[T, E]` scores.
fn routing_bytes(r: &Routing) -> u128 {
    (r.experts.len() * (4 + 4 + 1)) as u128 + r.scores_bytes()
}

/// The pass's MoE settings (an MoE layer's pass has them).
pub(super) fn moe_config<'c>(pass: &Pass<'c>) -> &'c MoeConfig {
    pass.c
        .moe
        .as_ref()
        .expect("a model with MoE layers has an MoE config")
}

fn nn_error(e: ferrotron_nn::NnError) -> ModelError {
    ModelError::Input(e.to_string())
}

/// The MoE layer `m` over `input: [rows, h]` (all rows): its activations and output
/// `[rows, h]`.
///
/// # Errors
/// A routing failure (bad router options are caught by config validation).
pub(super) fn moe_forward(
    m: &MoeMlp,
    pass: &Pass<'_>,
    input: &[f32],
) -> Result<(MoeActs, Buffer<f32>)> {
    let moe = moe_config(pass);
    let (h, e) = (pass.c.hidden_size, moe.num_experts());
    let rows = pass.positions.len();
    let router = pass.model.param(m.router);
    let mut logits = vec![0f32; rows * e];
    matmul_weight_t(input, router.weight_ref(), &mut logits, rows, e, h, false);
    let bias = m.expert_bias.map(|id| pass.model.f32_param(id));
    let mut routing = moe
        .router
        .route(&logits, bias.as_deref())
        .map_err(nn_error)?;
    if let Some(c) = moe.capacity {
        routing
            .drop_over_capacity(e, c.factor, c.drop_policy)
            .map_err(nn_error)?;
        if c.pad_to_capacity {
            routing.pad_to_capacity(e, c.factor).map_err(nn_error)?;
        }
    }
    if let (Some(id), Some(sink)) = (m.expert_bias, &pass.moe_losses)
        && sink.counts_expert_load
    {
        let kept = routing.experts.iter().zip(&routing.dropped);
        let experts = kept.filter(|(_, d)| !**d).map(|(x, _)| *x);
        pass.model.expert_load.add(id, e, experts);
    }
    let (y, experts) = routed_forward(pass, m, input, &routing)?;
    // Under tensor parallelism each rank's experts hold a slice of every expert's width.
    let mut out = reduce_partial_rows(pass.tp, Buffer::from_host(y))?;
    let shared = match (m.shared_experts, moe.shared_expert_intermediate_size) {
        (Some(mlp), Some(width)) => {
            let (acts, s_out) = dense_forward(&mlp, width, pass, input)?;
            let gate = m.shared_expert_gate.map(|g| {
                let mut z = vec![0f32; rows];
                matmul_weight_t(
                    input,
                    pass.model.param(g).weight_ref(),
                    &mut z,
                    rows,
                    1,
                    h,
                    false,
                );
                let local = local_row_range(pass, rows);
                z[local].iter().map(|&z| sigmoid(z)).collect::<Vec<f32>>()
            });
            add_gated(out.host_mut(), s_out.host(), gate.as_deref(), h);
            Some(SharedActs {
                mlp: acts,
                out: s_out,
                gate,
            })
        }
        _ => None,
    };
    let daux = pass
        .moe_losses
        .as_ref()
        .map(|sink| balancing_losses(moe, m.router, &logits, pass, sink))
        .transpose()?;
    let acts = MoeActs {
        routing,
        experts,
        daux,
        shared,
    };
    Ok((acts, out))
}

/// This rank's residual-stream rows among all `rows` (a block of `1/t` of them under
/// sequence parallelism, in the order the all-gather concatenates them).
fn local_row_range(pass: &Pass<'_>, rows: usize) -> std::ops::Range<usize> {
    match pass.tp.filter(|t| t.group.sequence_parallel()) {
        Some(t) => {
            let n = rows / t.group.size();
            t.group.rank() * n..(t.group.rank() + 1) * n
        }
        None => 0..rows,
    }
}

/// `out[t] += gate[t] · s[t]` per row of width `h` (`gate` 1 when absent).
fn add_gated(out: &mut [f32], s: &[f32], gate: Option<&[f32]>, h: usize) {
    for (t, (o, s)) in out.chunks_exact_mut(h).zip(s.chunks_exact(h)).enumerate() {
        let g = gate.map_or(1.0, |g| g[t]);
        o.iter_mut().zip(s).for_each(|(o, s)| *o += g * s);
    }
}

fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// [`moe_forward`]'s backward from `dout: [local rows, h]` to the gradient of its input
/// `mlp_in: [rows, h]` (all rows, a partial sum on each tensor-parallel rank), accumulating
/// the router's, experts' and shared expert's gradients.
///
/// # Errors
/// A failed tensor-parallel collective.
pub(super) fn moe_backward(
    m: &MoeMlp,
    acts: &MoeActs,
    mlp_in: &Stored,
    pass: &Pass<'_>,
    dout: &[f32],
    grads: &mut [&mut [f32]],
) -> Result<Buffer<f32>> {
    let moe = moe_config(pass);
    let (h, e) = (pass.c.hidden_size, moe.num_experts());
    let rows = pass.positions.len();
    let dy = row_parallel_output_grad(pass.tp, dout)?;
    let (dx, mut dprobs) = routed_backward(pass, m, &acts.routing, &acts.experts, &dy, grads)?;
    drop(dy);
    if let Some(t) = pass.tp {
        // Each rank's routing-weight gradient covers its slice of the experts' width.
        reduce_from_tensor_model_parallel_region(&t.group, &mut dprobs)
            .map_err(|e| ModelError::Comm(format!("MoE routing weights: {e}")))?;
    }
    let mut dx = Buffer::from_host(dx);
    let mut dlogits = moe.router.backward(&acts.routing, &dprobs);
    if let Some(daux) = &acts.daux {
        dlogits.iter_mut().zip(daux).for_each(|(d, a)| *d += a);
    }
    let router = pass.model.param(m.router);
    if adds_replicated_grads(pass.tp) {
        if let Some(dw) = trainable(grads, m.router) {
            weight_grad(
                Operand::F32(&dlogits),
                mlp_in.operand(),
                router.weight_ref(),
                dw,
                rows,
                e,
                h,
            );
        }
        matmul_weight(
            Operand::F32(&dlogits),
            router.weight_ref(),
            dx.host_mut(),
            rows,
            e,
            h,
            true,
        );
    }
    if let (Some(s), Some(mlp), Some(width)) = (
        &acts.shared,
        m.shared_experts,
        moe.shared_expert_intermediate_size,
    ) {
        let dshared = shared_gate_backward(m, s, mlp_in, pass, dout, dx.host_mut(), grads);
        let d = dense_backward(&mlp, width, &s.mlp, mlp_in, pass, &dshared, grads)?;
        dx.host_mut()
            .iter_mut()
            .zip(d.host())
            .for_each(|(x, d)| *x += d);
    }
    Ok(dx)
}

/// The shared expert gate's backward for `y = sigmoid(x·w)·s(x)`: accumulates `w`'s gradient,
/// adds the gate's input gradient to `dx`, and returns the gradient of `s`'s output
/// (`dout` itself without a gate).
fn shared_gate_backward(
    m: &MoeMlp,
    s: &SharedActs,
    mlp_in: &Stored,
    pass: &Pass<'_>,
    dout: &[f32],
    dx: &mut [f32],
    grads: &mut [&mut [f32]],
) -> Vec<f32> {
    let (Some(gate), Some(id)) = (&s.gate, m.shared_expert_gate) else {
        return dout.to_vec();
    };
    let h = pass.c.hidden_size;
    // `gate`, `dout` and the shared output are the local rows; the gate's input is all rows.
    let rows = dx.len() / h;
    let local = local_row_range(pass, rows);
    let mut dshared = dout.to_vec();
    let mut dz = vec![0f32; rows];
    for (t, (ds, o)) in dshared
        .chunks_exact_mut(h)
        .zip(s.out.host().chunks_exact(h))
        .enumerate()
    {
        let dgate: f32 = ds.iter().zip(o).map(|(d, o)| d * o).sum();
        dz[local.start + t] = dgate * gate[t] * (1.0 - gate[t]);
        ds.iter_mut().for_each(|d| *d *= gate[t]);
    }
    // Under sequence parallelism each rank has its own rows' part; otherwise every rank
    // has all of it and the first adds it.
    let sequence_parallel = pass.tp.is_some_and(|t| t.group.sequence_parallel());
    if sequence_parallel || adds_replicated_grads(pass.tp) {
        let w = pass.model.param(id);
        if let Some(dw) = trainable(grads, id) {
            weight_grad(
                Operand::F32(&dz),
                mlp_in.operand(),
                w.weight_ref(),
                dw,
                rows,
                1,
                h,
            );
        }
        matmul_weight(Operand::F32(&dz), w.weight_ref(), dx, rows, 1, h, true);
    }
    dshared
}
