use crate::gemm::WeightRef;
use crate::{DType, Element, Result, Storage, TensorError};
use half::{bf16, f16};
use rayon::prelude::*;
use std::borrow::Cow;

/// Where a tensor's storage lives. Only the CPU exists today; CUDA comes later
/// (design.md: everything must build and pass tests without a GPU).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Device {
    #[default]
    Cpu,
}

/// A dense row-major tensor on the CPU: a shape and contiguous storage.
///
/// Parameters are `Tensor`s (HF layout, e.g. a linear weight is `[out, in]`); kernels take
/// plain slices so activations can live in reusable buffers.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    storage: Storage,
}

fn numel_of(shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| TensorError::Overflow(shape.to_vec()))
}

impl Tensor {
    /// Wraps storage with a shape. Errors when the element counts differ.
    pub fn new(shape: &[usize], storage: Storage) -> Result<Tensor> {
        let expected = numel_of(shape)?;
        if expected != storage.len() {
            return Err(TensorError::ShapeMismatch {
                shape: shape.to_vec(),
                expected,
                actual: storage.len(),
            });
        }
        Ok(Tensor {
            shape: shape.to_vec(),
            storage,
        })
    }

    /// An f32 tensor from data. Errors when `data.len()` differs from the shape's product.
    pub fn from_f32(shape: &[usize], data: Vec<f32>) -> Result<Tensor> {
        Tensor::new(shape, Storage::F32(data))
    }

    /// A zero-filled tensor.
    pub fn zeros(shape: &[usize], dtype: DType) -> Result<Tensor> {
        Ok(Tensor {
            shape: shape.to_vec(),
            storage: Storage::zeros(dtype, numel_of(shape)?),
        })
    }

    /// The shape, outermost dimension first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.storage.len()
    }

    /// Storage dtype.
    pub fn dtype(&self) -> DType {
        self.storage.dtype()
    }

    /// Always `Device::Cpu` today.
    pub fn device(&self) -> Device {
        Device::Cpu
    }

    /// The underlying storage.
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// Consumes the tensor, returning its storage.
    pub fn into_storage(self) -> Storage {
        self.storage
    }

    /// The elements as f32, or `DTypeMismatch` for another dtype.
    pub fn as_f32(&self) -> Result<&[f32]> {
        match &self.storage {
            Storage::F32(v) => Ok(v),
            other => Err(TensorError::DTypeMismatch {
                expected: DType::F32,
                actual: other.dtype(),
            }),
        }
    }

    /// The elements as mutable f32, or `DTypeMismatch` for another dtype.
    pub fn as_f32_mut(&mut self) -> Result<&mut [f32]> {
        match &mut self.storage {
            Storage::F32(v) => Ok(v),
            other => Err(TensorError::DTypeMismatch {
                expected: DType::F32,
                actual: other.dtype(),
            }),
        }
    }

    /// Overwrites every element from `src` (f32, rounded to nearest-even into a bf16/f16
    /// storage), in place: no new storage is allocated.
    ///
    /// # Errors
    /// `ShapeMismatch` when `src` is not `numel` long (nothing is written then).
    pub fn copy_from_f32(&mut self, src: &[f32]) -> Result<()> {
        if src.len() != self.numel() {
            return Err(TensorError::ShapeMismatch {
                shape: self.shape.clone(),
                expected: self.numel(),
                actual: src.len(),
            });
        }
        self.storage.set_from_f32(0..src.len(), src);
        Ok(())
    }

    /// Borrows the elements as a GEMM operand in their storage dtype.
    pub fn weight_ref(&self) -> WeightRef<'_> {
        self.storage.as_view()
    }

    /// Borrows the whole tensor as a [`TensorView`].
    pub fn view(&self) -> TensorView<'_> {
        TensorView {
            shape: &self.shape,
            data: self.weight_ref(),
        }
    }

    /// Stacks row ranges of 2-D tensors (all of one dtype and column count) into one
    /// `[Σ rows, cols]` tensor, in order. Used to pack HF projections into Megatron's fused
    /// `linear_qkv` / `linear_fc1` layouts.
    pub fn cat_rows(pieces: &[(&Tensor, std::ops::Range<usize>)]) -> Result<Tensor> {
        let Some((first, _)) = pieces.first() else {
            return Tensor::zeros(&[0, 0], DType::F32);
        };
        let cols = first.shape().get(1).copied().unwrap_or(0);
        let dtype = first.dtype();
        let mut rows = 0;
        for (t, r) in pieces {
            if t.shape().len() != 2 || t.shape()[1] != cols || r.end > t.shape()[0] {
                return Err(TensorError::ShapeMismatch {
                    shape: t.shape().to_vec(),
                    expected: cols,
                    actual: t.shape().get(1).copied().unwrap_or(0),
                });
            }
            if t.dtype() != dtype {
                return Err(TensorError::DTypeMismatch {
                    expected: dtype,
                    actual: t.dtype(),
                });
            }
            rows += r.len();
        }
        fn cat<E: Copy>(parts: Vec<(&[E], std::ops::Range<usize>)>, cols: usize) -> Vec<E> {
            let mut out = Vec::new();
            for (data, r) in parts {
                out.extend_from_slice(&data[r.start * cols..r.end * cols]);
            }
            out
        }
        let storage = match &first.storage {
            Storage::F32(_) => Storage::F32(cat(
                pieces
                    .iter()
                    .map(|(t, r)| (t.as_slice::<f32>(), r.clone()))
                    .collect(),
                cols,
            )),
            Storage::BF16(_) => Storage::BF16(cat(
                pieces
                    .iter()
                    .map(|(t, r)| (t.as_slice::<bf16>(), r.clone()))
                    .collect(),
                cols,
            )),
            Storage::F16(_) => Storage::F16(cat(
                pieces
                    .iter()
                    .map(|(t, r)| (t.as_slice::<f16>(), r.clone()))
                    .collect(),
                cols,
            )),
        };
        Tensor::new(&[rows, cols], storage)
    }

    /// The elements as `E`; panics when `E` is not the storage dtype (internal use after a
    /// dtype check).
    fn as_slice<E: Element>(&self) -> &[E] {
        fn cast<A: 'static, B: 'static>(v: &[A]) -> &[B] {
            assert_eq!(std::any::TypeId::of::<A>(), std::any::TypeId::of::<B>());
            // SAFETY: A and B are the same type (checked above).
            unsafe { std::slice::from_raw_parts(v.as_ptr() as *const B, v.len()) }
        }
        match &self.storage {
            Storage::F32(v) => cast(v),
            Storage::BF16(v) => cast(v),
            Storage::F16(v) => cast(v),
        }
    }

    /// Same data with a new shape of equal element count.
    pub fn reshape(self, shape: &[usize]) -> Result<Tensor> {
        Tensor::new(shape, self.storage)
    }

    /// All elements converted to f32 (a copy, rayon-parallel).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        self.storage.to_f32_range(0..self.numel())
    }

    /// Converts to another storage dtype (round-to-nearest-even for narrowing).
    pub fn to_dtype(&self, dtype: DType) -> Tensor {
        if dtype == self.dtype() {
            return self.clone();
        }
        let f = self.to_f32_vec();
        let storage = match dtype {
            DType::F32 => Storage::F32(f),
            DType::BF16 => Storage::BF16(convert_slice(&f)),
            DType::F16 => Storage::F16(convert_slice(&f)),
        };
        Tensor {
            shape: self.shape.clone(),
            storage,
        }
    }
}

