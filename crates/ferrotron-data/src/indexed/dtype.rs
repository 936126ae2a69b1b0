/// Token storage type of a `.bin` file with Megatron's dtype codes
/// (`indexed_dataset.DType`: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32,
/// 8 uint16). Token ids use uint16 when the vocabulary has fewer than 65500 entries, else int32
/// (`DType.optimal_dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenDtype {
    U8,
    I8,
    I16,
    I32,
    I64,
    U16,
}

impl TokenDtype {
    /// Megatron's dtype code.
    pub fn code(self) -> u8 {
        match self {
            TokenDtype::U8 => 1,
            TokenDtype::I8 => 2,
            TokenDtype::I16 => 3,
            TokenDtype::I32 => 4,
            TokenDtype::I64 => 5,
            TokenDtype::U16 => 8,
        }
    }

    /// The dtype of a code; float codes (6, 7) and unknown codes give `None`.
    pub fn from_code(code: u8) -> Option<TokenDtype> {
        Some(match code {
            1 => TokenDtype::U8,
            2 => TokenDtype::I8,
            3 => TokenDtype::I16,
            4 => TokenDtype::I32,
            5 => TokenDtype::I64,
            8 => TokenDtype::U16,
            _ => return None,
        })
    }

    /// Bytes per token.
    pub fn size(self) -> usize {
        match self {
            TokenDtype::U8 | TokenDtype::I8 => 1,
            TokenDtype::I16 | TokenDtype::U16 => 2,
            TokenDtype::I32 => 4,
            TokenDtype::I64 => 8,
        }
    }

    /// Megatron's `DType.optimal_dtype(vocab_size)`: uint16 below 65500, else int32.
    pub fn optimal(vocab_size: usize) -> TokenDtype {
        if vocab_size < 65500 {
            TokenDtype::U16
        } else {
            TokenDtype::I32
        }
    }

    /// Numpy's name, for messages (`uint16`, `int32`, ...).
    pub fn name(self) -> &'static str {
        match self {
            TokenDtype::U8 => "uint8",
            TokenDtype::I8 => "int8",
            TokenDtype::I16 => "int16",
            TokenDtype::I32 => "int32",
            TokenDtype::I64 => "int64",
            TokenDtype::U16 => "uint16",
        }
    }

    /// Decodes one little-endian token at the start of `b` (`b.len() >= size()`).
    #[inline]
    pub fn decode(self, b: &[u8]) -> i64 {
        match self {
            TokenDtype::U8 => b[0] as i64,
            TokenDtype::I8 => b[0] as i8 as i64,
            TokenDtype::I16 => i16::from_le_bytes([b[0], b[1]]) as i64,
            TokenDtype::U16 => u16::from_le_bytes([b[0], b[1]]) as i64,
            TokenDtype::I32 => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
            TokenDtype::I64 => i64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
        }
    }
}
