//! `ParamAndGradBuffer`: every parameter of a model (one pipeline stage) in ONE contiguous
//! param buffer and ONE contiguous f32 gradient buffer, split into buckets.
//!
//! Mirrors Megatron-Core's `_ParamAndGradBuffer` (megatron/core/distributed/
//! param_and_grad_buffer.py): `param_data` (param dtype) and `grad_data` (Megatron's
//! `main_grad`, always f32 here: `accumulate_allreduce_grads_in_fp32`) share one layout, so
//! parameter `p` occupies `p.offset..p.offset + p.numel` in both. The layout (order, padding,
//! buckets) is described at [`BufferConfig`].
//!
//! In training the param storage is the model's own: the trainer moves it into the model's
//! parameter table, laid out as here (`ferrotron_model::ParamTable::rehome`), and lends it
//! back for the optimizer step and the parameter collectives
//! ([`ParamAndGradBuffer::take_params`] / [`ParamAndGradBuffer::put_params`]) — one copy of
//! the weights, as Megatron's module parameters are views of `param_data`. Backward
//! accumulates gradients into [`ParamAndGradBuffer::grad_slices_mut`] slices (row-major, the
//! registered shape); [`ParamAndGradBuffer::views`] hands out all weights (shared) and all
//! gradients (exclusive) at once where the buffer holds both. The optimizer only ever sees
//! the flat buffers; DDP communicates per bucket ([`ParamAndGradBuffer::bucket_grads_mut`]).

mod layout;
mod state;
mod storage;

use std::collections::HashMap;
use std::ops::Range;

use ferrotron_tensor::DType;
use rayon::prelude::*;

pub use layout::{
    BUCKET_END_ALIGN, BucketInfo, BufferConfig, PARAM_START_ALIGN, ParamFlags, ParamId, ParamInfo,
    default_bucket_size,
};
pub use state::BufferMeta;
pub use storage::{ParamElement, ParamStorage};

use crate::error::{OptimError, Result, config_err};

/// Collects parameters (name, shape, flags) in model order, then lays them out.
#[derive(Debug, Clone)]
pub struct ParamAndGradBufferBuilder {
    config: BufferConfig,
    params: Vec<(String, Vec<usize>, ParamFlags)>,
    names: HashMap<String, ParamId>,
}

impl ParamAndGradBufferBuilder {
    /// An empty builder for `config`.
    pub fn new(config: BufferConfig) -> Self {
        ParamAndGradBufferBuilder {
            config,
            params: Vec::new(),
            names: HashMap::new(),
        }
    }

    /// Registers a parameter of `shape` (row-major) under `name`; returns its id (registration
    /// index). Register in model order (embedding first); `reverse_order` handles bucketing.
    ///
    /// # Errors
    /// [`OptimError::DuplicateParam`] for a name seen before; [`OptimError::Config`] for a
    /// shape with zero elements.
    pub fn register(&mut self, name: &str, shape: &[usize], flags: ParamFlags) -> Result<ParamId> {
        if self.names.contains_key(name) {
            return Err(OptimError::DuplicateParam(name.to_string()));
        }
        if shape.contains(&0) {
            return Err(config_err(format!(
                "parameter `{name}` has shape {shape:?} with no elements"
            )));
        }
        let id = ParamId(self.params.len());
        self.params.push((name.to_string(), shape.to_vec(), flags));
        self.names.insert(name.to_string(), id);
        Ok(id)
    }

    /// [`register`](Self::register) with [`ParamFlags::from_name_and_shape`] (1-D or `.bias`
    /// = no weight decay).
    ///
    /// # Errors
    /// As [`register`](Self::register).
    pub fn register_auto(&mut self, name: &str, shape: &[usize]) -> Result<ParamId> {
        self.register(name, shape, ParamFlags::from_name_and_shape(name, shape))
    }

