//! Fused softmax cross entropy over the vocabulary (the language-model loss).
//!
//! Mirrors `torch.nn.functional.cross_entropy(logits, labels, reduction="none",
//! ignore_index=-100)` and Megatron-Core's `vocab_parallel_cross_entropy` at tensor-parallel
//! size 1 (max-subtracted log-sum-exp; gradient `softmax − one_hot`), plus Megatron's
//! `loss_mask` as a per-token weight.
//!
//! Per token `t` with label `yₜ` and weight `mₜ` (`loss_mask[t]`, 1 without a mask):
//! `lseₜ = log Σⱼ exp(logitsₜⱼ)`, `lossₜ = mₜ·(lseₜ − logitsₜ,yₜ)`,
//! `∂lossₜ/∂logitsₜⱼ = mₜ·(softmaxₜⱼ − [j = yₜ])`.
//! A token is *skipped* when `yₜ == IGNORE_INDEX` or `mₜ == 0`: its loss and `lse` are 0 and its
//! gradient row is exactly 0 (its logits are not read, so NaN there does not spread).
//!
//! Memory: the `[n, v]` logits are the largest activation of a step (2048 tokens × 49152 vocab
//! is 400 MB), so besides the plain forward/backward pair there is an in-place backward and a
//! one-pass fused forward+backward that turns the logits buffer into its gradient while each
//! row is still in cache.

use super::math::{fast_exp, max, multiversion, sum_exp_shifted};
use crate::{Result, TensorError};
use rayon::prelude::*;

/// The label value that marks a token without loss (PyTorch's default `ignore_index`).
pub const IGNORE_INDEX: i64 = -100;

/// Checks shapes (panics: caller bugs) and labels (errors: bad data). Returns `n`.
fn check(logits_len: usize, labels: &[i64], mask: Option<&[f32]>, v: usize) -> Result<usize> {
    let n = labels.len();
    assert!(
        v > 0 && logits_len == n * v,
        "cross entropy: logits is not [n, v]"
    );
    if let Some(m) = mask {
        assert_eq!(m.len(), n, "cross entropy: loss_mask is not [n]");
    }
    for &y in labels {
        if y == IGNORE_INDEX {
            continue;
        }
        if y < 0 {
            return Err(TensorError::IndexOutOfRange {
                what: "label (negative and not the ignore index -100), negated,",
                index: y.unsigned_abs() as usize,
                size: v,
            });
        }
        if y as u64 >= v as u64 {
            return Err(TensorError::IndexOutOfRange {
                what: "label",
                index: y as usize,
                size: v,
            });
        }
    }
    Ok(n)
}

/// The per-token weight, or `None` when the token is skipped.
#[inline]
fn weight(labels: &[i64], mask: Option<&[f32]>, t: usize) -> Option<(usize, f32)> {
    let m = mask.map_or(1.0, |m| m[t]);
    (labels[t] != IGNORE_INDEX && m != 0.0).then(|| (labels[t] as usize, m))
}

/// Forward: writes `losses[t] = mₜ·(lseₜ − logits[t, yₜ])` and `lse[t]` (saved for the
/// backward), both `[n]`, from `logits: [n, v]` and `labels: [n]` (see the module docs for
/// `loss_mask` and skipped tokens). Bitwise deterministic (each row reduced in a fixed order).
///
/// # Errors
/// A label outside `0..v` other than [`IGNORE_INDEX`].
///
/// # Panics
/// When the lengths do not match the shapes above (a caller bug).
pub fn cross_entropy_forward(
    logits: &[f32],
    labels: &[i64],
    loss_mask: Option<&[f32]>,
    losses: &mut [f32],
    lse: &mut [f32],
    v: usize,
) -> Result<()> {
    let n = check(logits.len(), labels, loss_mask, v)?;
    assert!(
        losses.len() == n && lse.len() == n,
        "cross entropy: losses/lse are not [n]"
    );
    logits
        .par_chunks(v)
        .zip(losses.par_iter_mut().zip(lse.par_iter_mut()))
        .enumerate()
        .for_each(
            |(t, (row, (loss, lse)))| match weight(labels, loss_mask, t) {
                Some((y, m)) => {
                    let (l, s) = row_lse(row);
                    *lse = l;
                    *loss = m * ((s.0 - row[y]) + s.1);
                }
                None => (*loss, *lse) = (0.0, 0.0),
            },
        );
    Ok(())
}

