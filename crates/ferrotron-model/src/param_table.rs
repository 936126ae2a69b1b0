//! [`ParamTable`]: a model's parameter values in ONE flat [`Storage`] of one dtype, each
//! parameter a row-major range of it (a second one holds the frozen parameters, if any).
//!
//! Packed (parameters back to back in table order) when a model is built; re-homed into the
//! optimizer's flat buffer for training ([`ParamTable::rehome`], the buffer's layout: its
//! order, padding and bucket alignment), after which the model and Megatron-Core's
//! `_ParamAndGradBuffer.param_data` (`megatron/core/distributed/param_and_grad_buffer.py`,
//! whose module parameters are views into it) are the same memory: the trainer moves the
//! storage to the buffer for the optimizer step and back ([`ParamTable::take_storage`],
//! [`ParamTable::restore_storage`]) — a move, never a copy, so model state is Megatron's
//! 18 bytes per parameter in bf16 (2 bf16 weights, 4 f32 grad, 12 f32 master + Adam moments)
//! instead of a second weight copy beside the buffer.
//!
//! A weight served from GGUF stays in its ggml blocks ([`ParamValue::Quantized`]): its slot
//! takes no room in the storage and its view is a [`WeightRef::Quant`]; its quantized weights
//! cannot be written or trained.
//!
//! Frozen parameters (the base of a LoRA model, Megatron's `requires_grad = False`, which
//! stay out of `_ParamAndGradBuffer`) live in a second storage that never moves: the
//! optimizer's buffer holds the trainable ones only, and forward and backward read the
//! frozen ones while the trainable storage is lent.

use crate::{ModelError, Result};
use ferrotron_tensor::gemm::WeightRef;
use ferrotron_tensor::quant::QuantMatrix;
use ferrotron_tensor::{DType, Storage, Tensor, TensorView};
use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

/// One parameter's value as a model is built from it.
#[derive(Clone, Debug)]
pub enum ParamValue {
    /// Elements of a storage dtype (converted to the table's).
    Dense(Tensor),
    /// A `[rows, cols]` weight kept in ggml block formats (a GGUF file's quantized tensor).
    Quantized(QuantMatrix),
}

impl ParamValue {
    /// The value's shape (`[rows, cols]` for a quantized weight).
    pub fn shape(&self) -> Vec<usize> {
        match self {
            ParamValue::Dense(t) => t.shape().to_vec(),
            ParamValue::Quantized(q) => vec![q.rows(), q.cols()],
        }
    }
}

/// Dense values, one per tensor.
pub(crate) fn dense(tensors: Vec<Tensor>) -> Vec<ParamValue> {
    tensors.into_iter().map(ParamValue::Dense).collect()
}

impl From<Tensor> for ParamValue {
    fn from(t: Tensor) -> ParamValue {
        ParamValue::Dense(t)
    }
}

/// Where one parameter sits: a range of the trainable or the frozen storage, or its own
/// quantized blocks.
#[derive(Clone, Debug, PartialEq)]
struct Slot {
    offset: usize,
    shape: Vec<usize>,
    numel: usize,
    /// In the frozen storage (which never moves to the optimizer's buffer).
    frozen: bool,
    /// Set for a quantized weight, which takes no room in either storage (and is frozen).
    quant: Option<Arc<QuantMatrix>>,
}

impl Slot {
    fn range(&self) -> Range<usize> {
        let len = if self.quant.is_some() { 0 } else { self.numel };
        self.offset..self.offset + len
    }

    /// A dense parameter of the trainable storage.
    fn is_trainable(&self) -> bool {
        !self.frozen && self.quant.is_none()
    }
}

/// Parameter values in table order over one flat storage of trainable values and one of
/// frozen values (see the module doc).
#[derive(Clone, Debug)]
pub struct ParamTable {
    /// The trainable parameters; `None` while the storage is lent to the optimizer's buffer.
    storage: Option<Storage>,
    /// The frozen parameters (a LoRA model's base), back to back; stays with the table.
    frozen: Storage,
    dtype: DType,
    slots: Vec<Slot>,
}

