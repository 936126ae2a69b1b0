//! Building a Megatron parameter from its HF tensors and cutting the boxes of it that
//! [`super::hf_to_ckpt`] writes.

use std::borrow::Cow;
use std::path::Path;

use ferrotron_model::families::{ParamDecl, WeightSource};
use ferrotron_tensor::Storage;

use super::hf_to_ckpt::err;
use crate::CheckpointError;

/// The full Megatron parameter `m` (f32, row-major) from its HF tensors: a parameter that is
/// one HF tensor is taken as is; packed ones get each HF tensor's rows placed.
pub(super) fn assemble(
    src: &mut dyn WeightSource,
    m: &ParamDecl,
    hf: &Path,
) -> Result<Vec<f32>, CheckpointError> {
    let mut take = |name: &str| -> Result<Vec<f32>, CheckpointError> {
        let t = src
            .take(name)
            .map_err(|e| err(hf, e.to_string()))?
            .ok_or_else(|| err(hf, format!("missing HF tensor {name}")))?;
        match t.into_storage() {
            Storage::F32(v) => Ok(v),
            other => Ok(ferrotron_tensor::Tensor::new(&[other.len()], other)
                .map_err(|e| err(hf, e.to_string()))?
                .to_f32_vec()),
        }
    };
    if let [part] = m.hf.as_slice()
        && let [rows] = part.rows.as_slice()
        && *rows == (0..m.shape[0])
    {
        return take(&part.name);
    }
    let cols: usize = m.shape[1..].iter().product();
    let mut full = vec![0f32; m.numel()];
    for part in &m.hf {
        let values = take(&part.name)?;
        let mut cursor = 0;
        for r in &part.rows {
            let n = r.len() * cols;
            full[r.start * cols..r.start * cols + n].copy_from_slice(&values[cursor..cursor + n]);
            cursor += n;
        }
    }
    Ok(full)
}

/// The box (`offset`, `shape`) of the row-major 1-D or 2-D tensor `full` of `full_shape`:
/// borrowed when its rows are whole, gathered otherwise.
pub(crate) fn extract_box<'a>(
    full: &'a [f32],
    full_shape: &[usize],
    offset: &[usize],
    shape: &[usize],
) -> Cow<'a, [f32]> {
    let cols: usize = full_shape[1..].iter().product();
    let n: usize = shape.iter().product();
    if full_shape.len() == 1 {
        return Cow::Borrowed(&full[offset[0]..offset[0] + n]);
    }
    let (row0, col0, width) = (offset[0], offset[1], shape[1]);
    if width == cols {
        return Cow::Borrowed(&full[row0 * cols..row0 * cols + n]);
    }
    let mut out = Vec::with_capacity(n);
    for r in row0..row0 + shape[0] {
        out.extend_from_slice(&full[r * cols + col0..r * cols + col0 + width]);
    }
    Cow::Owned(out)
}
