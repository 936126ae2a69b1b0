//! AdamW over flat buffers with fp32 master weights, steppable per flat index range.
//!
//! The update is `torch.optim.AdamW` (single-tensor path, `amsgrad=False`,
//! `maximize=False`), element by element in f32 with the scalars computed in f64 and rounded
//! to f32 as torch does for CPU scalar arguments:
//!
//! ```text
//! t      += 1                                         (once per optimizer step)
//! g      *= clip_coeff                                (1 when not clipping; see below)
//! w      *= 1 - lr*wd                                 (decoupled decay, first; skipped if wd == 0)
//! m       = fma(1-beta1, g - m, m)                    (exp_avg.lerp_(g, 1-beta1))
//! v       = fma((1-beta2)*g, g, v*beta2)              (exp_avg_sq.mul_(beta2).addcmul_(g, g, 1-beta2))
//! denom   = sqrt(v) / sqrt(1 - beta2^t) + eps         (eps outside the square root)
//! w      += (-lr / (1 - beta1^t)) * m / denom         (p.addcdiv_(m, denom, -step_size))
//! param   = round_to_param_dtype(w)
//! ```
//!
//! The two fused multiply-adds are where torch's vectorized CPU kernels use them; with them
//! the result matches torch bit for bit (tests/adamw.rs against fixtures/optim/adamw.json).
//! The clip coefficient (`grad_scale`) multiplies each gradient in the update's own pass:
//! the same f32 product Megatron's `multi_tensor_scale` writes back before the step, without
//! a pass of its own over the gradients (the buffer keeps the unclipped values).
//!
//! `lr` and `wd` are per parameter: the step's lr/wd times the parameter's
//! [`ParamHyper`] multipliers (norm weights and biases get `wd_mult = 0` by default).
//!
//! State (`master`, `exp_avg`, `exp_avg_sq`) is flat f32, laid out like the param buffer but
//! only over the *owned* ranges: the whole buffer on one rank, or the per-bucket shards a
//! distributed optimizer (Megatron distrib_optimizer.py) assigns to its data-parallel rank.
//! It is held in chunks ([`crate::offload`]): all in RAM by default, some or all in the
//! offload directory's file under an offload policy, updated by the same kernel either way.
//! [`AdamW::step_range`] updates one flat range; [`AdamW::step`] is `begin_step` + every owned
//! range. For fp32 params there is no master copy: the param buffer is updated in place.

use std::ops::Range;

use ferrotron_tensor::DType;
use serde::{Deserialize, Serialize};

use crate::buffer::{ParamAndGradBuffer, ParamId, ParamStorage};
use crate::error::{OptimError, Result, config_err};
use crate::offload::{ChunkLayout, ChunkStore, OffloadConfig};
use crate::shard::OwnedRanges;

mod kernel;

use kernel::{Consts, run};

/// AdamW hyperparameters (Megatron names `adam_beta1`, `adam_beta2`, `adam_eps`,
/// `weight_decay`; Megatron defaults).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    /// First-moment decay, in [0, 1). Default 0.9.
    pub beta1: f64,
    /// Second-moment decay, in [0, 1). Default 0.999.
    pub beta2: f64,
    /// Added to `sqrt(v_hat)` (outside the root), >= 0. Default 1e-8.
    pub eps: f64,
    /// Decoupled weight decay, >= 0 (the schedule's value; constant here). Default 0.01.
    pub weight_decay: f64,
    /// Also decay norm weights and biases (default false: Megatron/HF exclude them).
    pub decay_norm_and_bias: bool,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            decay_norm_and_bias: false,
        }
    }
}

impl AdamWConfig {
    /// Checks the ranges torch checks.
    ///
    /// # Errors
    /// [`OptimError::Config`] naming the field (`adam_beta1`, `adam_beta2`, `adam_eps`,
    /// `weight_decay`).
    pub fn validate(&self) -> Result<()> {
        for (name, b) in [("adam_beta1", self.beta1), ("adam_beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(config_err(format!("{name} must be in [0, 1), got {b}")));
            }
        }
        if !(self.eps >= 0.0) {
            return Err(config_err(format!(
                "adam_eps must be >= 0, got {}",
                self.eps
            )));
        }
        if !(self.weight_decay >= 0.0) {
            return Err(config_err(format!(
                "weight_decay must be >= 0, got {}",
                self.weight_decay
            )));
        }
        Ok(())
    }
}

/// Per-parameter multipliers of the step's learning rate and weight decay (Megatron's param
/// groups: `lr_mult`, `wd_mult`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ParamHyper {
    /// Effective lr = step lr * `lr_mult`.
    pub lr_mult: f64,
    /// Effective weight decay = step weight decay * `wd_mult`.
    pub wd_mult: f64,
}