/// Backward: **overwrites** `dlogits: [n, v]` with
/// `dlogits[t, j] = dloss[t]·mₜ·(exp(logits[t, j] − lse[t]) − [j = yₜ])`, the exact
/// vector-Jacobian product of [`cross_entropy_forward`] for the upstream gradient
/// `dloss = ∂L/∂losses: [n]`. For Megatron's mean over loss tokens pass the same `loss_mask` and
/// `dloss[t] = 1 / Σ loss_mask` (or no mask and `dloss = loss_mask / Σ loss_mask`).
///
/// # Panics
/// When the lengths do not match or a label is invalid (caller bugs: the forward validated
/// the same labels).
pub fn cross_entropy_backward(
    logits: &[f32],
    lse: &[f32],
    labels: &[i64],
    loss_mask: Option<&[f32]>,
    dloss: &[f32],
    dlogits: &mut [f32],
    v: usize,
) {
    let n = check(logits.len(), labels, loss_mask, v).expect("cross_entropy_backward labels");
    assert!(lse.len() == n && dloss.len() == n && dlogits.len() == logits.len());
    dlogits
        .par_chunks_mut(v)
        .zip(logits.par_chunks(v))
        .enumerate()
        .for_each(|(t, (drow, row))| match weight(labels, loss_mask, t) {
            Some((y, m)) => row_grad(row, drow, lse[t], dloss[t] * m, y),
            None => drow.fill(0.0),
        });
}

/// [`cross_entropy_backward`] in place: `logits: [n, v]` is turned into `dlogits` (saves a
/// second `[n, v]` buffer). Same math and panics.
pub fn cross_entropy_backward_inplace(
    logits: &mut [f32],
    lse: &[f32],
    labels: &[i64],
    loss_mask: Option<&[f32]>,
    dloss: &[f32],
    v: usize,
) {
    let n = check(logits.len(), labels, loss_mask, v).expect("cross_entropy_backward labels");
    assert!(lse.len() == n && dloss.len() == n);
    logits
        .par_chunks_mut(v)
        .enumerate()
        .for_each(|(t, row)| match weight(labels, loss_mask, t) {
            Some((y, m)) => row_grad_inplace(row, lse[t], dloss[t] * m, y),
            None => row.fill(0.0),
        });
}

/// Forward and backward in one pass over the logits, for when the upstream gradient is known
/// before the loss (Megatron's per-token mean: `dloss[t] = 1 / Σ loss_mask`): writes
/// `losses: [n]` as [`cross_entropy_forward`] does and turns `logits: [n, v]` into `dlogits` as
/// [`cross_entropy_backward`] does, while each row is still in cache. Results are bitwise equal
/// to calling the two.
///
/// # Errors
/// A label outside `0..v` other than [`IGNORE_INDEX`] (nothing is written then).
///
/// # Panics
/// When the lengths do not match the shapes above (a caller bug).
pub fn cross_entropy_fused_inplace(
    logits: &mut [f32],
    labels: &[i64],
    loss_mask: Option<&[f32]>,
    dloss: &[f32],
    losses: &mut [f32],
    v: usize,
) -> Result<()> {
    let n = check(logits.len(), labels, loss_mask, v)?;
    assert!(losses.len() == n && dloss.len() == n);
    logits
        .par_chunks_mut(v)
        .zip(losses.par_iter_mut())
        .enumerate()
        .for_each(|(t, (row, loss))| match weight(labels, loss_mask, t) {
            Some((y, m)) => {
                let (l, s) = row_lse(row);
                *loss = m * ((s.0 - row[y]) + s.1);
                row_grad_inplace(row, l, dloss[t] * m, y);
            }
            None => {
                *loss = 0.0;
                row.fill(0.0);
            }
        });
    Ok(())
}

/// `(lse, (max, ln Σ exp(x − max)))` of one row.
fn row_lse(row: &[f32]) -> (f32, (f32, f32)) {
    let m = row_max(row);
    let ln_s = row_sum_exp(row, m).ln();
    (m + ln_s, (m, ln_s))
}

multiversion! {
    fn row_max(row: &[f32]) -> f32 {
        max(row)
    }
}

multiversion! {
    fn row_sum_exp(row: &[f32], m: f32) -> f32 {
        sum_exp_shifted(row, m)
    }
}

multiversion! {
    /// `d[j] = c·exp(x[j] − lse)`, then `d[y] −= c`.
    fn row_grad(x: &[f32], d: &mut [f32], lse: f32, c: f32, y: usize) {
        for (d, &x) in d.iter_mut().zip(x) {
            *d = c * fast_exp(x - lse);
        }
        d[y] -= c;
    }
}

multiversion! {
    fn row_grad_inplace(x: &mut [f32], lse: f32, c: f32, y: usize) {
        for x in x.iter_mut() {
            *x = c * fast_exp(*x - lse);
        }
        x[y] -= c;
    }
}