    /// Lays the parameters out and allocates zeroed param and grad buffers.
    ///
    /// # Errors
    /// [`OptimError::Config`] when the [`BufferConfig`] is invalid.
    pub fn build(self) -> Result<ParamAndGradBuffer> {
        self.config.validate()?;
        let sizes: Vec<(usize, ParamFlags)> = self
            .params
            .iter()
            .map(|(_, shape, flags)| (numel(shape, flags), *flags))
            .collect();
        let layout = layout::compute_layout(&self.config, &sizes);
        let params: Vec<ParamInfo> = self
            .params
            .into_iter()
            .zip(&layout.placements)
            .map(|((name, shape, flags), &(offset, bucket_id))| ParamInfo {
                numel: numel(&shape, &flags),
                name,
                shape,
                offset,
                bucket_id,
                flags,
            })
            .collect();
        // Frozen parameters hold no elements: they are in no bucket and not in buffer order.
        let mut order: Vec<ParamId> = (0..params.len())
            .filter(|&i| !params[i].flags.frozen)
            .map(ParamId)
            .collect();
        order.sort_by_key(|id| params[id.0].offset);
        Ok(ParamAndGradBuffer {
            param_data: Some(ParamStorage::zeros(self.config.param_dtype, layout.numel)),
            grad_data: vec![0.0; layout.numel],
            config: self.config,
            params,
            by_name: self.names,
            buckets: layout.buckets,
            order,
        })
    }
}

/// Elements a parameter takes in the buffer: its shape's, none when frozen.
fn numel(shape: &[usize], flags: &ParamFlags) -> usize {
    if flags.frozen {
        0
    } else {
        shape.iter().product()
    }
}

/// All weights (shared) and all gradients (exclusive) of a buffer at once, indexed by
/// [`ParamId::index`]: what a backward pass needs.
pub struct BufferViews<'a, T> {
    /// `params[id]`: the weight of parameter `id`, `numel` elements, row-major.
    pub params: Vec<&'a [T]>,
    /// `grads[id]`: the f32 gradient accumulator of parameter `id`.
    pub grads: Vec<&'a mut [f32]>,
}

/// One contiguous param buffer + one contiguous f32 grad buffer with per-parameter and
/// per-bucket slice access. Build it with [`ParamAndGradBufferBuilder`].
#[derive(Debug, Clone)]
pub struct ParamAndGradBuffer {
    config: BufferConfig,
    params: Vec<ParamInfo>,
    by_name: HashMap<String, ParamId>,
    buckets: Vec<BucketInfo>,
    /// Param ids sorted by offset.
    order: Vec<ParamId>,
    /// `None` while lent out ([`ParamAndGradBuffer::take_params`]).
    param_data: Option<ParamStorage>,
    grad_data: Vec<f32>,
}

/// The panic message of a parameter access while the storage is lent out: a bug in the
/// owner of the buffer, which must [`ParamAndGradBuffer::put_params`] first.
const LENT: &str = "parameter values accessed while the buffer's param storage is lent out";

impl ParamAndGradBuffer {
    /// The layout configuration.
    pub fn config(&self) -> &BufferConfig {
        &self.config
    }
    /// Storage dtype of the parameters.
    pub fn param_dtype(&self) -> DType {
        self.config.param_dtype
    }
    /// Total elements in each buffer, padding included.
    pub fn numel(&self) -> usize {
        self.grad_data.len()
    }
    /// Sum of the parameters' element counts (no padding).
    pub fn numel_params(&self) -> usize {
        self.params.iter().map(|p| p.numel).sum()
    }
    /// All parameters in registration order (index = [`ParamId::index`]).
    pub fn params(&self) -> &[ParamInfo] {
        &self.params
    }
    /// Parameter ids in buffer order (ascending offset); frozen ones, which the buffer does
    /// not hold, are left out.
    pub fn buffer_order(&self) -> &[ParamId] {
        &self.order
    }
    /// One parameter's placement.
    pub fn info(&self, id: ParamId) -> &ParamInfo {
        &self.params[id.0]
    }
    /// The id of the parameter registered as `name`.
    ///
    /// # Errors
    /// [`OptimError::UnknownParam`].
    pub fn id(&self, name: &str) -> Result<ParamId> {
        self.by_name
            .get(name)
            .copied()
            .ok_or_else(|| OptimError::UnknownParam(name.to_string()))
    }
    /// The buckets in buffer order.
    pub fn buckets(&self) -> &[BucketInfo] {
        &self.buckets
    }

    /// Moves the param storage out — to the model's parameter table, which reads it in place
    /// (Megatron's module parameters are views into `param_data`; a Rust value has one owner,
    /// so the storage moves between the two instead, a move of the vector, never a copy).
    /// Until [`put_params`](Self::put_params) every parameter accessor panics; gradients stay
    /// usable.
    ///
    /// # Errors
    /// [`OptimError::State`] when the storage is already out.
    pub fn take_params(&mut self) -> Result<ParamStorage> {
        self.param_data.take().ok_or_else(|| {
            OptimError::State("the buffer's param storage is already lent out".into())
        })
    }