/// The state arrays of a chunk, in order: `exp_avg`, `exp_avg_sq`, then `master` when the
/// params are not f32.
const EXP_AVG: usize = 0;
const EXP_AVG_SQ: usize = 1;
const MASTER: usize = 2;

/// AdamW state over the owned ranges of one [`ParamAndGradBuffer`].
#[derive(Debug)]
pub struct AdamW {
    pub(crate) config: AdamWConfig,
    pub(crate) owned: OwnedRanges,
    /// Moments and (for bf16/f16 params) fp32 master weights, local indexing, in chunks.
    pub(crate) state: ChunkStore,
    /// Whether the state holds master weights.
    pub(crate) has_master: bool,
    pub(crate) offload: OffloadConfig,
    pub(crate) step: u64,
    pub(crate) hyper: Vec<ParamHyper>,
    /// (flat range, param id) of every param, ascending.
    segments: Vec<(Range<usize>, ParamId)>,
}

impl AdamW {
    /// AdamW over the whole buffer (single rank, or plain DDP where every rank steps all).
    ///
    /// # Errors
    /// [`OptimError::Config`] for invalid hyperparameters.
    #[allow(clippy::single_range_in_vec_init)] // one owned range: the whole buffer
    pub fn new(config: AdamWConfig, buffer: &ParamAndGradBuffer) -> Result<Self> {
        Self::new_sharded(config, buffer, vec![0..buffer.numel()])
    }

    /// AdamW owning only `owned` (sorted, disjoint flat ranges of `buffer`, e.g. this dp
    /// rank's shard of every bucket). Master weights are copied from the buffer's params
    /// (bf16/f16 buffers); moments start at zero; the step count at 0.
    ///
    /// # Errors
    /// [`OptimError::Config`] for invalid hyperparameters; [`OptimError::Range`] for owned
    /// ranges that overlap, are unsorted or leave the buffer.
    pub fn new_sharded(
        config: AdamWConfig,
        buffer: &ParamAndGradBuffer,
        owned: Vec<Range<usize>>,
    ) -> Result<Self> {
        Self::new_offloaded(config, buffer, owned, &OffloadConfig::default())
    }

    /// [`AdamW::new_sharded`] with the state placed as `offload` says: chunked
    /// ([`ChunkLayout::plan`] over the owned parts of the parameters), the chunks the policy
    /// names in the slow tier ([`OffloadConfig::initial_slow_chunks`]; the auto policy's
    /// placement follows with [`AdamW::place_chunks`]).
    ///
    /// # Errors
    /// As [`AdamW::new_sharded`]; [`OptimError::Config`] for invalid offload settings,
    /// [`OptimError::Offload`] for an offload directory that cannot hold the state.
    pub fn new_offloaded(
        config: AdamWConfig,
        buffer: &ParamAndGradBuffer,
        owned: Vec<Range<usize>>,
        offload: &OffloadConfig,
    ) -> Result<Self> {
        config.validate()?;
        offload.validate()?;
        let owned = OwnedRanges::new(owned, buffer.numel())?;
        let hyper = buffer
            .params()
            .iter()
            .map(|p| ParamHyper {
                lr_mult: 1.0,
                wd_mult: if p.flags.is_norm_or_bias && !config.decay_norm_and_bias {
                    0.0
                } else {
                    1.0
                },
            })
            .collect();
        let segments: Vec<_> = buffer
            .buffer_order()
            .iter()
            .map(|&id| (buffer.info(id).range(), id))
            .collect();
        let has_master = buffer.param_dtype() != DType::F32;
        let layout = ChunkLayout::plan(&local_pieces(&owned, &segments), offload.chunk_size);
        let n_chunks = layout.chunks().len();
        let planes = if has_master { 3 } else { 2 };
        let n_slow = offload.initial_slow_chunks(n_chunks);
        let state = ChunkStore::new(planes, layout, offload.path.as_deref(), n_slow)?;
        let mut adam = AdamW {
            config,
            state,
            has_master,
            offload: offload.clone(),
            owned,
            step: 0,
            hyper,
            segments,
        };
        adam.reload_model_params(buffer)?;
        // Moves count from the first step on.
        adam.state.take_moved_bytes();
        Ok(adam)
    }