impl ParamTable {
    /// The dense `values` converted to `dtype` (round-to-nearest-even when narrowing) and
    /// packed back to back in order, those flagged in `frozen` (one flag per value) in the
    /// frozen storage and the rest in the trainable one; quantized values kept as they are
    /// (frozen whatever their flag).
    ///
    /// # Panics
    /// `frozen` not one flag per value.
    pub fn packed(values: Vec<ParamValue>, dtype: DType, frozen: &[bool]) -> ParamTable {
        assert_eq!(values.len(), frozen.len(), "one frozen flag per value");
        let mut slots = Vec::with_capacity(values.len());
        let mut ends = [0usize; 2];
        for (v, &is_frozen) in values.iter().zip(frozen) {
            let shape = v.shape();
            let numel = shape.iter().product();
            let quantized = matches!(v, ParamValue::Quantized(_));
            let end = &mut ends[usize::from(is_frozen)];
            slots.push(Slot {
                offset: *end,
                shape,
                numel,
                frozen: is_frozen || quantized,
                quant: None,
            });
            if !quantized {
                *end += numel;
            }
        }
        let mut storage = Storage::zeros(dtype, ends[0]);
        let mut frozen = Storage::zeros(dtype, ends[1]);
        // The quantized blocks move into their slots (no copy).
        for (v, slot) in values.into_iter().zip(&mut slots) {
            let dst = if slot.frozen {
                &mut frozen
            } else {
                &mut storage
            };
            match v {
                ParamValue::Dense(t) => write_tensor(dst, slot.range(), &t),
                ParamValue::Quantized(q) => slot.quant = Some(Arc::new(q)),
            }
        }
        ParamTable {
            storage: Some(storage),
            frozen,
            dtype,
            slots,
        }
    }

    /// Parameter `i` as a value to build a model from: a copy of its dense elements in the
    /// table's dtype, or its quantized blocks (shared, not copied).
    ///
    /// # Panics
    /// As [`ParamTable::view`].
    pub fn value(&self, i: usize) -> ParamValue {
        match &self.slots[i].quant {
            Some(q) => ParamValue::Quantized((**q).clone()),
            None => ParamValue::Dense(self.view(i).to_tensor()),
        }
    }

    /// Every parameter's [`ParamTable::value`], in table order.
    pub fn into_values(self) -> Vec<ParamValue> {
        (0..self.len()).map(|i| self.value(i)).collect()
    }

    /// Number of parameters.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// True when the table holds no parameters.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The storage dtype of every parameter.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Parameter `i`'s shape.
    ///
    /// # Panics
    /// `i >= len()`.
    pub fn shape(&self, i: usize) -> &[usize] {
        &self.slots[i].shape
    }

    /// Parameter `i`'s element count.
    ///
    /// # Panics
    /// `i >= len()`.
    pub fn numel(&self, i: usize) -> usize {
        self.slots[i].numel
    }

    /// The storage, which the table holds except while the trainer has lent it to the
    /// optimizer's buffer; reading values then is a bug in the trainer, not an input error.
    fn storage(&self) -> &Storage {
        self.storage
            .as_ref()
            .expect("parameter values read while the storage is lent to the optimizer buffer")
    }

