//! ggml tensor types and GGUF metadata value types, with their on-disk sizes.
//!
//! Mirrors `enum ggml_type` and `type_traits[]` in llama.cpp's `ggml/src/ggml.c` and
//! `GGML_QUANT_SIZES` / `GGUFValueType` in `gguf-py/gguf/constants.py`.

use std::fmt;

use ferrotron_tensor::quant::QuantType;

/// A ggml tensor storage type (`enum ggml_type`), by its numeric id in the file.
///
/// Every type llama.cpp has defined is listed so that a file using any of them opens and can be
/// size-checked; F32, F16, BF16 and the block formats of [`QuantType`] (which can also be
/// served without dequantizing) can be dequantized by this crate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types, missing_docs)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    NVFP4,
    Q1_0,
}

const QK_K: u64 = 256;

impl GgmlType {
    /// The type with numeric id `id`, or `None` for ids ggml never defined or has removed
    /// (4, 5, 31..=33, 36..=38).
    pub fn from_id(id: u32) -> Option<GgmlType> {
        use GgmlType::*;
        Some(match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2_K,
            11 => Q3_K,
            12 => Q4_K,
            13 => Q5_K,
            14 => Q6_K,
            15 => Q8_K,
            16 => IQ2_XXS,
            17 => IQ2_XS,
            18 => IQ3_XXS,
            19 => IQ1_S,
            20 => IQ4_NL,
            21 => IQ3_S,
            22 => IQ2_S,
            23 => IQ4_XS,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            29 => IQ1_M,
            30 => BF16,
            34 => TQ1_0,
            35 => TQ2_0,
            39 => MXFP4,
            40 => NVFP4,
            41 => Q1_0,
            _ => return None,
        })
    }

    /// `(elements per block, bytes per block)`, as `GGML_QUANT_SIZES` in gguf-py.
    /// A row of `ne[0]` elements must hold a whole number of blocks.
    pub fn block_layout(self) -> (u64, u64) {
        use GgmlType::*;
        match self {
            F32 => (1, 4),
            F16 => (1, 2),
            Q4_0 => (32, 2 + 16),
            Q4_1 => (32, 2 + 2 + 16),
            Q5_0 => (32, 2 + 4 + 16),
            Q5_1 => (32, 2 + 2 + 4 + 16),
            Q8_0 => (32, 2 + 32),
            Q8_1 => (32, 4 + 4 + 32),
            Q2_K => (QK_K, 2 + 2 + QK_K / 16 + QK_K / 4),
            Q3_K => (QK_K, 2 + QK_K / 4 + QK_K / 8 + 12),
            Q4_K => (QK_K, 2 + 2 + QK_K / 2 + 12),
            Q5_K => (QK_K, 2 + 2 + QK_K / 2 + QK_K / 8 + 12),
            Q6_K => (QK_K, 2 + QK_K / 2 + QK_K / 4 + QK_K / 16),
            Q8_K => (QK_K, 4 + QK_K + QK_K / 8),
            IQ2_XXS => (QK_K, 2 + QK_K / 4),
            IQ2_XS => (QK_K, 2 + QK_K / 4 + QK_K / 32),
            IQ3_XXS => (QK_K, 2 + QK_K / 4 + QK_K / 8),
            IQ1_S => (QK_K, 2 + QK_K / 8 + QK_K / 16),
            IQ4_NL => (32, 2 + 16),
            IQ3_S => (QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4),
            IQ2_S => (QK_K, 2 + QK_K / 4 + QK_K / 16),
            IQ4_XS => (QK_K, 2 + 2 + QK_K / 2 + QK_K / 64),
            I8 => (1, 1),
            I16 => (1, 2),
            I32 => (1, 4),
            I64 => (1, 8),
            F64 => (1, 8),
            IQ1_M => (QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32),
            BF16 => (1, 2),
            TQ1_0 => (QK_K, 2 + 4 * 13),
            TQ2_0 => (QK_K, 2 + 64),
            MXFP4 => (32, 1 + 16),
            NVFP4 => (64, 4 + 32),
            Q1_0 => (128, 2 + 16),
        }
    }

    /// Whether [`crate::gguf::dequantize`] supports this type.
    pub fn is_dequantizable(self) -> bool {
        use GgmlType::*;
        matches!(self, F32 | F16 | BF16) || self.quant_type().is_some()
    }

    /// The block format the kernels multiply directly, for the quantized types they support.
    pub fn quant_type(self) -> Option<QuantType> {
        Some(match self {
            GgmlType::Q8_0 => QuantType::Q8_0,
            GgmlType::Q4_0 => QuantType::Q4_0,
            GgmlType::Q4_1 => QuantType::Q4_1,
            GgmlType::Q5_0 => QuantType::Q5_0,
            GgmlType::Q5_1 => QuantType::Q5_1,
            GgmlType::Q4_K => QuantType::Q4_K,
            GgmlType::Q6_K => QuantType::Q6_K,
            _ => return None,
        })
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The Debug names are exactly ggml's type names (`ggml_type_name`, upper-cased).
        fmt::Debug::fmt(self, f)
    }
}

/// The type tag of a GGUF metadata value (`enum gguf_type` in `ggml/include/gguf.h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum GgufValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl GgufValueType {
    /// The type with numeric tag `id` (0..=12), or `None`.
    pub fn from_id(id: u32) -> Option<GgufValueType> {
        use GgufValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The fewest bytes one value of this type occupies in the file: its size for scalars,
    /// 8 (the length) for a string, 12 (element type + count) for an array.
    pub fn min_encoded_size(self) -> u64 {
        use GgufValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

impl fmt::Display for GgufValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use GgufValueType::*;
        let s = match self {
            U8 => "uint8",
            I8 => "int8",
            U16 => "uint16",
            I16 => "int16",
            U32 => "uint32",
            I32 => "int32",
            F32 => "float32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "uint64",
            I64 => "int64",
            F64 => "float64",
        };
        f.write_str(s)
    }
}
