//! The ggml block formats a quantized weight is stored in, and their exact dequantization.
//!
//! Layouts mirror `block_q8_0`, `block_q4_0`, `block_q4_1`, `block_q4_K` and `block_q6_K` in
//! llama.cpp's `ggml/src/ggml-common.h`; values mirror `dequantize_row_*` in
//! `ggml/src/ggml-quants.c` and gguf-py's `gguf/quants.py` (which transformers' GGUF loader
//! uses): scales are f16 widened to f32 and every value is computed in f32 in gguf-py's order
//! with no fused multiply-add, so results are bit-identical to gguf-py.

use half::f16;

/// Elements of a K-quant super-block (`QK_K`).
pub const QK_K: usize = 256;

/// A ggml block format of quantized weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum QuantType {
    /// 32 values per block: an f16 scale `d` and 32 signed bytes; `x = d·q`.
    Q8_0,
    /// 32 values per block: an f16 scale `d` and 32 nibbles; `x = d·(q - 8)`.
    Q4_0,
    /// 32 values per block: f16 scale `d` and min `m`, 32 nibbles; `x = d·q + m`.
    Q4_1,
    /// 32 values per block: an f16 scale `d`, 32 fifth bits, 32 nibbles; `x = d·(q - 16)`.
    Q5_0,
    /// 32 values per block: f16 `d` and `m`, 32 fifth bits, 32 nibbles; `x = d·q + m`.
    Q5_1,
    /// 256 values per super-block: f16 `d` and `dmin`, eight 6-bit sub-block scales and mins,
    /// 256 nibbles; `x = d·sc_j·q - dmin·m_j` in sub-block `j` of 32.
    Q4_K,
    /// 256 values per super-block: 4 low bits and 2 high bits per value, sixteen int8
    /// sub-block scales, an f16 `d`; `x = d·sc_j·(q - 32)` in sub-block `j` of 16.
    Q6_K,
}

impl QuantType {
    /// Every format, for tests and messages.
    pub const ALL: [QuantType; 7] = [
        QuantType::Q8_0,
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q5_0,
        QuantType::Q5_1,
        QuantType::Q4_K,
        QuantType::Q6_K,
    ];

    /// `(values per block, bytes per block)`, as ggml's `type_traits`.
    pub const fn block_layout(self) -> (usize, usize) {
        match self {
            QuantType::Q8_0 => (32, 2 + 32),
            QuantType::Q4_0 => (32, 2 + 16),
            QuantType::Q4_1 => (32, 2 + 2 + 16),
            QuantType::Q5_0 => (32, 2 + 4 + 16),
            QuantType::Q5_1 => (32, 2 + 2 + 4 + 16),
            QuantType::Q4_K => (QK_K, 2 + 2 + 12 + QK_K / 2),
            QuantType::Q6_K => (QK_K, QK_K / 2 + QK_K / 4 + QK_K / 16 + 2),
        }
    }

    /// ggml's name, e.g. `Q4_K`.
    pub const fn name(self) -> &'static str {
        match self {
            QuantType::Q8_0 => "Q8_0",
            QuantType::Q4_0 => "Q4_0",
            QuantType::Q4_1 => "Q4_1",
            QuantType::Q5_0 => "Q5_0",
            QuantType::Q5_1 => "Q5_1",
            QuantType::Q4_K => "Q4_K",
            QuantType::Q6_K => "Q6_K",
        }
    }

    /// Bytes of a row of `cols` values, or `None` when `cols` is not a whole number of
    /// blocks.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        let (values, bytes) = self.block_layout();
        cols.is_multiple_of(values).then_some(cols / values * bytes)
    }
}

