//! A streaming safetensors writer: the header is computed from names and shapes up front, then
//! each tensor's data is produced, converted and written one at a time, so peak memory is one
//! tensor rather than the whole model.
//!
//! Format (huggingface/safetensors `docs`/`safetensors/src/tensor.rs`): u64 little-endian header
//! length N, N bytes of JSON `{name: {dtype, shape, data_offsets: [begin, end)}, "__metadata__":
//! {..}}` padded with spaces to a multiple of 8, then the tensor bytes, contiguous, in header order.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use serde_json::{Map, Value, json};

use crate::CheckpointError;
use crate::gguf::OutputDtype;

/// One tensor to write: name and row-major shape.
pub(crate) struct TensorSpec {
    pub name: String,
    pub shape: Vec<u64>,
}

/// Writes `specs` to `path` with element type `dtype`; `produce(i)` returns tensor `i`'s values
/// in f32 (exactly `product(shape)` of them). Returns the file size in bytes.
pub(crate) fn write_safetensors(
    path: &Path,
    specs: &[TensorSpec],
    dtype: OutputDtype,
    metadata: &[(&str, &str)],
    mut produce: impl FnMut(usize) -> Result<Vec<f32>, CheckpointError>,
) -> Result<u64, CheckpointError> {
    let overflow = |name: &str| CheckpointError::Format {
        file: path.display().to_string(),
        detail: format!("size of tensor {name} overflows"),
    };
    let mut header = Map::new();
    let meta: Map<String, Value> = metadata
        .iter()
        .map(|(k, v)| (k.to_string(), json!(v)))
        .collect();
    header.insert("__metadata__".into(), Value::Object(meta));
    let mut offset = 0u64;
    let mut counts = Vec::with_capacity(specs.len());
    for s in specs {
        let n = s
            .shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| overflow(&s.name))?;
        let bytes = n
            .checked_mul(dtype.size())
            .ok_or_else(|| overflow(&s.name))?;
        let end = offset.checked_add(bytes).ok_or_else(|| overflow(&s.name))?;
        header.insert(
            s.name.clone(),
            json!({"dtype": dtype.safetensors_name(), "shape": s.shape, "data_offsets": [offset, end]}),
        );
        counts.push(n);
        offset = end;
    }
    let mut header_bytes =
        serde_json::to_vec(&Value::Object(header)).map_err(|e| CheckpointError::Format {
            file: path.display().to_string(),
            detail: format!("cannot serialize header: {e}"),
        })?;
    while !header_bytes.len().is_multiple_of(8) {
        header_bytes.push(b' ');
    }

    let io = |e| CheckpointError::io(path, e);
    let mut w = BufWriter::with_capacity(1 << 20, File::create(path).map_err(io)?);
    w.write_all(&(header_bytes.len() as u64).to_le_bytes())
        .map_err(io)?;
    w.write_all(&header_bytes).map_err(io)?;
    let mut buf: Vec<u8> = Vec::new();
    for (i, s) in specs.iter().enumerate() {
        let values = produce(i)?;
        if values.len() as u64 != counts[i] {
            return Err(CheckpointError::Format {
                file: path.display().to_string(),
                detail: format!(
                    "tensor {}: produced {} values for shape {:?}",
                    s.name,
                    values.len(),
                    s.shape
                ),
            });
        }
        buf.clear();
        buf.reserve(values.len() * dtype.size() as usize);
        match dtype {
            OutputDtype::F32 => values
                .iter()
                .for_each(|v| buf.extend_from_slice(&v.to_le_bytes())),
            OutputDtype::BF16 => values
                .iter()
                .for_each(|&v| buf.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes())),
            OutputDtype::F16 => values
                .iter()
                .for_each(|&v| buf.extend_from_slice(&half::f16::from_f32(v).to_le_bytes())),
        }
        w.write_all(&buf).map_err(io)?;
    }
    let file = w.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(io)?;
    Ok(8 + header_bytes.len() as u64 + offset)
}
