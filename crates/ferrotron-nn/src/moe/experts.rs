//! The experts of an MoE layer, as Megatron-Core's `GroupedMLP` (`moe/experts.py`) with its
//! token `permute` / `unpermute` (`moe/moe_utils.py`): each routed copy of a token becomes one
//! row, rows sorted so every expert's rows are contiguous (expert order, then token order),
//! every expert's SwiGLU MLP runs as one GEMM over its rows (the experts in parallel: a grouped
//! GEMM, not a loop over tokens), and each token's output is the routing-weighted sum of its
//! rows. Backward gives the input, weight and routing-weight gradients.

use ferrotron_tensor::gemm::{
    Op, WeightRef, matmul_weight_serial, matmul_weight_t_serial, sgemm_serial,
};
use ferrotron_tensor::ops::{swiglu_packed, swiglu_packed_backward};
use rayon::prelude::*;
use std::mem::MaybeUninit;

use super::Routing;

/// The experts' weights, HF / Megatron orientation, every expert's matrix contiguous, in
/// f32, bf16 or f16 (narrow weights are widened exactly to f32 a block of rows at a time
/// inside each expert's products: f32 products, no f32 copy of the experts).
#[derive(Clone, Copy, Debug)]
pub struct ExpertWeights<'a> {
    /// `[E, 2f, h]`: each expert's `linear_fc1` (rows `[gate; up]`, Megatron's packing).
    pub fc1: WeightRef<'a>,
    /// `[E, h, f]`: each expert's `linear_fc2`.
    pub fc2: WeightRef<'a>,
    /// Hidden size `h`.
    pub hidden: usize,
    /// Expert FFN size `f` (`moe_ffn_hidden_size`).
    pub ffn: usize,
}

impl ExpertWeights<'_> {
    /// Experts `E` the weights hold.
    pub fn num_experts(&self) -> usize {
        self.fc2.len() / (self.hidden * self.ffn)
    }
}

/// Rows sorted by expert: `slots[r]` is permuted row `r`'s routing slot (`t·k + j`: token
/// `t`'s `j`-th expert; dropped slots have no row; padding rows follow), expert `e`'s rows are
/// `offsets[e]..offsets[e + 1]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Permutation {
    /// `[R]` (`R = T·k` less the dropped slots, plus padding rows): a routing slot, or
    /// `T·k + t` for a padding row of token `t` (weight 0; [`Routing::pad_to_capacity`]).
    pub slots: Vec<usize>,
    /// `[E + 1]`.
    pub offsets: Vec<usize>,
    /// Experts per token `k`.
    topk: usize,
    /// Routing slots `T·k`: the first padding code.
    slot_count: usize,
}

impl Permutation {
    /// The stable sort by expert of `routing`'s slots ([`Routing::experts`]), leaving out
    /// the dropped ones; when the routing is padded ([`Routing::pad_to_capacity`]) each
    /// expert's rows are followed by padding rows of the earliest tokens not routed to it.
    ///
    /// # Panics
    /// When an expert id is not below `num_experts` (the router's output is).
    pub fn new(routing: &Routing, num_experts: usize) -> Permutation {
        let (experts, k) = (&routing.experts, routing.topk());
        assert!(
            experts.iter().all(|&e| (e as usize) < num_experts),
            "expert ids below num_experts"
        );
        let mut by_expert = kept_by_expert(experts, &routing.dropped, 0..num_experts);
        if let Some(rows) = routing.pad_rows() {
            let mut has = vec![false; experts.len() / k];
            for slots in &mut by_expert {
                has.fill(false);
                slots.iter().for_each(|&s| has[s / k] = true);
                let others = (0..has.len()).filter(|&t| !has[t]);
                let pad = rows.saturating_sub(slots.len());
                slots.extend(others.take(pad).map(|t| experts.len() + t));
            }
        }
        Permutation::from_groups(by_expert, k, experts.len())
    }

    /// The permutation of the slots of `experts` / `dropped` (`[T·k]`, `k` per token) whose
    /// expert lies in `held`, sorted by expert (ids relative to `held.start`): the rows a
    /// rank holding experts `held` computes of tokens whose routing it knows (the allgather
    /// dispatcher).
    pub fn of_held(
        experts: &[u32],
        dropped: &[bool],
        topk: usize,
        held: std::ops::Range<usize>,
    ) -> Permutation {
        let by_expert = kept_by_expert(experts, dropped, held);
        Permutation::from_groups(by_expert, topk, experts.len())
    }

    /// Each expert's rows in turn (`by_expert[e]`: its slots or padding codes).
    fn from_groups(by_expert: Vec<Vec<usize>>, topk: usize, slot_count: usize) -> Permutation {
        let mut offsets = vec![0usize];
        let mut slots = Vec::with_capacity(by_expert.iter().map(Vec::len).sum());
        for rows in by_expert {
            slots.extend(rows);
            offsets.push(slots.len());
        }
        Permutation {
            slots,
            offsets,
            topk,
            slot_count,
        }
    }