    /// Puts the param storage back after [`take_params`](Self::take_params).
    ///
    /// # Errors
    /// [`OptimError::State`] when the buffer holds a storage already, or `storage` is not
    /// `numel` elements of the param dtype (it is dropped then).
    pub fn put_params(&mut self, storage: ParamStorage) -> Result<()> {
        if self.param_data.is_some() {
            return Err(OptimError::State(
                "the buffer's param storage was not lent out".into(),
            ));
        }
        if storage.dtype() != self.config.param_dtype || storage.len() != self.numel() {
            return Err(OptimError::State(format!(
                "param storage of {} {:?} elements returned to a buffer of {} {:?}",
                storage.len(),
                storage.dtype(),
                self.numel(),
                self.config.param_dtype
            )));
        }
        self.param_data = Some(storage);
        Ok(())
    }

    /// True unless the param storage is lent out.
    pub fn holds_params(&self) -> bool {
        self.param_data.is_some()
    }

    fn storage(&self) -> &ParamStorage {
        self.param_data.as_ref().expect(LENT)
    }

    fn storage_mut(&mut self) -> &mut ParamStorage {
        self.param_data.as_mut().expect(LENT)
    }

    /// The whole param buffer, typed. Errors with [`OptimError::DTypeMismatch`] when `T` is
    /// not the buffer's dtype (also for every typed accessor below).
    ///
    /// # Errors
    /// [`OptimError::DTypeMismatch`].
    pub fn params_flat<T: ParamElement>(&self) -> Result<&[T]> {
        T::slice(self.storage())
    }
    /// The whole param buffer, typed, mutable.
    ///
    /// # Errors
    /// [`OptimError::DTypeMismatch`].
    pub fn params_flat_mut<T: ParamElement>(&mut self) -> Result<&mut [T]> {
        T::slice_mut(self.storage_mut())
    }
    /// The untyped param storage.
    pub fn param_storage(&self) -> &ParamStorage {
        self.storage()
    }
    /// The weight of parameter `id` (`numel` elements, row-major in its shape).
    ///
    /// # Errors
    /// [`OptimError::DTypeMismatch`].
    pub fn param<T: ParamElement>(&self, id: ParamId) -> Result<&[T]> {
        Ok(&T::slice(self.storage())?[self.params[id.0].range()])
    }
    /// The weight of parameter `id`, mutable.
    ///
    /// # Errors
    /// [`OptimError::DTypeMismatch`].
    pub fn param_mut<T: ParamElement>(&mut self, id: ParamId) -> Result<&mut [T]> {
        let range = self.params[id.0].range();
        Ok(&mut T::slice_mut(self.storage_mut())?[range])
    }
    /// Parameter `id` converted to f32 (exact for bf16/f16).
    pub fn param_to_f32(&self, id: ParamId) -> Vec<f32> {
        self.storage().to_f32_range(self.params[id.0].range())
    }
    /// Sets parameter `id` from f32 values (rounded to nearest-even for bf16/f16), e.g. when
    /// loading weights. Call [`Optimizer::reload_model_params`](crate::Optimizer) afterwards
    /// so the fp32 master weights follow.
    ///
    /// # Errors
    /// [`OptimError::Length`] when `values.len() != numel`.
    pub fn set_param_from_f32(&mut self, id: ParamId, values: &[f32]) -> Result<()> {
        let info = &self.params[id.0];
        if values.len() != info.numel {
            return Err(OptimError::Length {
                what: format!("parameter `{}` {:?}", info.name, info.shape),
                expected: info.numel,
                actual: values.len(),
            });
        }
        let range = info.range();
        self.storage_mut().set_from_f32(range, values);
        Ok(())
    }

    /// The whole f32 gradient buffer (Megatron `grad_data`).
    pub fn grads(&self) -> &[f32] {
        &self.grad_data
    }
    /// The whole f32 gradient buffer, mutable.
    pub fn grads_mut(&mut self) -> &mut [f32] {
        &mut self.grad_data
    }
    /// The gradient of parameter `id` (Megatron `param.main_grad`).
    pub fn grad(&self, id: ParamId) -> &[f32] {
        &self.grad_data[self.params[id.0].range()]
    }
    /// The gradient of parameter `id`, mutable (backward accumulates into it).
    pub fn grad_mut(&mut self, id: ParamId) -> &mut [f32] {
        let range = self.params[id.0].range();
        &mut self.grad_data[range]
    }
    /// Both flat buffers at once, mutable (param storage, grads): for optimizers and
    /// communication that touch both.
    pub fn data_mut(&mut self) -> (&mut ParamStorage, &mut [f32]) {
        (self.param_data.as_mut().expect(LENT), &mut self.grad_data)
    }