impl std::fmt::Display for QuantType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The little-endian f16 at byte `at` of `b`, widened to f32 (exact).
#[inline(always)]
pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Dequantizes whole blocks `data` of type `ty` into `out` (`out.len()` values).
///
/// # Panics
/// When `data` is not exactly the blocks of `out.len()` values (a caller bug: the
/// [`QuantMatrix`](super::QuantMatrix) constructors check sizes).
pub fn dequantize(ty: QuantType, data: &[u8], out: &mut [f32]) {
    let (values, bytes) = ty.block_layout();
    assert!(out.len().is_multiple_of(values) && data.len() == out.len() / values * bytes);
    let blocks = data.chunks_exact(bytes).zip(out.chunks_exact_mut(values));
    match ty {
        QuantType::Q8_0 => blocks.for_each(|(b, y)| q8_0(b, y)),
        QuantType::Q4_0 => blocks.for_each(|(b, y)| q4_0(b, y)),
        QuantType::Q4_1 => blocks.for_each(|(b, y)| q4_1(b, y)),
        QuantType::Q5_0 => blocks.for_each(|(b, y)| q5(b, y, None)),
        QuantType::Q5_1 => blocks.for_each(|(b, y)| q5(b, y, Some(f16_at(b, 2)))),
        QuantType::Q4_K => blocks.for_each(|(b, y)| q4_k(b, y)),
        QuantType::Q6_K => blocks.for_each(|(b, y)| q6_k(b, y)),
    }
}

fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (y, &q) in y.iter_mut().zip(&b[2..34]) {
        *y = d * f32::from(q as i8);
    }
}

fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let (lo, hi) = y.split_at_mut(16);
    for (j, &q) in b[2..18].iter().enumerate() {
        lo[j] = d * f32::from(i16::from(q & 0x0F) as i8 - 8);
        hi[j] = d * f32::from(i16::from(q >> 4) as i8 - 8);
    }
}

fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let (lo, hi) = y.split_at_mut(16);
    for (j, &q) in b[4..20].iter().enumerate() {
        lo[j] = d * f32::from(q & 0x0F) + m;
        hi[j] = d * f32::from(q >> 4) + m;
    }
}

/// The 5-bit values of a Q5_0 / Q5_1 block (`min` is Q5_1's `m`, at byte 2): the fifth bit
/// of value `j` is bit `j` of the little-endian `qh` word before the nibbles, which hold values
/// `j` (low) and `j + 16` (high) as in Q4_0. Q5_0 is `d·(q - 16)`, Q5_1 `d·q + m`.
fn q5(b: &[u8], y: &mut [f32], min: Option<f32>) {
    let d = f16_at(b, 0);
    let at = if min.is_some() { 4 } else { 2 };
    let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let qs = &b[at + 4..at + 20];
    for (j, y) in y.iter_mut().enumerate() {
        let nibble = (qs[j % 16] >> (4 * (j / 16))) & 0x0F;
        let q = nibble | ((((qh >> j) & 1) as u8) << 4);
        *y = match min {
            None => d * f32::from(q as i8 - 16),
            Some(m) => d * f32::from(q) + m,
        };
    }
}

/// Sub-block `j`'s 6-bit scale and min of a Q4_K super-block (`get_scale_min_k4`).
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Q4_K: `d` f16 at 0, `dmin` f16 at 2, `scales[12]` at 4, `qs[128]` at 16. Sub-block `j`
/// of 32 values reads bytes `qs[32·(j/2)..][..32]`, low nibbles for even `j`, high for odd.
fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for (j, y) in y.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min_k4(j, scales);
        let (d1, m1) = (d * f32::from(sc), dmin * f32::from(m));
        let shift = 4 * (j % 2);
        for (y, &q) in y.iter_mut().zip(&qs[32 * (j / 2)..][..32]) {
            *y = d1 * f32::from((q >> shift) & 0x0F) - m1;
        }
    }
}

/// Q6_K: `ql[128]` at 0, `qh[64]` at 128, `scales[16]` (int8) at 192, `d` f16 at 208.
/// Value `32·j + l` of a super-block (`j` in 0..8, `l` in 0..32; half `n = j / 4`, quarter
/// `t = j % 4`) has low bits from nibble `t / 2` of `ql[64n + 32(t % 2) + l]`, high bits
/// `2t..2t+2` of `qh[32n + l]`, and scale `scales[8n + 2t + l / 16]`.
fn q6_k(b: &[u8], y: &mut [f32]) {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for (j, y) in y.chunks_exact_mut(32).enumerate() {
        let (n, t) = (j / 4, j % 4);
        let low = &ql[64 * n + 32 * (t % 2)..][..32];
        let high = &qh[32 * n..][..32];
        for (l, y) in y.iter_mut().enumerate() {
            let q = ((low[l] >> (4 * (t / 2))) & 0x0F) | (((high[l] >> (2 * t)) & 3) << 4);
            let scale = d * f32::from(sc[8 * n + 2 * t + l / 16] as i8);
            *y = scale * f32::from(q as i8 - 32);
        }
    }
}