    /// Hyperparameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }
    /// Number of completed optimizer steps (torch's `state['step']`).
    pub fn step_count(&self) -> u64 {
        self.step
    }
    /// Bytes of optimizer state held in RAM: the f32 Adam moments and master weights of the
    /// owned ranges (`12` bytes per owned element with bf16/f16 params, `8` with f32),
    /// less what is offloaded ([`AdamW::offloaded_bytes`]).
    pub fn state_bytes(&self) -> usize {
        self.state.fast_bytes() as usize
    }
    /// Bytes of optimizer state in the offload directory.
    pub fn offloaded_bytes(&self) -> u64 {
        self.state.slow_bytes()
    }
    /// The chunked state (its layout, tiers and I/O counter).
    pub fn chunks(&self) -> &ChunkStore {
        &self.state
    }
    /// Bytes moved between RAM and the offload directory since the last call.
    pub fn take_moved_bytes(&mut self) -> u64 {
        self.state.take_moved_bytes()
    }
    /// The offload settings.
    pub fn offload(&self) -> &OffloadConfig {
        &self.offload
    }
    /// Replaces the placement policy (e.g. the auto policy's budget); moves nothing
    /// ([`AdamW::place_chunks`] does).
    pub fn set_offload_policy(&mut self, policy: crate::offload::OffloadPolicy) {
        self.offload.policy = policy;
    }
    /// Puts the first `n_slow` chunks in the offload directory and the rest in RAM (the auto
    /// policy's move; [`crate::offload::chunks_in_budget`] says how many).
    ///
    /// # Errors
    /// [`OptimError::Offload`] without an offload directory or on an I/O error.
    pub fn place_chunks(&mut self, n_slow: usize) -> Result<()> {
        self.state.place(n_slow)
    }

    /// Overwrites state array `plane` (0 `exp_avg`, 1 `exp_avg_sq`, 2 `master`).
    pub(crate) fn write_plane(&mut self, plane: usize, values: &[f32]) -> Result<()> {
        self.state.write_plane(plane, values)
    }

    /// The owned flat ranges and their local offsets.
    pub fn owned(&self) -> &OwnedRanges {
        &self.owned
    }
    /// fp32 master weights over the owned ranges (local indexing); `None` for fp32 params.
    ///
    /// # Errors
    /// [`OptimError::Offload`] when reading offloaded chunks fails.
    pub fn master_weights(&self) -> Result<Option<Vec<f32>>> {
        self.has_master
            .then(|| self.state.read_plane(MASTER))
            .transpose()
    }
    /// First moments over the owned ranges (local indexing).
    ///
    /// # Errors
    /// As [`AdamW::master_weights`].
    pub fn exp_avg(&self) -> Result<Vec<f32>> {
        self.state.read_plane(EXP_AVG)
    }
    /// Second moments over the owned ranges (local indexing).
    ///
    /// # Errors
    /// As [`AdamW::master_weights`].
    pub fn exp_avg_sq(&self) -> Result<Vec<f32>> {
        self.state.read_plane(EXP_AVG_SQ)
    }
    /// The lr / wd multipliers of parameter `id`.
    pub fn param_hyper(&self, id: ParamId) -> ParamHyper {
        self.hyper[id.0]
    }
    /// Overrides the lr / wd multipliers of parameter `id`.
    pub fn set_param_hyper(&mut self, id: ParamId, hyper: ParamHyper) {
        self.hyper[id.0] = hyper;
    }

    /// Copies the buffer's params into the master weights over the owned ranges (after
    /// loading weights into the buffer; Megatron `reload_model_params`). No-op for fp32.
    ///
    /// # Errors
    /// [`OptimError::Offload`] when writing offloaded chunks fails.
    pub fn reload_model_params(&mut self, buffer: &ParamAndGradBuffer) -> Result<()> {
        self.set_master_weights(|range, out| buffer.param_storage().copy_to_f32(range, out))
    }

    /// Overwrites the master weights over the owned ranges in one pass: `source(range, out)`
    /// fills `out` with the f32 values of the buffer's flat `range`. A bf16/f16 run whose
    /// starting weights hold more precision than its params keeps them in the masters rather
    /// than their rounded copies (see [`Optimizer::set_master_weights`](crate::Optimizer)).
    /// No-op for fp32 params.
    ///
    /// # Errors
    /// [`OptimError::Offload`] when writing offloaded chunks fails.
    pub fn set_master_weights(
        &mut self,
        mut source: impl FnMut(Range<usize>, &mut [f32]),
    ) -> Result<()> {
        if !self.has_master {
            return Ok(());
        }
        for (range, local) in self.owned.iter() {
            let at =
                |sub: &Range<usize>| range.start + sub.start - local..range.start + sub.end - local;
            self.state
                .for_each(local..local + range.len(), |sub, mut planes| {
                    source(at(&sub), planes[MASTER]);
                    Ok(())
                })?;
        }
        Ok(())
    }

    /// Writes the master weights (rounded) into the buffer's params over the owned ranges.
    /// No-op for fp32 params.
    ///
    /// # Errors
    /// [`OptimError::Offload`] when reading offloaded chunks fails.
    pub fn copy_master_to_params(&mut self, buffer: &mut ParamAndGradBuffer) -> Result<()> {
        if !self.has_master {
            return Ok(());
        }
        let (storage, _) = buffer.data_mut();
        for (range, local) in self.owned.iter() {
            let at =
                |sub: &Range<usize>| range.start + sub.start - local..range.start + sub.end - local;
            self.state
                .for_each(local..local + range.len(), |sub, planes| {
                    storage.set_from_f32(at(&sub), planes[MASTER]);
                    Ok(())
                })?;
        }
        Ok(())
    }

