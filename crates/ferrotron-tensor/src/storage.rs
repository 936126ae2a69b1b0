//! [`Storage`]: contiguous elements of one dtype — the data of a [`Tensor`](crate::Tensor),
//! and the flat parameter storage that a model's parameter table and the optimizer's
//! `ParamAndGradBuffer` hand to each other (Megatron-Core's `param_data`).

use crate::gemm::WeightRef;
use crate::{DType, Element};
use half::{bf16, f16};
use rayon::prelude::*;
use std::ops::Range;

/// Contiguous, row-major element storage of one dtype.
#[derive(Clone, Debug, PartialEq)]
pub enum Storage {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
}

/// Elements converted per rayon task by the f32 conversions of [`Storage`] and [`WeightRef`].
pub(crate) const CHUNK: usize = 1 << 14;

impl Storage {
    /// Zero-filled storage of `numel` elements of `dtype`.
    pub fn zeros(dtype: DType, numel: usize) -> Storage {
        match dtype {
            DType::F32 => Storage::F32(vec![0.0; numel]),
            DType::BF16 => Storage::BF16(vec![bf16::ZERO; numel]),
            DType::F16 => Storage::F16(vec![f16::ZERO; numel]),
        }
    }

    /// All elements, borrowed in the storage dtype.
    pub fn as_view(&self) -> WeightRef<'_> {
        match self {
            Storage::F32(v) => WeightRef::F32(v),
            Storage::BF16(v) => WeightRef::BF16(v),
            Storage::F16(v) => WeightRef::F16(v),
        }
    }

    /// Element count.
    pub fn len(&self) -> usize {
        self.as_view().len()
    }

    /// True when the storage holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The dtype of the elements.
    pub fn dtype(&self) -> DType {
        self.as_view().dtype()
    }

    /// Borrows `range` in the storage dtype.
    ///
    /// # Panics
    /// When `range` leaves the storage (callers check first).
    pub fn view(&self, range: Range<usize>) -> WeightRef<'_> {
        self.as_view().slice(range)
    }

    /// Copies `range` out as f32 (exact for every dtype).
    ///
    /// # Panics
    /// When `range` leaves the storage.
    pub fn to_f32_range(&self, range: Range<usize>) -> Vec<f32> {
        self.view(range).to_f32().into_owned()
    }

    /// Converts `range` to f32 into `out` (same length) without allocating.
    ///
    /// # Panics
    /// When `out.len() != range.len()` or `range` leaves the storage.
    pub fn copy_to_f32(&self, range: Range<usize>, out: &mut [f32]) {
        self.view(range).copy_to_f32(out);
    }

    /// The elements as bytes (what parameter collectives move).
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Storage::F32(v) => bytemuck::cast_slice(v),
            Storage::BF16(v) => bytemuck::cast_slice(v),
            Storage::F16(v) => bytemuck::cast_slice(v),
        }
    }

    /// The elements as bytes, mutable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Storage::F32(v) => bytemuck::cast_slice_mut(v),
            Storage::BF16(v) => bytemuck::cast_slice_mut(v),
            Storage::F16(v) => bytemuck::cast_slice_mut(v),
        }
    }

    /// Zeroes the elements in `range` and gives their whole pages back to the operating
    /// system ([`crate::pages::release`]).
    ///
    /// # Panics
    /// When `range` leaves the storage.
    pub fn release(&mut self, range: Range<usize>) {
        let elem = self.dtype().size_in_bytes();
        crate::pages::release(&mut self.as_bytes_mut()[range.start * elem..range.end * elem]);
    }

    /// Bytes of the storage held in memory ([`crate::pages::resident_bytes`]).
    pub fn resident_bytes(&self) -> usize {
        crate::pages::resident_bytes(self.as_bytes())
    }

    /// Writes f32 values into `range`, rounding to nearest-even for bf16/f16.
    ///
    /// # Panics
    /// When `values.len() != range.len()` or `range` leaves the storage.
    pub fn set_from_f32(&mut self, range: Range<usize>, values: &[f32]) {
        fn narrow<T: Element>(d: &mut [T], s: &[f32]) {
            d.par_chunks_mut(CHUNK)
                .zip(s.par_chunks(CHUNK))
                .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, &s)| *d = T::from_f32(s)));
        }
        match self {
            Storage::F32(v) => v[range].copy_from_slice(values),
            Storage::BF16(v) => narrow(&mut v[range], values),
            Storage::F16(v) => narrow(&mut v[range], values),
        }
    }
}