/// A borrowed tensor: a shape over elements in their storage dtype, e.g. one parameter of
/// a model's flat parameter table (`ferrotron_model::ParamTable`) or a whole [`Tensor`]
/// ([`Tensor::view`]).
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    shape: &'a [usize],
    data: WeightRef<'a>,
}

impl<'a> TensorView<'a> {
    /// `data` viewed with `shape`.
    ///
    /// # Errors
    /// `ShapeMismatch` when `data` does not hold exactly the shape's element count.
    pub fn new(shape: &'a [usize], data: WeightRef<'a>) -> Result<TensorView<'a>> {
        let expected = numel_of(shape)?;
        if expected != data.len() {
            return Err(TensorError::ShapeMismatch {
                shape: shape.to_vec(),
                expected,
                actual: data.len(),
            });
        }
        Ok(TensorView { shape, data })
    }

    /// The shape, outermost dimension first.
    pub fn shape(&self) -> &'a [usize] {
        self.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// Storage dtype.
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    /// The elements as a GEMM operand in their storage dtype.
    pub fn weight_ref(&self) -> WeightRef<'a> {
        self.data
    }

    /// The elements as f32: borrowed when stored in f32, widened (exactly) otherwise.
    pub fn to_f32(&self) -> Cow<'a, [f32]> {
        self.data.to_f32()
    }

    /// An owned copy (a quantized weight dequantized to f32).
    pub fn to_tensor(&self) -> Tensor {
        let storage = match self.data {
            WeightRef::F32(v) => Storage::F32(v.to_vec()),
            WeightRef::BF16(v) => Storage::BF16(v.to_vec()),
            WeightRef::F16(v) => Storage::F16(v.to_vec()),
            WeightRef::Quant(_) => Storage::F32(self.data.to_f32().into_owned()),
        };
        Tensor {
            shape: self.shape.to_vec(),
            storage,
        }
    }
}

/// Converts a slice between storage element types through f32, in parallel.
pub fn convert_slice<S: Element, D: Element>(src: &[S]) -> Vec<D> {
    let mut out = Vec::with_capacity(src.len());
    src.par_iter()
        .map(|&x| D::from_f32(x.to_f32()))
        .collect_into_vec(&mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_mismatch_is_an_error() {
        let err = Tensor::from_f32(&[2, 3], vec![0.0; 5]).unwrap_err();
        assert!(err.to_string().contains("needs 6 elements, got 5"), "{err}");
    }

    #[test]
    fn cat_rows_stacks_ranges() {
        let a = Tensor::from_f32(&[3, 2], vec![0., 1., 2., 3., 4., 5.]).unwrap();
        let b = Tensor::from_f32(&[1, 2], vec![9., 9.]).unwrap();
        let c = Tensor::cat_rows(&[(&a, 2..3), (&b, 0..1), (&a, 0..1)]).unwrap();
        assert_eq!(c.shape(), &[3, 2]);
        assert_eq!(c.as_f32().unwrap(), &[4., 5., 9., 9., 0., 1.]);
        let wrong = Tensor::from_f32(&[1, 3], vec![0.; 3]).unwrap();
        assert!(Tensor::cat_rows(&[(&a, 0..1), (&wrong, 0..1)]).is_err());
    }

    #[test]
    fn dtype_round_trip() {
        let t = Tensor::from_f32(&[3], vec![1.0, -2.5, 0.15625]).unwrap();
        let b = t.to_dtype(DType::BF16);
        assert_eq!(b.dtype(), DType::BF16);
        assert_eq!(
            b.to_dtype(DType::F32).as_f32().unwrap(),
            &[1.0, -2.5, 0.15625]
        );
        assert!(b.as_f32().is_err());
    }
}
