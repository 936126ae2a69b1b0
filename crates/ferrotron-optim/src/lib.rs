//! Ferrotron's optimizer side: flat parameter/gradient buffers with buckets, AdamW with fp32
//! master weights, bf16/fp16/fp32 precision with loss scaling, gradient clipping by global L2
//! norm, and Megatron's learning-rate schedules.
//!
//! | here | mirrors (Megatron-Core) |
//! |---|---|
//! | [`ParamAndGradBuffer`] | `distributed/param_and_grad_buffer.py` (`_ParamAndGradBuffer`) |
//! | [`AdamW`], [`OwnedRanges`] | `torch.optim.AdamW`; shard ranges of `optimizer/distrib_optimizer.py` |
//! | [`Optimizer`] | `optimizer/optimizer.py` (`MixedPrecisionOptimizer`, `FP32Optimizer`) |
//! | [`GradScaler`] | `optimizer/grad_scaler.py` |
//! | [`clip`] | `optimizer/clip_grads.py` |
//! | [`OptimizerParamScheduler`] | `optimizer_param_scheduler.py` |
//!
//! The optimizer sees flat buffers, never layers (design.md). A training step on one rank:
//!
//! ```
//! use ferrotron_optim::*;
//! # fn main() -> Result<()> {
//! let mut b = ParamAndGradBufferBuilder::new(BufferConfig::new(Precision::Bf16.param_dtype(), 1));
//! let w = b.register_auto("layers.0.mlp.weight", &[4, 3])?;
//! let norm = b.register_auto("layers.0.norm.weight", &[3])?; // 1-D: no weight decay
//! let mut buf = b.build()?;
//! buf.set_param_from_f32(w, &[0.5; 12])?;
//! buf.set_param_from_f32(norm, &[1.0; 3])?;
//! let mut opt = Optimizer::new(OptimizerConfig::new(Precision::Bf16), &buf)?;
//! let mut sched = OptimizerParamScheduler::new(SchedulerConfig {
//!     lr: 3e-4, min_lr: 3e-5, lr_warmup_init: 0.0, lr_warmup_steps: 10, lr_decay_steps: 100,
//!     lr_decay_style: LrDecayStyle::Cosine, weight_decay: 0.1, unit: ScheduleUnit::Iterations,
//! })?;
//! buf.zero_grad();
//! buf.grad_mut(w).fill(0.1); // backward accumulates here (times opt.loss_scale())
//! let out = opt.step(&mut buf, sched.lr(), sched.weight_decay())?;
//! if out.update_successful {
//!     sched.step(1);
//! }
//! # Ok(()) }
//! ```

// Config checks are written `!(x >= 0.0)` on purpose: they reject NaN as well.
#![allow(clippy::neg_cmp_op_on_partial_ord)]

mod adamw;
mod buffer;
pub mod clip;
mod error;
mod grad_scaler;
pub mod offload;
mod optimizer;
mod optimizer_state;
mod scheduler;
mod shard;
mod state;

pub use adamw::{AdamW, AdamWConfig, ParamHyper};
pub use buffer::{
    BUCKET_END_ALIGN, BucketInfo, BufferConfig, BufferMeta, BufferViews, PARAM_START_ALIGN,
    ParamAndGradBuffer, ParamAndGradBufferBuilder, ParamElement, ParamFlags, ParamId, ParamInfo,
    ParamStorage, default_bucket_size,
};
pub use error::{OptimError, Result};
pub use grad_scaler::{DynamicGradScaler, DynamicGradScalerConfig, GradScaler, GradScalerState};
pub use optimizer::{
    GradStatsReduce, NoReduce, Optimizer, OptimizerConfig, Precision, StepOutcome,
};
pub use optimizer_state::{AdamWMeta, OptimizerMeta};
pub use scheduler::{
    LrDecayStyle, OptimizerParamScheduler, ScheduleUnit, SchedulerConfig, SchedulerLoadPolicy,
    SchedulerState, lr_at, pai_tokens_to_iters,
};
pub use shard::OwnedRanges;
pub use state::{StateArray, StateDict, Stateful};