    /// The token of permuted row `r`.
    fn token(&self, r: usize) -> usize {
        match self.slots[r] {
            s if s < self.slot_count => s / self.topk,
            pad => pad - self.slot_count,
        }
    }

    /// The routing slot of permuted row `r` (`None`: a padding row).
    fn slot(&self, r: usize) -> Option<usize> {
        Some(self.slots[r]).filter(|&s| s < self.slot_count)
    }

    /// `xp [R, h]`: each row its token's `x [T, h]` row (Megatron's `permute`).
    pub fn permute(&self, x: &[f32], h: usize) -> Vec<f32> {
        let mut xp = vec![0f32; self.slots.len() * h];
        for (r, row) in xp.chunks_exact_mut(h).enumerate() {
            row.copy_from_slice(&x[self.token(r) * h..][..h]);
        }
        xp
    }

    /// `y [T, h]`: each token the sum of its rows of `out [R, h]` weighted by `probs [T·k]`
    /// (Megatron's `unpermute`).
    pub fn unpermute(&self, out: &[f32], probs: &[f32], h: usize) -> Vec<f32> {
        let mut y = vec![0f32; probs.len() / self.topk * h];
        for (r, row) in out.chunks_exact(h).enumerate() {
            let Some(slot) = self.slot(r) else {
                continue;
            };
            let p = probs[slot];
            let yt = &mut y[self.token(r) * h..][..h];
            yt.iter_mut().zip(row).for_each(|(y, o)| *y += p * o);
        }
        y
    }

    /// The backward of [`Permutation::unpermute`] for `dy [T, h]`: each row's output
    /// gradient `dout [R, h]` (its weight × its token's) and `dprobs [T·k]` (the row's output
    /// · its token's gradient; 0 for dropped slots).
    pub fn unpermute_backward(
        &self,
        out: &[f32],
        probs: &[f32],
        dy: &[f32],
        h: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let mut dout = vec![0f32; out.len()];
        let mut dprobs = vec![0f32; probs.len()];
        for (r, (d, o)) in dout
            .chunks_exact_mut(h)
            .zip(out.chunks_exact(h))
            .enumerate()
        {
            let Some(slot) = self.slot(r) else {
                continue;
            };
            let dyt = &dy[self.token(r) * h..][..h];
            d.iter_mut()
                .zip(dyt)
                .for_each(|(d, g)| *d = probs[slot] * g);
            dprobs[slot] = o.iter().zip(dyt).map(|(o, g)| o * g).sum();
        }
        (dout, dprobs)
    }

    /// The backward of [`Permutation::permute`]: `dx [T, h]` (`len = T·h`) the sum of each
    /// token's rows of `dxp [R, h]`.
    pub fn permute_backward(&self, dxp: &[f32], h: usize, len: usize) -> Vec<f32> {
        let mut dx = vec![0f32; len];
        for (r, d) in dxp.chunks_exact(h).enumerate() {
            let dxt = &mut dx[self.token(r) * h..][..h];
            dxt.iter_mut().zip(d).for_each(|(a, b)| *a += b);
        }
        dx
    }
}

/// The kept slots of `experts` / `dropped` whose expert lies in `held`, grouped by expert
/// (relative to `held.start`), in slot order.
fn kept_by_expert(
    experts: &[u32],
    dropped: &[bool],
    held: std::ops::Range<usize>,
) -> Vec<Vec<usize>> {
    let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); held.len()];
    for (slot, (&e, &d)) in experts.iter().zip(dropped).enumerate() {
        let e = e as usize;
        if !d && held.contains(&e) {
            by_expert[e - held.start].push(slot);
        }
    }
    by_expert
}

/// What the experts' backward needs, over the `R = T·k` permuted rows.
#[derive(Clone, Debug)]
pub struct ExpertActs {
    /// The row order.
    pub perm: Permutation,
    /// `[R, h]` the permuted inputs.
    xp: Vec<f32>,
    /// `[R, 2f]` `linear_fc1`'s outputs (SwiGLU's input).
    fc1: Vec<f32>,
    /// `[R, f]` SwiGLU's outputs.
    act: Vec<f32>,
    /// `[R, h]` each row's expert output before its routing weight.
    out: Vec<f32>,
}

impl ExpertActs {
    /// Bytes held: the permutation and the four `[R, ·]` activations.
    pub fn bytes(&self) -> u128 {
        let f32s = self.xp.len() + self.fc1.len() + self.act.len() + self.out.len();
        let usizes = self.perm.slots.len() + self.perm.offsets.len();
        (4 * f32s + std::mem::size_of::<usize>() * usizes) as u128
    }
}

