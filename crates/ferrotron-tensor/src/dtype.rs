use half::{bf16, f16};
use std::fmt;

/// Element type of a tensor's storage. Accumulation is f32; bf16 weights multiply through the
/// bf16 GEMM ([`crate::gemm_bf16`]), f16 is widened to f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F16,
}

impl DType {
    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// Parses the names used on the command line and in configs: `f32`/`float32`/`fp32`,
    /// `bf16`/`bfloat16`, `f16`/`float16`/`fp16`.
    pub fn parse(name: &str) -> Option<DType> {
        match name.to_ascii_lowercase().as_str() {
            "f32" | "float32" | "fp32" => Some(DType::F32),
            "bf16" | "bfloat16" => Some(DType::BF16),
            "f16" | "float16" | "fp16" => Some(DType::F16),
            _ => None,
        }
    }

    /// The name HF uses for this dtype in `config.json` (`torch_dtype` / `dtype`).
    pub fn hf_name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        })
    }
}

/// A storage element that converts to and from f32 (the compute type).
pub trait Element: Copy + Send + Sync + 'static {
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

/// The bits of the bf16 nearest to `v` (ties to even; NaN stays a quiet NaN). Branch-free so
/// conversion loops vectorize; agrees with `half::bf16::from_f32`.
#[inline(always)]
pub fn round_to_bf16_bits(v: f32) -> u16 {
    let bits = v.to_bits();
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
    let nan = (bits & 0x7fff_ffff) > 0x7f80_0000;
    if nan {
        ((bits >> 16) | 0x0040) as u16
    } else {
        rounded as u16
    }
}
