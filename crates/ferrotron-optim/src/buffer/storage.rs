//! Typed storage of the flat parameter buffer (f32, bf16 or f16).

use ferrotron_tensor::{Element, Storage};
use half::{bf16, f16};

use crate::error::{OptimError, Result};

/// The flat parameter storage of a [`ParamAndGradBuffer`](crate::ParamAndGradBuffer): one
/// contiguous [`Storage`] in the buffer's param dtype (padding elements are zero). It is the
/// same type as a model's parameter table storage, so the two can hand it to each other
/// ([`ParamAndGradBuffer::take_params`](crate::ParamAndGradBuffer::take_params)).
pub type ParamStorage = Storage;

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
