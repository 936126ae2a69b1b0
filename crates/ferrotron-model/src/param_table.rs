//! [`ParamTable`]: a model's parameter values in ONE flat [`Storage`] of one dtype, each
//! parameter a row-major range of it (a second one holds the frozen parameters, if any, and
//! a third, always f32, the buffers).
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
//!
//! Buffers (Megatron's registered buffers: the MoE router's `expert_bias`) are kept in f32
//! whatever the weights' dtype, as Megatron keeps `expert_bias` in fp32 under bf16 training
//! (`megatron/core/transformer/moe/router.py`: `torch.zeros(..., dtype=torch.float32)`): an
//! update of `rate = 1e-3` must move a bias of 0.5, which bf16 (ulp 2^-8) would round away.

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

/// Which of a table's storages holds a dense parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamHome {
    /// The trainable storage (the table's dtype), lent to the optimizer's buffer.
    Trainable,
    /// The frozen storage (the table's dtype; a LoRA model's base), which never moves.
    Frozen,
    /// The buffer storage, f32 whatever the table's dtype, which never moves: not trained,
    /// written by the trainer (see the module doc).
    Buffer,
}

/// Where one parameter sits: a range of one of the storages, or its own quantized blocks.
#[derive(Clone, Debug, PartialEq)]
struct Slot {
    offset: usize,
    shape: Vec<usize>,
    numel: usize,
    /// The storage holding it ([`ParamHome::Frozen`] for a quantized weight).
    home: ParamHome,
    /// Set for a quantized weight, which takes no room in any storage.
    quant: Option<Arc<QuantMatrix>>,
}

impl Slot {
    fn range(&self) -> Range<usize> {
        let len = if self.quant.is_some() { 0 } else { self.numel };
        self.offset..self.offset + len
    }

    /// A dense parameter of the trainable storage.
    fn is_trainable(&self) -> bool {
        self.home == ParamHome::Trainable && self.quant.is_none()
    }
}

/// Parameter values in table order over one flat storage of trainable values, one of frozen
/// values and one of f32 buffers (see the module doc).
#[derive(Clone, Debug)]
pub struct ParamTable {
    /// The trainable parameters; `None` while the storage is lent to the optimizer's buffer.
    storage: Option<Storage>,
    /// The frozen parameters (a LoRA model's base), back to back; stays with the table.
    frozen: Storage,
    /// The buffers, back to back, in f32; stays with the table.
    buffers: Storage,
    dtype: DType,
    slots: Vec<Slot>,
}

impl ParamTable {
    /// The dense `values` packed back to back in order, each in the storage of its home (one
    /// per value): converted to `dtype` (round-to-nearest-even when narrowing), buffers to
    /// f32; quantized values kept as they are (frozen whatever their home).
    ///
    /// # Panics
    /// `homes` not one per value.
    pub fn packed(values: Vec<ParamValue>, dtype: DType, homes: &[ParamHome]) -> ParamTable {
        assert_eq!(values.len(), homes.len(), "one home per value");
        let mut slots = Vec::with_capacity(values.len());
        let mut ends = [0usize; 3];
        for (v, &home) in values.iter().zip(homes) {
            let shape = v.shape();
            let numel = shape.iter().product();
            let quantized = matches!(v, ParamValue::Quantized(_));
            let home = if quantized { ParamHome::Frozen } else { home };
            let end = &mut ends[home as usize];
            slots.push(Slot {
                offset: *end,
                shape,
                numel,
                home,
                quant: None,
            });
            if !quantized {
                *end += numel;
            }
        }
        let mut table = ParamTable {
            storage: Some(Storage::zeros(dtype, ends[ParamHome::Trainable as usize])),
            frozen: Storage::zeros(dtype, ends[ParamHome::Frozen as usize]),
            buffers: Storage::zeros(DType::F32, ends[ParamHome::Buffer as usize]),
            dtype,
            slots: Vec::new(),
        };
        // The quantized blocks move into their slots (no copy).
        for (v, slot) in values.into_iter().zip(&mut slots) {
            match v {
                ParamValue::Dense(t) => write_tensor(table.home_mut(slot.home), slot.range(), &t),
                ParamValue::Quantized(q) => slot.quant = Some(Arc::new(q)),
            }
        }
        table.slots = slots;
        table
    }

    /// The table with its dense weights converted to `dtype` (round-to-nearest-even when
    /// narrowing), in the same layout; buffers stay f32 and quantized weights are shared.
    ///
    /// # Panics
    /// The trainable storage is lent out.
    pub fn to_dtype(&self, dtype: DType) -> ParamTable {
        const BLOCK: usize = 1 << 20;
        let convert = |s: &Storage| {
            let mut out = Storage::zeros(dtype, s.len());
            for start in (0..s.len()).step_by(BLOCK) {
                let block = start..(start + BLOCK).min(s.len());
                out.set_from_f32(block.clone(), &s.to_f32_range(block));
            }
            out
        };
        ParamTable {
            storage: Some(convert(self.storage())),
            frozen: convert(&self.frozen),
            buffers: self.buffers.clone(),
            dtype,
            slots: self.slots.clone(),
        }
    }

    /// The storage of `home` (the trainable one must not be lent out; see
    /// [`ParamTable::storage`]).
    fn home(&self, home: ParamHome) -> &Storage {
        match home {
            ParamHome::Trainable => self.storage(),
            ParamHome::Frozen => &self.frozen,
            ParamHome::Buffer => &self.buffers,
        }
    }

    /// The storage of `home`, to write.
    fn home_mut(&mut self, home: ParamHome) -> &mut Storage {
        match home {
            ParamHome::Trainable => self.storage.as_mut().expect(
                "parameter values written while the storage is lent to the optimizer buffer",
            ),
            ParamHome::Frozen => &mut self.frozen,
            ParamHome::Buffer => &mut self.buffers,
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

    /// The storage dtype of every parameter but the buffers (f32).
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

    /// Parameter `i` borrowed in its storage's dtype.
    ///
    /// # Panics
    /// `i >= len()`, or the storage is lent out.
    pub fn view(&self, i: usize) -> TensorView<'_> {
        let slot = &self.slots[i];
        let data = match &slot.quant {
            Some(q) => WeightRef::Quant(q),
            None => self.home(slot.home).view(slot.range()),
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

    /// Parameter `i` as f32: borrowed from an f32 storage, widened (exactly) otherwise.
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
        let (range, home) = (slot.range(), slot.home);
        self.home_mut(home).set_from_f32(range, values);
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

    /// Bytes of the storages held in memory ([`Storage::resident_bytes`]: pages a
    /// ZeRO-3 trainer released are not).
    pub fn resident_bytes(&self) -> usize {
        let kept = self.frozen.resident_bytes() + self.buffers.resident_bytes();
        self.storage.as_ref().map_or(0, Storage::resident_bytes) + kept
    }

    /// Bytes of the dense values: the trainable storage (padding included; 0 while lent
    /// out), the frozen one and the buffers.
    pub fn storage_bytes(&self) -> usize {
        let bytes = |s: &Storage| s.len() * s.dtype().size_in_bytes();
        self.storage.as_ref().map_or(0, bytes) + bytes(&self.frozen) + bytes(&self.buffers)
    }

    /// Whether parameter `i` is not trained: frozen, quantized or a buffer.
    ///
    /// # Panics
    /// `i >= len()`.
    pub fn is_frozen(&self, i: usize) -> bool {
        self.slots[i].home != ParamHome::Trainable
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
#[path = "param_table_tests.rs"]
mod tests;