    /// Every weight (shared) and every gradient (exclusive), indexed by param id.
    ///
    /// # Errors
    /// [`OptimError::DTypeMismatch`].
    pub fn views<T: ParamElement>(&mut self) -> Result<BufferViews<'_, T>> {
        let data = T::slice(self.param_data.as_ref().expect(LENT))?;
        let params = self.params.iter().map(|p| &data[p.range()]).collect();
        let grads = split_disjoint(&mut self.grad_data, &self.params, &self.order);
        Ok(BufferViews { params, grads })
    }
    /// Every weight, mutable, indexed by param id (e.g. for initialization).
    ///
    /// # Errors
    /// [`OptimError::DTypeMismatch`].
    pub fn param_slices_mut<T: ParamElement>(&mut self) -> Result<Vec<&mut [T]>> {
        let data = T::slice_mut(self.param_data.as_mut().expect(LENT))?;
        Ok(split_disjoint(data, &self.params, &self.order))
    }
    /// Every gradient, mutable, indexed by param id.
    pub fn grad_slices_mut(&mut self) -> Vec<&mut [f32]> {
        split_disjoint(&mut self.grad_data, &self.params, &self.order)
    }

    /// Bucket `b`'s params, padding included (what the distributed optimizer all-gathers).
    ///
    /// # Errors
    /// [`OptimError::DTypeMismatch`].
    pub fn bucket_params<T: ParamElement>(&self, b: usize) -> Result<&[T]> {
        Ok(&T::slice(self.storage())?[self.buckets[b].range()])
    }
    /// Bucket `b`'s params, mutable.
    ///
    /// # Errors
    /// [`OptimError::DTypeMismatch`].
    pub fn bucket_params_mut<T: ParamElement>(&mut self, b: usize) -> Result<&mut [T]> {
        let range = self.buckets[b].range();
        Ok(&mut T::slice_mut(self.storage_mut())?[range])
    }
    /// Bucket `b`'s gradients, padding included (what DDP all-reduces / reduce-scatters).
    pub fn bucket_grads(&self, b: usize) -> &[f32] {
        &self.grad_data[self.buckets[b].range()]
    }
    /// Bucket `b`'s gradients, mutable.
    pub fn bucket_grads_mut(&mut self, b: usize) -> &mut [f32] {
        let range = self.buckets[b].range();
        &mut self.grad_data[range]
    }

    /// Zeroes the whole gradient buffer (start of every iteration; Megatron `reset()`).
    pub fn zero_grad(&mut self) {
        self.grad_data.par_iter_mut().for_each(|g| *g = 0.0);
    }
    /// Multiplies every gradient by `factor` (Megatron `scale_gradients`).
    pub fn scale_grads(&mut self, factor: f32) {
        self.grad_data.par_iter_mut().for_each(|g| *g *= factor);
    }

    /// Checks that `range` lies inside the buffer.
    pub(crate) fn check_range(&self, range: &Range<usize>) -> Result<()> {
        if range.start > range.end || range.end > self.numel() {
            return Err(OptimError::Range {
                start: range.start,
                end: range.end,
                reason: format!("the buffer has {} elements", self.numel()),
            });
        }
        Ok(())
    }
}

/// Splits `data` into one exclusive slice per parameter (ranges are disjoint; `order` sorts
/// them by offset; a frozen parameter's is empty), returned indexed by param id.
fn split_disjoint<'a, E>(
    data: &'a mut [E],
    params: &[ParamInfo],
    order: &[ParamId],
) -> Vec<&'a mut [E]> {
    // Frozen parameters (not in `order`) get empty slices.
    let mut out: Vec<Option<&'a mut [E]>> = params
        .iter()
        .map(|p| p.flags.frozen.then_some(&mut [][..]))
        .collect();
    let mut rest = data;
    let mut consumed = 0;
    for id in order {
        let info = &params[id.0];
        let (_, tail) = rest.split_at_mut(info.offset - consumed);
        let (slice, tail) = tail.split_at_mut(info.numel);
        out[id.0] = Some(slice);
        rest = tail;
        consumed = info.offset + info.numel;
    }
    out.into_iter()
        .map(|s| s.expect("every parameter has a range"))
        .collect()
}