/// One vocabulary shard of Megatron's `vocab_parallel_cross_entropy`
/// (`megatron/core/tensor_parallel/cross_entropy.py`): `logits: [n, v_local]` hold the
/// columns `vocab_start .. vocab_start + v_local` of the full `[n, v]` logits; columns at
/// `valid..` of the shard are vocabulary padding and never take part (unlike Megatron, which
/// trains its padding rows: here the loss equals the unpadded model's). Labels are global ids.
///
/// The three passes around the two tensor-parallel all-reduces:
/// 1. [`VocabShard::row_max`] → all-reduce MAX;
/// 2. [`VocabShard::sum_exp_and_target`] → all-reduce SUM of both;
/// 3. [`VocabShard::loss_and_grad_inplace`]: the loss and `∂loss/∂logits` of the shard.
#[derive(Clone, Copy, Debug)]
pub struct VocabShard<'a> {
    /// Token labels `[n]` (global ids; [`IGNORE_INDEX`] skips a token).
    pub labels: &'a [i64],
    /// Per-token loss weight `[n]`; `None` = ones.
    pub loss_mask: Option<&'a [f32]>,
    /// Columns of the shard (`v_local`).
    pub v_local: usize,
    /// Real (unpadded) columns of the shard, `<= v_local`.
    pub valid: usize,
    /// Global id of the shard's first column.
    pub vocab_start: usize,
}

impl VocabShard<'_> {
    /// Checks the labels against the global vocabulary of `v_global` real ids.
    ///
    /// # Errors
    /// A label outside `0..v_global` other than [`IGNORE_INDEX`].
    pub fn check_labels(&self, logits_len: usize, v_global: usize) -> Result<()> {
        assert!(self.valid <= self.v_local, "vocab shard: valid > v_local");
        let n = check(
            self.labels.len() * v_global,
            self.labels,
            self.loss_mask,
            v_global,
        )?;
        assert_eq!(
            logits_len,
            n * self.v_local,
            "vocab shard: logits is not [n, v_local]"
        );
        Ok(())
    }

    fn local_label(&self, t: usize) -> Option<(Option<usize>, f32)> {
        weight(self.labels, self.loss_mask, t).map(|(y, m)| {
            let local = y.checked_sub(self.vocab_start).filter(|&j| j < self.valid);
            (local, m)
        })
    }

    /// Pass 1: the max of each row's real columns (`-inf` for skipped tokens).
    pub fn row_max(&self, logits: &[f32], out: &mut [f32]) {
        logits
            .par_chunks(self.v_local)
            .zip(out.par_iter_mut())
            .enumerate()
            .for_each(|(t, (row, m))| {
                *m = match self.local_label(t) {
                    Some(_) if self.valid > 0 => row_max(&row[..self.valid]),
                    _ => f32::NEG_INFINITY,
                };
            });
    }

    /// Pass 2: per row, `Σ exp(x − max)` over the real columns and the label's logit when
    /// the label falls in this shard (0 otherwise), given the global `max`.
    pub fn sum_exp_and_target(
        &self,
        logits: &[f32],
        max: &[f32],
        sum_exp: &mut [f32],
        target: &mut [f32],
    ) {
        logits
            .par_chunks(self.v_local)
            .zip(sum_exp.par_iter_mut().zip(target.par_iter_mut()))
            .enumerate()
            .for_each(|(t, (row, (s, y)))| match self.local_label(t) {
                Some((local, _)) => {
                    *s = if self.valid > 0 {
                        row_sum_exp(&row[..self.valid], max[t])
                    } else {
                        0.0
                    };
                    *y = local.map_or(0.0, |j| row[j]);
                }
                None => (*s, *y) = (0.0, 0.0),
            });
    }

    /// Pass 3, from the global `max`, `sum_exp` and `target`: writes
    /// `losses[t] = mₜ·((max − target) + ln sum_exp)` and turns the shard's logits into
    /// `dloss[t]·mₜ·(softmax − one_hot)` (padding columns and skipped rows 0).
    pub fn loss_and_grad_inplace(
        &self,
        logits: &mut [f32],
        stats: [&[f32]; 3],
        dloss: &[f32],
        losses: &mut [f32],
    ) {
        let [max, sum_exp, target] = stats;
        logits
            .par_chunks_mut(self.v_local)
            .zip(losses.par_iter_mut())
            .enumerate()
            .for_each(|(t, (row, loss))| match self.local_label(t) {
                Some((local, m)) => {
                    let ln_s = sum_exp[t].ln();
                    *loss = m * ((max[t] - target[t]) + ln_s);
                    let (real, pad) = row.split_at_mut(self.valid);
                    row_grad_shard(real, max[t] + ln_s, dloss[t] * m, local);
                    pad.fill(0.0);
                }
                None => {
                    *loss = 0.0;
                    row.fill(0.0);
                }
            });
    }
}

multiversion! {
    fn row_grad_shard(x: &mut [f32], lse: f32, c: f32, y: Option<usize>) {
        for x in x.iter_mut() {
            *x = c * fast_exp(*x - lse);
        }
        if let Some(y) = y {
            x[y] -= c;
        }
    }
}