    /// Starts an optimizer step: increments the step count used for bias correction.
    /// Returns the new count. Call once per step before [`step_range`](Self::step_range).
    pub fn begin_step(&mut self) -> u64 {
        self.step += 1;
        self.step
    }

    /// One whole step: [`begin_step`](Self::begin_step), then
    /// [`step_range`](Self::step_range) over every owned range, with the gradients times
    /// `grad_scale` (the clip coefficient; 1.0 when not clipping).
    ///
    /// # Errors
    /// As [`step_range`](Self::step_range).
    pub fn step(
        &mut self,
        buffer: &mut ParamAndGradBuffer,
        lr: f64,
        weight_decay: f64,
        grad_scale: f32,
    ) -> Result<()> {
        self.begin_step();
        for i in 0..self.owned.ranges().len() {
            let range = self.owned.ranges()[i].clone();
            self.step_range(buffer, range, lr, weight_decay, grad_scale)?;
        }
        Ok(())
    }

    /// Updates the flat range `range` (global buffer indices, inside one owned range) from
    /// the gradients in `buffer` times `grad_scale` (the clip coefficient, applied in the
    /// update: the buffer's gradients are left as they are), then writes the new weights
    /// into `buffer`'s params there. Padding between parameters is skipped. Uses the current
    /// step count (after [`begin_step`](Self::begin_step)); parallel over 16K-element chunks.
    ///
    /// # Errors
    /// [`OptimError::Range`] when `range` is not inside one owned range or no step was begun.
    pub fn step_range(
        &mut self,
        buffer: &mut ParamAndGradBuffer,
        range: Range<usize>,
        lr: f64,
        weight_decay: f64,
        grad_scale: f32,
    ) -> Result<()> {
        buffer.check_range(&range)?;
        if self.step == 0 {
            return Err(OptimError::Range {
                start: range.start,
                end: range.end,
                reason: "no step begun: call begin_step() first".into(),
            });
        }
        let local = self.owned.local_range(&range)?;
        // Pieces of params inside `range`, relative to range.start, with their scalars.
        let first = self.segments.partition_point(|(r, _)| r.end <= range.start);
        let mut pieces = Vec::new();
        for (seg, id) in &self.segments[first..] {
            if seg.start >= range.end {
                break;
            }
            let (a, b) = (seg.start.max(range.start), seg.end.min(range.end));
            let h = self.hyper[id.0];
            let k = Consts::new(
                &self.config,
                self.step,
                lr * h.lr_mult,
                weight_decay * h.wd_mult,
                grad_scale,
            );
            pieces.push((a - range.start..b - range.start, k));
        }
        let (storage, grads) = buffer.data_mut();
        self.state.for_each(local.clone(), |sub, planes| {
            // This chunk part's global range and its pieces, relative to it.
            let off = sub.start - local.start;
            let global = range.start + off..range.start + off + sub.len();
            let part: Vec<_> = pieces
                .iter()
                .filter(|(r, _)| r.start < off + sub.len() && r.end > off)
                .map(|(r, k)| (r.start.max(off) - off..r.end.min(off + sub.len()) - off, *k))
                .collect();
            let mut planes = planes.into_iter();
            let (m, v) = (
                planes.next().expect("exp_avg"),
                planes.next().expect("exp_avg_sq"),
            );
            let master = planes.next();
            let g = &grads[global.clone()];
            match storage {
                ParamStorage::F32(p) => run(&mut p[global], g, master, m, v, &part),
                ParamStorage::BF16(p) => run(&mut p[global], g, master, m, v, &part),
                ParamStorage::F16(p) => run(&mut p[global], g, master, m, v, &part),
            }
            Ok(())
        })
    }
}

/// Lengths of the consecutive pieces of the local index space (the owned ranges, one after
/// another) cut where a parameter starts or an owned range does: the tensors a chunk
/// manager packs.
fn local_pieces(owned: &OwnedRanges, segments: &[(Range<usize>, ParamId)]) -> Vec<usize> {
    let mut cuts = vec![0, owned.local_len()];
    for (range, local) in owned.iter() {
        cuts.push(local);
        for (seg, _) in segments {
            if seg.start > range.start && seg.start < range.end {
                cuts.push(local + seg.start - range.start);
            }
        }
    }
    cuts.sort_unstable();
    cuts.dedup();
    cuts.windows(2).map(|w| w[1] - w[0]).collect()
}