/// Gradients of [`experts_backward`].
#[derive(Clone, Debug)]
pub struct ExpertGrads {
    /// `[T, h]`.
    pub dx: Vec<f32>,
    /// `[E, 2f, h]`.
    pub dfc1: Vec<f32>,
    /// `[E, h, f]`.
    pub dfc2: Vec<f32>,
    /// `[T, k]`: the routing weights' gradient (for [`super::RouterConfig::backward`]).
    pub dprobs: Vec<f32>,
}

/// `y [T, h] = Σ_j probs[t, j] · expert_{e(t,j)}(x_t)` for `x [T, h]`, with each expert's
/// `fc2(silu(gate)·up)`.
///
/// # Panics
/// When the shapes disagree (a caller bug).
pub fn experts_forward(
    x: &[f32],
    routing: &Routing,
    w: &ExpertWeights<'_>,
) -> (Vec<f32>, ExpertActs) {
    let (h, e) = (w.hidden, w.num_experts());
    let perm = Permutation::new(routing, e);
    let xp = perm.permute(x, h);
    let (fc1, act, out) = grouped_mlp_forward(&xp, &perm.offsets, w);
    let y = perm.unpermute(&out, &routing.probs, h);
    (
        y,
        ExpertActs {
            perm,
            xp,
            fc1,
            act,
            out,
        },
    )
}

/// The backward of [`experts_forward`] for `dy [T, h]`.
///
/// # Panics
/// When the shapes disagree (a caller bug).
pub fn experts_backward(
    routing: &Routing,
    w: &ExpertWeights<'_>,
    acts: &ExpertActs,
    dy: &[f32],
) -> ExpertGrads {
    let (mut dfc1, mut dfc2) = (vec![0f32; w.fc1.len()], vec![0f32; w.fc2.len()]);
    let (dx, dprobs) = experts_backward_into(routing, w, acts, dy, (&mut dfc1, &mut dfc2));
    ExpertGrads {
        dx,
        dfc1,
        dfc2,
        dprobs,
    }
}

/// [`experts_backward`] **accumulating** the weight gradients into `dfc1 [E, 2f, h]` and
/// `dfc2 [E, h, f]` (a training step's gradient slices: no temporaries of the experts'
/// size); returns `(dx [T, h], dprobs [T, k])`.
///
/// # Panics
/// When the shapes disagree (a caller bug).
pub fn experts_backward_into(
    routing: &Routing,
    w: &ExpertWeights<'_>,
    acts: &ExpertActs,
    dy: &[f32],
    (dfc1, dfc2): (&mut [f32], &mut [f32]),
) -> (Vec<f32>, Vec<f32>) {
    let (perm, h) = (&acts.perm, w.hidden);
    let (dout, dprobs) = perm.unpermute_backward(&acts.out, &routing.probs, dy, h);
    let saved = (acts.xp.as_slice(), acts.fc1.as_slice(), acts.act.as_slice());
    let dxp = grouped_mlp_backward(saved, &perm.offsets, w, &dout, (dfc1, dfc2));
    (perm.permute_backward(&dxp, h, dy.len()), dprobs)
}

/// Every expert's SwiGLU MLP over its rows of `xp [R, h]` (expert `e`'s are
/// `offsets[e]..offsets[e + 1]`): `(fc1 [R, 2f], act [R, f], out [R, h])`, one GEMM per
/// expert and matrix, experts in parallel.
///
/// # Panics
/// When the shapes disagree (a caller bug).
pub fn grouped_mlp_forward(
    xp: &[f32],
    offsets: &[usize],
    w: &ExpertWeights<'_>,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (h, f) = (w.hidden, w.ffn);
    let fc1 = grouped_matmul_t(offsets, xp, w.fc1, (2 * f, h));
    let mut act = vec![0f32; fc1.len() / 2];
    swiglu_packed(&fc1, &mut act, f);
    let out = grouped_matmul_t(offsets, &act, w.fc2, (h, f));
    (fc1, act, out)
}

/// The backward of [`grouped_mlp_forward`] (its input `xp [R, h]` and saved `fc1 [R, 2f]`,
/// `act [R, f]`) for `dout [R, h]`: returns `dxp [R, h]` and **accumulates** the weight
/// gradients into `dfc1 [E, 2f, h]` and `dfc2 [E, h, f]` (an expert without rows adds
/// nothing).
///
/// # Panics
/// When the shapes disagree (a caller bug).
pub fn grouped_mlp_backward(
    (xp, fc1, act): (&[f32], &[f32], &[f32]),
    offsets: &[usize],
    w: &ExpertWeights<'_>,
    dout: &[f32],
    (dfc1, dfc2): (&mut [f32], &mut [f32]),
) -> Vec<f32> {
    let (h, f) = (w.hidden, w.ffn);
    assert!(dfc1.len() == w.fc1.len() && dfc2.len() == w.fc2.len());
    let dact = grouped_matmul(offsets, dout, w.fc2, (h, f));
    grouped_weight_grad(offsets, dout, act, dfc2, (h, f));
    let mut dfc1_out = vec![0f32; fc1.len()];
    swiglu_packed_backward(fc1, &dact, &mut dfc1_out, f);
    let dxp = grouped_matmul(offsets, &dfc1_out, w.fc1, (2 * f, h));
    grouped_weight_grad(offsets, &dfc1_out, xp, dfc1, (2 * f, h));
    dxp
}

