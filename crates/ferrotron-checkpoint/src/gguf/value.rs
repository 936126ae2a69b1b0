//! GGUF metadata values: the 12 scalar/string types and (possibly nested) typed arrays.
//!
//! Mirrors `gguf_kv` in llama.cpp's `ggml/src/gguf.cpp`. Arrays are stored as typed vectors so a
//! large array (49k tokens, 49k token types) costs what its elements cost, not one enum per item.

use super::types::GgufValueType;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
#[allow(missing_docs)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(GgufArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array: every element has the same type. Nested arrays are arrays of arrays.
#[derive(Debug, Clone, PartialEq)]
#[allow(missing_docs)]
pub enum GgufArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<GgufArray>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl GgufValue {
    /// The value's type tag.
    pub fn value_type(&self) -> GgufValueType {
        use GgufValueType as T;
        match self {
            GgufValue::U8(_) => T::U8,
            GgufValue::I8(_) => T::I8,
            GgufValue::U16(_) => T::U16,
            GgufValue::I16(_) => T::I16,
            GgufValue::U32(_) => T::U32,
            GgufValue::I32(_) => T::I32,
            GgufValue::F32(_) => T::F32,
            GgufValue::Bool(_) => T::Bool,
            GgufValue::String(_) => T::String,
            GgufValue::Array(_) => T::Array,
            GgufValue::U64(_) => T::U64,
            GgufValue::I64(_) => T::I64,
            GgufValue::F64(_) => T::F64,
        }
    }

    /// The value as a signed 64-bit integer if it is any integer type and fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::I8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::I16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::I32(v) => Some(v.into()),
            GgufValue::U64(v) => i64::try_from(v).ok(),
            GgufValue::I64(v) => Some(v),
            _ => None,
        }
    }

    /// The value as an unsigned 64-bit integer if it is any integer type and non-negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U64(v) => Some(v),
            _ => self.as_i64().and_then(|v| u64::try_from(v).ok()),
        }
    }

    /// The value as `f64` if it is a float (f32 is widened exactly) or an integer.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            GgufValue::U64(v) => Some(v as f64),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// The value if it is a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// The value if it is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value if it is an array.
    pub fn as_array(&self) -> Option<&GgufArray> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl GgufArray {
    /// The element type.
    pub fn elem_type(&self) -> GgufValueType {
        use GgufValueType as T;
        match self {
            GgufArray::U8(_) => T::U8,
            GgufArray::I8(_) => T::I8,
            GgufArray::U16(_) => T::U16,
            GgufArray::I16(_) => T::I16,
            GgufArray::U32(_) => T::U32,
            GgufArray::I32(_) => T::I32,
            GgufArray::F32(_) => T::F32,
            GgufArray::Bool(_) => T::Bool,
            GgufArray::String(_) => T::String,
            GgufArray::Array(_) => T::Array,
            GgufArray::U64(_) => T::U64,
            GgufArray::I64(_) => T::I64,
            GgufArray::F64(_) => T::F64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            GgufArray::U8(v) => v.len(),
            GgufArray::I8(v) => v.len(),
            GgufArray::U16(v) => v.len(),
            GgufArray::I16(v) => v.len(),
            GgufArray::U32(v) => v.len(),
            GgufArray::I32(v) => v.len(),
            GgufArray::F32(v) => v.len(),
            GgufArray::Bool(v) => v.len(),
            GgufArray::String(v) => v.len(),
            GgufArray::Array(v) => v.len(),
            GgufArray::U64(v) => v.len(),
            GgufArray::I64(v) => v.len(),
            GgufArray::F64(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements if this is an array of strings.
    pub fn as_strings(&self) -> Option<&[String]> {
        match self {
            GgufArray::String(v) => Some(v),
            _ => None,
        }
    }

    /// The elements as `i64` if this is an array of an integer type whose values all fit.
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        fn conv<T: Copy>(v: &[T], f: impl Fn(T) -> Option<i64>) -> Option<Vec<i64>> {
            v.iter().map(|&x| f(x)).collect()
        }
        match self {
            GgufArray::U8(v) => conv(v, |x| Some(x.into())),
            GgufArray::I8(v) => conv(v, |x| Some(x.into())),
            GgufArray::U16(v) => conv(v, |x| Some(x.into())),
            GgufArray::I16(v) => conv(v, |x| Some(x.into())),
            GgufArray::U32(v) => conv(v, |x| Some(x.into())),
            GgufArray::I32(v) => conv(v, |x| Some(x.into())),
            GgufArray::U64(v) => conv(v, |x| i64::try_from(x).ok()),
            GgufArray::I64(v) => Some(v.clone()),
            _ => None,
        }
    }
}
