//! Bounds-checked little-endian reading of the GGUF header, metadata and tensor table.
//!
//! Layout (llama.cpp `ggml/src/gguf.cpp`, `gguf_init_from_file_impl`; gguf-py `gguf_reader.py`):
//! magic `GGUF`, u32 version, u64 tensor count, u64 metadata count, the metadata key/value pairs
//! (string key, u32 type tag, value), then per tensor: string name, u32 n_dims, n_dims x u64 `ne`
//! (fastest-varying first), u32 ggml type, u64 offset relative to the data section.
//! Strings are a u64 byte length followed by UTF-8 bytes.

use super::reader::{TensorInfo, tensor_err};
use super::types::{GgmlType, GgufValueType};
use super::value::{GgufArray, GgufValue};
use crate::CheckpointError;

/// Arrays of arrays deeper than this are rejected (llama.cpp itself supports none; this bound
/// keeps recursion shallow on hostile input).
const MAX_ARRAY_DEPTH: u32 = 8;

/// A read position in the file's bytes. Every read checks that the bytes exist.
pub(crate) struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    file: &'a str,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(buf: &'a [u8], file: &'a str) -> Self {
        Cursor { buf, pos: 0, file }
    }

    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    pub(crate) fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    pub(crate) fn err(&self, detail: String) -> CheckpointError {
        CheckpointError::Format {
            file: self.file.to_string(),
            detail,
        }
    }

    /// The next `n` bytes; `what` names the field for the error.
    pub(crate) fn take(
        &mut self,
        n: u64,
        what: &dyn Fn() -> String,
    ) -> Result<&'a [u8], CheckpointError> {
        let rem = self.remaining();
        if n > rem {
            return Err(self.err(format!(
                "truncated: {} at offset {} needs {} bytes but only {} remain (file is {} bytes)",
                what(),
                self.pos,
                n,
                rem,
                self.buf.len()
            )));
        }
        let start = self.pos;
        // n <= rem <= usize::MAX, so the cast and the addition are exact.
        self.pos += n as usize;
        Ok(&self.buf[start..self.pos])
    }

    fn array<const N: usize>(
        &mut self,
        what: &dyn Fn() -> String,
    ) -> Result<[u8; N], CheckpointError> {
        let bytes = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    pub(crate) fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, CheckpointError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, CheckpointError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A GGUF string: u64 length, then that many bytes, which must be UTF-8 (as gguf-py and
    /// transformers' reader require).
    pub(crate) fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, CheckpointError> {
        let len = self.u64(&|| format!("{} (string length)", what()))?;
        let at = self.pos;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|e| {
            self.err(format!(
                "{} at offset {at}: string is not valid UTF-8 ({e})",
                what()
            ))
        })
    }

    /// A u32 type tag followed by a value of that type.
    pub(crate) fn tagged_value(
        &mut self,
        what: &dyn Fn() -> String,
    ) -> Result<GgufValue, CheckpointError> {
        let tag = self.u32(&|| format!("{} (value type)", what()))?;
        let ty = GgufValueType::from_id(tag).ok_or_else(|| {
            self.err(format!(
                "{}: unknown value type {tag} (expected 0..=12)",
                what()
            ))
        })?;
        self.value(ty, what, 0)
    }

    fn value(
        &mut self,
        ty: GgufValueType,
        what: &dyn Fn() -> String,
        depth: u32,
    ) -> Result<GgufValue, CheckpointError> {
        use GgufValueType as T;
        Ok(match ty {
            T::U8 => GgufValue::U8(u8::from_le_bytes(self.array(what)?)),
            T::I8 => GgufValue::I8(i8::from_le_bytes(self.array(what)?)),
            T::U16 => GgufValue::U16(u16::from_le_bytes(self.array(what)?)),
            T::I16 => GgufValue::I16(i16::from_le_bytes(self.array(what)?)),
            T::U32 => GgufValue::U32(u32::from_le_bytes(self.array(what)?)),
            T::I32 => GgufValue::I32(i32::from_le_bytes(self.array(what)?)),
            T::F32 => GgufValue::F32(f32::from_le_bytes(self.array(what)?)),
            T::Bool => GgufValue::Bool(u8::from_le_bytes(self.array(what)?) != 0),
            T::String => GgufValue::String(self.string(what)?),
            T::Array => GgufValue::Array(self.array_value(what, depth)?),
            T::U64 => GgufValue::U64(u64::from_le_bytes(self.array(what)?)),
            T::I64 => GgufValue::I64(i64::from_le_bytes(self.array(what)?)),
            T::F64 => GgufValue::F64(f64::from_le_bytes(self.array(what)?)),
        })
    }

    /// An array body: u32 element type, u64 count, then the elements. The count is checked
    /// against the bytes left before anything is allocated.
    fn array_value(
        &mut self,
        what: &dyn Fn() -> String,
        depth: u32,
    ) -> Result<GgufArray, CheckpointError> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(self.err(format!(
                "{}: arrays nested deeper than {MAX_ARRAY_DEPTH}",
                what()
            )));
        }
        let tag = self.u32(&|| format!("{} (array element type)", what()))?;
        let ty = GgufValueType::from_id(tag).ok_or_else(|| {
            self.err(format!(
                "{}: unknown array element type {tag} (expected 0..=12)",
                what()
            ))
        })?;
        let count = self.u64(&|| format!("{} (array length)", what()))?;
        let min = ty.min_encoded_size();
        let rem = self.remaining();
        if count.checked_mul(min).is_none_or(|need| need > rem) {
            return Err(self.err(format!(
                "{}: array claims {count} elements of type {ty} (at least {min} bytes each) \
                 but only {rem} bytes remain",
                what()
            )));
        }
        // count * min <= remaining bytes, so count fits in usize.
        let n = count as usize;
        macro_rules! fixed {
            ($variant:ident, $t:ty) => {{
                let size = std::mem::size_of::<$t>();
                let bytes = self.take((n * size) as u64, what)?;
                GgufArray::$variant(
                    bytes
                        .chunks_exact(size)
                        .map(|c| {
                            let mut a = [0u8; std::mem::size_of::<$t>()];
                            a.copy_from_slice(c);
                            <$t>::from_le_bytes(a)
                        })
                        .collect(),
                )
            }};
        }
        use GgufValueType as T;
        Ok(match ty {
            T::U8 => fixed!(U8, u8),
            T::I8 => fixed!(I8, i8),
            T::U16 => fixed!(U16, u16),
            T::I16 => fixed!(I16, i16),
            T::U32 => fixed!(U32, u32),
            T::I32 => fixed!(I32, i32),
            T::F32 => fixed!(F32, f32),
            T::U64 => fixed!(U64, u64),
            T::I64 => fixed!(I64, i64),
            T::F64 => fixed!(F64, f64),
            T::Bool => GgufArray::Bool(self.take(count, what)?.iter().map(|&b| b != 0).collect()),
            T::String => {
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    v.push(self.string(&|| format!("{}[{i}]", what()))?);
                }
                GgufArray::String(v)
            }
            T::Array => {
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    v.push(self.array_value(&|| format!("{}[{i}]", what()), depth + 1)?);
                }
                GgufArray::Array(v)
            }
        })
    }
}