/// Expert `e`'s slice of `rows_data` (`width` values per row) for every expert, mutable.
fn split_rows<'a, T>(offsets: &[usize], mut data: &'a mut [T], width: usize) -> Vec<&'a mut [T]> {
    offsets
        .windows(2)
        .map(|r| {
            let (head, tail) = std::mem::take(&mut data).split_at_mut((r[1] - r[0]) * width);
            data = tail;
            head
        })
        .collect()
}

/// Runs `job(e, rows_e, part_e)` for every expert with rows, side by side (one expert per
/// task, each GEMM on its own thread, [`sgemm_serial`]; measured faster on 2 cores than one
/// expert after another with each GEMM spread over the threads, BENCHMARKS.md).
fn for_each_expert<T: Send>(
    offsets: &[usize],
    parts: Vec<&mut [T]>,
    job: impl Fn(usize, usize, &mut [T]) + Sync,
) {
    parts.into_par_iter().enumerate().for_each(|(e, part)| {
        let m = offsets[e + 1] - offsets[e];
        if m > 0 {
            job(e, m, part);
        }
    });
}

/// `[R, width]` (`R = offsets[E]`) with every expert's rows written by `job(e, m, rows_e)`
/// (side by side, [`for_each_expert`]) into memory not zeroed first.
///
/// # Panics
/// When `offsets` does not start at 0 or decreases (a caller bug).
fn grouped_rows(
    offsets: &[usize],
    width: usize,
    job: impl Fn(usize, usize, &mut [MaybeUninit<f32>]) + Sync,
) -> Vec<f32> {
    assert!(
        offsets.first() == Some(&0) && offsets.is_sorted(),
        "expert row offsets start at 0 and never decrease"
    );
    let len = offsets[offsets.len() - 1] * width;
    let mut out = Vec::with_capacity(len);
    let parts = split_rows(offsets, &mut out.spare_capacity_mut()[..len], width);
    for_each_expert(offsets, parts, job);
    // SAFETY: the experts' row blocks tile `0..R`, and `job` wrote each block whole (an
    // expert without rows has an empty block).
    unsafe { out.set_len(len) };
    out
}

/// Grouped `out_e [R_e, n] = a_e [R_e, kd] · w_eᵀ` for every expert `e` (`w: [E, n, kd]`):
/// `out [R, n]`.
fn grouped_matmul_t(
    offsets: &[usize],
    a: &[f32],
    w: WeightRef<'_>,
    (n, kd): (usize, usize),
) -> Vec<f32> {
    grouped_rows(offsets, n, |e, m, o| {
        let a = &a[offsets[e] * kd..][..m * kd];
        let w = w.slice(e * n * kd..(e + 1) * n * kd);
        matmul_weight_t_serial(a, w, o, (m, n, kd));
    })
}

/// Grouped `out_e [R_e, kd] = g_e [R_e, n] · w_e` for every expert (`w: [E, n, kd]`):
/// `out [R, kd]`.
fn grouped_matmul(
    offsets: &[usize],
    g: &[f32],
    w: WeightRef<'_>,
    (n, kd): (usize, usize),
) -> Vec<f32> {
    grouped_rows(offsets, kd, |e, m, o| {
        let g = &g[offsets[e] * n..][..m * n];
        let w = w.slice(e * n * kd..(e + 1) * n * kd);
        matmul_weight_serial(g, w, o, (m, n, kd));
    })
}

/// Grouped `dw_e [n, kd] += g_eᵀ [n, R_e] · a_e [R_e, kd]` (nothing for an expert without
/// rows).
fn grouped_weight_grad(
    offsets: &[usize],
    g: &[f32],
    a: &[f32],
    dw: &mut [f32],
    (n, kd): (usize, usize),
) {
    let parts = dw.chunks_exact_mut(n * kd).collect();
    for_each_expert(offsets, parts, |e, m, d| {
        let (g, a) = (
            &g[offsets[e] * n..][..m * n],
            &a[offsets[e] * kd..][..m * kd],
        );
        sgemm_serial(n, kd, m, g, Op::T, a, Op::N, d, true);
    });
}
