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
#[derive(Clone, Debug)]
pub(crate) struct TensorSpec {
    pub name: String,
    pub shape: Vec<u64>,
}

/// A safetensors file being written: the header is written by [`SafetensorsStream::create`],
/// then [`SafetensorsStream::push`] appends each tensor's values in header order, and
/// [`SafetensorsStream::finish`] checks every tensor came and fsyncs. Several streams can be
/// open at once (one per output file), each holding a 1 MiB write buffer.
pub(crate) struct SafetensorsStream {
    path: std::path::PathBuf,
    writer: BufWriter<File>,
    dtype: OutputDtype,
    specs: Vec<TensorSpec>,
    counts: Vec<u64>,
    next: usize,
    size: u64,
    buf: Vec<u8>,
}

impl SafetensorsStream {
    /// Creates `path` and writes the header for `specs` with element type `dtype` and the
    /// string `metadata`.
    pub(crate) fn create(
        path: &Path,
        specs: Vec<TensorSpec>,
        dtype: OutputDtype,
        metadata: &[(&str, &str)],
    ) -> Result<SafetensorsStream, CheckpointError> {
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
        for s in &specs {
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
        let mut writer = BufWriter::with_capacity(1 << 20, File::create(path).map_err(io)?);
        writer
            .write_all(&(header_bytes.len() as u64).to_le_bytes())
            .map_err(io)?;
        writer.write_all(&header_bytes).map_err(io)?;
        Ok(SafetensorsStream {
            path: path.to_path_buf(),
            writer,
            dtype,
            specs,
            counts,
            next: 0,
            size: 8 + header_bytes.len() as u64 + offset,
            buf: Vec::new(),
        })
    }

    /// Appends the next tensor's values (f32, rounded to the file's dtype).
    ///
    /// # Errors
    /// More tensors than the header has, a wrong value count, or an I/O failure.
    pub(crate) fn push(&mut self, values: &[f32]) -> Result<(), CheckpointError> {
        let path = self.path.display().to_string();
        let Some(s) = self.specs.get(self.next) else {
            return Err(CheckpointError::Format {
                file: path,
                detail: format!("more than the {} tensors of the header", self.specs.len()),
            });
        };
        if values.len() as u64 != self.counts[self.next] {
            return Err(CheckpointError::Format {
                file: path,
                detail: format!(
                    "tensor {}: produced {} values for shape {:?}",
                    s.name,
                    values.len(),
                    s.shape
                ),
            });
        }
        self.next += 1;
        let io = |e| CheckpointError::io(&self.path, e);
        if let OutputDtype::F32 = self.dtype {
            return self
                .writer
                .write_all(bytemuck::cast_slice(values))
                .map_err(io);
        }
        // Rounded in chunks, so no second copy of the tensor is ever held.
        for chunk in values.chunks(1 << 16) {
            self.buf.clear();
            match self.dtype {
                OutputDtype::BF16 => self.buf.extend(
                    chunk
                        .iter()
                        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()),
                ),
                _ => self.buf.extend(
                    chunk
                        .iter()
                        .flat_map(|&v| half::f16::from_f32(v).to_le_bytes()),
                ),
            }
            self.writer.write_all(&self.buf).map_err(io)?;
        }
        Ok(())
    }

    /// Flushes and fsyncs the file; returns its size in bytes.
    ///
    /// # Errors
    /// Tensors of the header never pushed, or an I/O failure.
    pub(crate) fn finish(self) -> Result<u64, CheckpointError> {
        if self.next != self.specs.len() {
            return Err(CheckpointError::Format {
                file: self.path.display().to_string(),
                detail: format!("{} of {} tensors written", self.next, self.specs.len()),
            });
        }
        let io = |e| CheckpointError::io(&self.path, e);
        let file = self.writer.into_inner().map_err(|e| io(e.into_error()))?;
        file.sync_all().map_err(io)?;
        Ok(self.size)
    }
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
    let mut stream = SafetensorsStream::create(path, specs.to_vec(), dtype, metadata)?;
    for i in 0..specs.len() {
        stream.push(&produce(i)?)?;
    }
    stream.finish()
}
