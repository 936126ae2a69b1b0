//! Typed storage of the flat parameter buffer (f32, bf16 or f16).

use ferrotron_tensor::{DType, Element};
use half::{bf16, f16};
use rayon::prelude::*;

use crate::error::{OptimError, Result};

/// The flat parameter storage of a [`ParamAndGradBuffer`](crate::ParamAndGradBuffer): one
/// contiguous vector in the buffer's param dtype. Padding elements are zero.
#[derive(Debug, Clone)]
pub enum ParamStorage {
    /// fp32 parameters (plain fp32 training; they are their own master weights).
    F32(Vec<f32>),
    /// bf16 parameters (`bf16` mixed precision; fp32 master weights live in the optimizer).
    BF16(Vec<bf16>),
    /// fp16 parameters (`fp16` mixed precision with loss scaling).
    F16(Vec<f16>),
}

impl ParamStorage {
    /// Zero-filled storage of `numel` elements of `dtype`.
    pub fn zeros(dtype: DType, numel: usize) -> Self {
        match dtype {
            DType::F32 => ParamStorage::F32(vec![0.0; numel]),
            DType::BF16 => ParamStorage::BF16(vec![bf16::ZERO; numel]),
            DType::F16 => ParamStorage::F16(vec![f16::ZERO; numel]),
        }
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            ParamStorage::F32(_) => DType::F32,
            ParamStorage::BF16(_) => DType::BF16,
            ParamStorage::F16(_) => DType::F16,
        }
    }

    /// Number of elements (padding included).
    pub fn len(&self) -> usize {
        match self {
            ParamStorage::F32(v) => v.len(),
            ParamStorage::BF16(v) => v.len(),
            ParamStorage::F16(v) => v.len(),
        }
    }

    /// True when the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies `range` out as f32 (exact for every supported dtype).
    pub fn to_f32_range(&self, range: std::ops::Range<usize>) -> Vec<f32> {
        fn conv<T: Element>(s: &[T]) -> Vec<f32> {
            s.par_iter().map(|x| x.to_f32()).collect()
        }
        match self {
            ParamStorage::F32(v) => v[range].to_vec(),
            ParamStorage::BF16(v) => conv(&v[range]),
            ParamStorage::F16(v) => conv(&v[range]),
        }
    }

    /// Converts `range` to f32 into `out` (same length) without allocating.
    ///
    /// # Panics
    /// When `out.len() != range.len()` (callers check first).
    pub fn copy_to_f32(&self, range: std::ops::Range<usize>, out: &mut [f32]) {
        fn conv<T: Element>(s: &[T], d: &mut [f32]) {
            d.par_iter_mut()
                .zip(s.par_iter())
                .for_each(|(d, s)| *d = s.to_f32());
        }
        match self {
            ParamStorage::F32(v) => out.copy_from_slice(&v[range]),
            ParamStorage::BF16(v) => conv(&v[range], out),
            ParamStorage::F16(v) => conv(&v[range], out),
        }
    }

    /// Writes f32 values into `range`, rounding to nearest-even for bf16/f16.
    ///
    /// # Panics
    /// When `values.len() != range.len()` (callers check first).
    pub fn set_from_f32(&mut self, range: std::ops::Range<usize>, values: &[f32]) {
        fn conv<T: Element>(d: &mut [T], s: &[f32]) {
            d.par_iter_mut()
                .zip(s.par_iter())
                .for_each(|(d, &s)| *d = T::from_f32(s));
        }
        match self {
            ParamStorage::F32(v) => v[range].copy_from_slice(values),
            ParamStorage::BF16(v) => conv(&mut v[range], values),
            ParamStorage::F16(v) => conv(&mut v[range], values),
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// Element types the parameter buffer can hold: `f32`, `bf16`, `f16`. Used for typed slice
/// access (`buffer.param::<bf16>(id)`); asking for another type than the buffer's dtype is an
/// [`OptimError::DTypeMismatch`].
pub trait ParamElement: Element + sealed::Sealed {
    /// Borrows the storage as `&[Self]`.
    ///
    /// # Errors
    /// [`OptimError::DTypeMismatch`] when the storage holds another type.
    fn slice(storage: &ParamStorage) -> Result<&[Self]>;
    /// Borrows the storage as `&mut [Self]`.
    ///
    /// # Errors
    /// [`OptimError::DTypeMismatch`] when the storage holds another type.
    fn slice_mut(storage: &mut ParamStorage) -> Result<&mut [Self]>;
}

macro_rules! impl_param_element {
    ($t:ty, $variant:ident) => {
        impl ParamElement for $t {
            fn slice(storage: &ParamStorage) -> Result<&[Self]> {
                match storage {
                    ParamStorage::$variant(v) => Ok(v),
                    other => Err(OptimError::DTypeMismatch {
                        requested: <$t as Element>::DTYPE,
                        actual: other.dtype(),
                    }),
                }
            }
            fn slice_mut(storage: &mut ParamStorage) -> Result<&mut [Self]> {
                match storage {
                    ParamStorage::$variant(v) => Ok(v),
                    other => Err(OptimError::DTypeMismatch {
                        requested: <$t as Element>::DTYPE,
                        actual: other.dtype(),
                    }),
                }
            }
        }
    };
}

impl_param_element!(f32, F32);
impl_param_element!(bf16, BF16);
impl_param_element!(f16, F16);