    /// Parameter `i` borrowed in the storage dtype.
    ///
    /// # Panics
    /// `i >= len()`, or the storage is lent out.
    pub fn view(&self, i: usize) -> TensorView<'_> {
        let slot = &self.slots[i];
        let data = match &slot.quant {
            Some(q) => WeightRef::Quant(q),
            None if slot.frozen => self.frozen.view(slot.range()),
            None => self.storage().view(slot.range()),
        };
        TensorView::new(&slot.shape, data).expect("a slot's range matches its shape")
    }

    /// Bytes of the quantized weights (beside [`ParamTable::storage_bytes`]).
    pub fn quantized_bytes(&self) -> usize {
        self.slots
            .iter()
            .filter_map(|s| s.quant.as_ref())
            .map(|q| q.nbytes())
            .sum()
    }

    /// Parameter `i` as f32: borrowed from an f32 table, widened (exactly) otherwise.
    ///
    /// # Panics
    /// As [`ParamTable::view`].
    pub fn f32_values(&self, i: usize) -> Cow<'_, [f32]> {
        self.view(i).to_f32()
    }

    /// Overwrites parameter `i` from f32 `values` (rounded to nearest-even for bf16/f16).
    ///
    /// # Errors
    /// `values` not `numel(i)` long (nothing written), naming `name`.
    ///
    /// # Panics
    /// As [`ParamTable::view`].
    pub fn set_from_f32(&mut self, i: usize, name: &str, values: &[f32]) -> Result<()> {
        let slot = &self.slots[i];
        if slot.quant.is_some() {
            return Err(ModelError::Input(format!(
                "{name}: a quantized weight cannot be written"
            )));
        }
        if values.len() != slot.numel {
            return Err(ModelError::Input(format!(
                "{name}: slice of {} elements, the parameter has {} ({:?})",
                values.len(),
                slot.numel,
                slot.shape
            )));
        }
        let range = slot.range();
        let storage = if slot.frozen {
            &mut self.frozen
        } else {
            self.storage.as_mut().expect(
                "parameter values written while the storage is lent to the optimizer buffer",
            )
        };
        storage.set_from_f32(range, values);
        Ok(())
    }

    /// Moves every trainable parameter into `storage` at `offsets` (one per parameter, table
    /// order; a frozen parameter's offset is ignored, as are the storage's other elements —
    /// the buffer's padding) and makes it the table's trainable storage; the old one is
    /// freed. Frozen parameters stay where they are.
    ///
    /// # Errors
    /// A count, dtype or range that does not fit (overlapping or out of bounds ranges);
    /// the table is unchanged then.
    pub fn rehome(&mut self, mut storage: Storage, offsets: &[usize]) -> Result<()> {
        if offsets.len() != self.slots.len() || storage.dtype() != self.dtype {
            return Err(ModelError::Input(format!(
                "re-homing {} {:?} parameters into {} offsets of {:?} storage",
                self.slots.len(),
                self.dtype,
                offsets.len(),
                storage.dtype()
            )));
        }
        let mut slots = self.slots.clone();
        for (slot, &offset) in slots.iter_mut().zip(offsets) {
            if slot.is_trainable() {
                slot.offset = offset;
            }
        }
        check_disjoint(&slots, storage.len())?;
        let old = self.storage();
        for (new, old_slot) in slots.iter().zip(&self.slots) {
            if new.is_trainable() {
                copy_range(old, old_slot.range(), &mut storage, new.offset);
            }
        }
        self.storage = Some(storage);
        self.slots = slots;
        Ok(())
    }

    /// Moves the storage out (to the optimizer's buffer, which shares the layout after
    /// [`ParamTable::rehome`]); the table holds no values until
    /// [`ParamTable::restore_storage`].
    ///
    /// # Errors
    /// The storage is already lent out.
    pub fn take_storage(&mut self) -> Result<Storage> {
        self.storage.take().ok_or_else(|| {
            ModelError::Input("the parameter storage is already lent to the optimizer".into())
        })
    }

    /// Takes `storage` back after [`ParamTable::take_storage`].
    ///
    /// # Errors
    /// The table holds a storage already, or `storage` has another dtype or is too short for
    /// the slots (it is dropped then, and the table stays without values).
    pub fn restore_storage(&mut self, storage: Storage) -> Result<()> {
        if self.storage.is_some() {
            return Err(ModelError::Input(
                "the parameter storage was not lent out: nothing to restore".into(),
            ));
        }
        let end = self
            .slots
            .iter()
            .filter(|s| s.is_trainable())
            .map(|s| s.offset + s.numel)
            .max();
        if storage.dtype() != self.dtype || end.is_some_and(|end| end > storage.len()) {
            return Err(ModelError::Input(format!(
                "restored parameter storage is {} elements of {:?}; the table needs {:?} up \
                 to element {}",
                storage.len(),
                storage.dtype(),
                self.dtype,
                end.unwrap_or(0)
            )));
        }
        self.storage = Some(storage);
        Ok(())
    }

    /// Bytes of both storages held in memory ([`Storage::resident_bytes`]: pages a
    /// ZeRO-3 trainer released are not).
    pub fn resident_bytes(&self) -> usize {
        self.storage.as_ref().map_or(0, Storage::resident_bytes) + self.frozen.resident_bytes()
    }

    /// Bytes of the dense values: the trainable storage (padding included; 0 while lent
    /// out) and the frozen one.
    pub fn storage_bytes(&self) -> usize {
        let bytes = |s: &Storage| s.len() * s.dtype().size_in_bytes();
        self.storage.as_ref().map_or(0, bytes) + bytes(&self.frozen)
    }

    /// Whether parameter `i` is frozen (in the frozen storage, or quantized).
    ///
    /// # Panics
    /// `i >= len()`.
    pub fn is_frozen(&self, i: usize) -> bool {
        self.slots[i].frozen
    }
}