/// `GGML_MAX_DIMS`.
const MAX_DIMS: u32 = 4;

/// The rest of one tensor-table entry after its name: n_dims, `ne`, type, offset; with the
/// element count and byte size computed with overflow checks.
pub(crate) fn read_tensor_info(
    c: &mut Cursor<'_>,
    file: &str,
    name: String,
) -> Result<TensorInfo, CheckpointError> {
    let n_dims = c.u32(&|| format!("tensor {name} n_dims"))?;
    if n_dims == 0 || n_dims > MAX_DIMS {
        return Err(tensor_err(
            file,
            &name,
            format!("has {n_dims} dims, expected 1 to {MAX_DIMS}"),
        ));
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for d in 0..n_dims {
        dims.push(c.u64(&|| format!("tensor {name} ne[{d}]"))?);
    }
    let type_id = c.u32(&|| format!("tensor {name} type"))?;
    let offset = c.u64(&|| format!("tensor {name} offset"))?;
    let ggml_type = GgmlType::from_id(type_id)
        .ok_or_else(|| tensor_err(file, &name, format!("unknown ggml type id {type_id}")))?;

    let overflow = || {
        tensor_err(
            file,
            &name,
            format!("size of dims {dims:?} overflows 64 bits"),
        )
    };
    let n_elements = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(overflow)?;
    let (block, block_bytes) = ggml_type.block_layout();
    if !dims[0].is_multiple_of(block) {
        return Err(tensor_err(
            file,
            &name,
            format!(
                "ne[0] = {} is not a multiple of the block size {block} of type {ggml_type}",
                dims[0]
            ),
        ));
    }
    let row_bytes = (dims[0] / block)
        .checked_mul(block_bytes)
        .ok_or_else(overflow)?;
    let n_bytes = dims[1..]
        .iter()
        .try_fold(row_bytes, |acc, &d| acc.checked_mul(d))
        .ok_or_else(overflow)?;
    Ok(TensorInfo {
        name,
        dims,
        ggml_type,
        offset,
        n_elements,
        n_bytes,
    })
}