/// Errors unless the trainable slots' ranges are disjoint and inside `len` elements.
fn check_disjoint(slots: &[Slot], len: usize) -> Result<()> {
    let trainable = slots.iter().filter(|s| s.is_trainable());
    let mut ranges: Vec<Range<usize>> = trainable.map(Slot::range).collect();
    ranges.sort_by_key(|r| r.start);
    let mut end = 0;
    for r in ranges {
        if r.start < end || r.end > len {
            return Err(ModelError::Input(format!(
                "parameter range {r:?} overlaps another or leaves the {len}-element storage"
            )));
        }
        end = r.end;
    }
    Ok(())
}

/// Writes tensor `t` (any dtype) into `dst[range]` in `dst`'s dtype.
fn write_tensor(dst: &mut Storage, range: Range<usize>, t: &Tensor) {
    if t.dtype() == dst.dtype() {
        copy_range(t.storage(), 0..t.numel(), dst, range.start);
    } else {
        dst.set_from_f32(range, &t.to_f32_vec());
    }
}

/// Copies `src[range]` to `dst[at..]` (same dtype).
fn copy_range(src: &Storage, range: Range<usize>, dst: &mut Storage, at: usize) {
    let n = range.len();
    match (src, dst) {
        (Storage::F32(s), Storage::F32(d)) => d[at..at + n].copy_from_slice(&s[range]),
        (Storage::BF16(s), Storage::BF16(d)) => d[at..at + n].copy_from_slice(&s[range]),
        (Storage::F16(s), Storage::F16(d)) => d[at..at + n].copy_from_slice(&s[range]),
        _ => unreachable!("copy_range between storages of one dtype"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> ParamTable {
        let a = Tensor::from_f32(&[2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let b = Tensor::from_f32(&[2], vec![1.0 + 1.0 / 512.0, -7.0]).unwrap();
        ParamTable::packed(vec![a.into(), b.into()], DType::BF16, &[false, false])
    }

    #[test]
    fn packing_rounds_to_the_table_dtype() {
        let t = table();
        assert_eq!(t.dtype(), DType::BF16);
        assert_eq!(t.view(0).shape(), &[2, 3]);
        // 1 + 2^-9 is a quarter of a bf16 ulp above 1: it rounds to 1.
        assert_eq!(&*t.f32_values(1), &[1.0, -7.0]);
        assert_eq!(t.storage_bytes(), 8 * 2);
    }

    #[test]
    fn rehome_moves_values_to_the_offsets_and_keeps_the_padding() {
        let mut t = table();
        let mut dst = Storage::zeros(DType::BF16, 12);
        dst.set_from_f32(10..12, &[9.0, 9.0]);
        t.rehome(dst, &[3, 0]).unwrap();
        assert_eq!(&*t.f32_values(0), &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(&*t.f32_values(1), &[1.0, -7.0]);
        let storage = t.take_storage().unwrap();
        let all = storage.to_f32_range(0..12);
        assert_eq!(all, [1., -7., 0., 1., 2., 3., 4., 5., 6., 0., 9., 9.]);
        t.restore_storage(storage).unwrap();
        assert_eq!(t.view(0).numel(), 6);
    }

    #[test]
    fn bad_layouts_and_lending_errors_leave_the_table_usable() {
        let mut t = table();
        let overlap = t.rehome(Storage::zeros(DType::BF16, 12), &[0, 5]);
        assert!(format!("{}", overlap.unwrap_err()).contains("overlaps"));
        let short = t.rehome(Storage::zeros(DType::BF16, 7), &[0, 6]);
        assert!(format!("{}", short.unwrap_err()).contains("leaves the 7-element storage"));
        let dtype = t.rehome(Storage::zeros(DType::F32, 8), &[0, 6]);
        assert!(dtype.is_err());
        assert_eq!(&*t.f32_values(1), &[1.0, -7.0]);
        let storage = t.take_storage().unwrap();
        assert!(t.take_storage().is_err());
        assert!(t.restore_storage(Storage::zeros(DType::BF16, 3)).is_err());
        t.restore_storage(storage).unwrap();
        assert!(t.restore_storage(Storage::zeros(DType::BF16, 8)).is_err());
        let err = t.set_from_f32(1, "b", &[1.0]).unwrap_err();
        assert!(format!("{err}").contains("b: slice of 1 elements"));
    }

    #[test]
    fn quantized_slots_keep_their_blocks_and_refuse_writes() {
        use ferrotron_tensor::quant::{QuantMatrix, QuantType};
        let a = Tensor::from_f32(&[2], vec![1.0, 2.0]).unwrap();
        // Two Q8_0 rows of 32 values: scale 1.0 (f16 0x3C00), values 0..32.
        let mut bytes = Vec::new();
        for _ in 0..2 {
            bytes.extend([0x00, 0x3C]);
            bytes.extend(0..32u8);
        }
        let q = QuantMatrix::new(QuantType::Q8_0, 2, 32, bytes).unwrap();
        let values = vec![a.into(), ParamValue::Quantized(q)];
        let mut t = ParamTable::packed(values, DType::F32, &[false, false]);
        assert_eq!(t.storage_bytes(), 2 * 4);
        assert_eq!(t.quantized_bytes(), 2 * 34);
        assert!(matches!(t.view(1).weight_ref(), WeightRef::Quant(_)));
        assert_eq!(t.view(1).shape(), &[2, 32]);
        assert_eq!(t.f32_values(1)[..3], [0.0, 1.0, 2.0]);
        assert_eq!(&*t.f32_values(0), &[1.0, 2.0]);
        let err = t.set_from_f32(1, "w", &[0.0; 64]).unwrap_err();
        assert!(format!("{err}").contains("w: a quantized weight cannot be written"));
        assert!(t.is_frozen(1));
        // The quantized weight stays behind; the dense one moves.
        t.rehome(Storage::zeros(DType::F32, 4), &[2, 0]).unwrap();
        assert_eq!(&*t.f32_values(0), &[1.0, 2.0]);
        assert_eq!(t.f32_values(1)[..3], [0.0, 1.0, 2.0]);
    }

    #[test]
    fn frozen_values_stay_readable_while_the_trainable_storage_is_lent() {
        let a = Tensor::from_f32(&[2], vec![1.0, 2.0]).unwrap();
        let b = Tensor::from_f32(&[3], vec![3.0, 4.0, 5.0]).unwrap();
        let mut t = ParamTable::packed(vec![a.into(), b.into()], DType::F32, &[true, false]);
        assert_eq!(t.storage_bytes(), 5 * 4);
        t.rehome(Storage::zeros(DType::F32, 3), &[99, 0]).unwrap();
        let lent = t.take_storage().unwrap();
        assert_eq!(lent.to_f32_range(0..3), [3.0, 4.0, 5.0]);
        assert_eq!(&*t.f32_values(0), &[1.0, 2.0]);
        t.set_from_f32(0, "a", &[7.0, 8.0]).unwrap();
        t.restore_storage(lent).unwrap();
        assert_eq!(&*t.f32_values(0), &[7.0, 8.0]);
        assert_eq!(&*t.f32_values(1), &[3.0, 4.0, 5.0]);
    }
}
