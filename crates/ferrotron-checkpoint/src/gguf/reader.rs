//! [`GgufFile`]: a memory-mapped, fully validated GGUF file.
//!
//! Mirrors llama.cpp's `ggml/src/gguf.cpp` (`gguf_init_from_file_impl`) and gguf-py's
//! `GGUFReader`: header, metadata, tensor table, `general.alignment` (default 32), and the data
//! section starting at the first aligned offset after the tensor table.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::dequant::dequantize;
use super::parse::{Cursor, read_tensor_info};
use super::types::GgmlType;
use super::value::GgufValue;
use crate::CheckpointError;
use crate::error::display_name;

/// The alignment of tensor data when `general.alignment` is absent (`GGUF_DEFAULT_ALIGNMENT`).
pub const GGUF_DEFAULT_ALIGNMENT: u64 = 32;

/// Fewest bytes one metadata entry can take: key length (8) + type tag (4) + a 1-byte value.
const MIN_KV_BYTES: u64 = 13;
/// Fewest bytes one tensor-table entry can take: name length (8) + n_dims (4) + one dim (8) +
/// type (4) + offset (8).
const MIN_TENSOR_INFO_BYTES: u64 = 32;

/// Metadata entries in file order, with the index of each key.
type MetadataTable = (Vec<(String, GgufValue)>, HashMap<String, usize>);

/// One entry of the tensor table, validated against the file by [`GgufFile::open`].
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// The tensor's name in the file, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// ggml's `ne`: sizes fastest-varying first, so a row-major `[rows, cols]` matrix is
    /// `[cols, rows]` here. 1 to 4 entries.
    pub dims: Vec<u64>,
    /// Storage type of the data.
    pub ggml_type: GgmlType,
    /// Offset of the data from the start of the data section, in bytes (a multiple of the
    /// file's alignment).
    pub offset: u64,
    /// Product of `dims`.
    pub n_elements: u64,
    /// Size of the data in bytes: `ne[0] / block * block_bytes * ne[1] * ne[2] * ne[3]`.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// The shape in row-major (PyTorch/HF) order: `dims` reversed, slowest-varying first.
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }
}

/// A GGUF file (version 2 or 3), memory-mapped and validated.
///
/// [`GgufFile::open`] checks the magic, the version, every metadata entry, the alignment, and that
/// every tensor's size matches its dims and type and its data lies inside the file. After that,
/// reading a tensor's bytes cannot go out of bounds.
pub struct GgufFile {
    path: PathBuf,
    name: String,
    mmap: Mmap,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, GgufValue)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Opens, maps and validates the GGUF file at `path`.
    ///
    /// # Errors
    /// [`CheckpointError::Io`] if the file cannot be opened or mapped; [`CheckpointError::Format`]
    /// for a bad magic (not `GGUF`), a version other than 2 or 3 (big-endian files are named as
    /// such), truncation anywhere in the header, metadata or tensor table, counts larger than the
    /// file could hold, duplicate keys, invalid UTF-8; [`CheckpointError::Metadata`] for a
    /// `general.alignment` that is not a non-zero power of two; [`CheckpointError::Tensor`] for a
    /// tensor with 0 or more than 4 dims, an unknown ggml type id, a row length that is not a
    /// multiple of its type's block size, a size that overflows, an unaligned offset, data lying
    /// past the end of the file, or a duplicate name.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, CheckpointError> {
        let path = path.as_ref();
        let name = display_name(path);
        let file = File::open(path).map_err(|e| CheckpointError::io(path, e))?;
        let len = file
            .metadata()
            .map_err(|e| CheckpointError::io(path, e))?
            .len();
        if len < 24 {
            return Err(CheckpointError::Format {
                file: name,
                detail: format!(
                    "truncated header: file is {len} bytes, a GGUF header needs at least 24"
                ),
            });
        }
        // SAFETY: the map is read-only and private to this struct. As with every mmap, another
        // process truncating the file while it is mapped would fault; that is outside our control.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| CheckpointError::io(path, e))?;
        Self::parse(path.to_path_buf(), name, mmap)
    }

    /// Parses and validates the mapped file: header, metadata, alignment, tensor table, data.
    fn parse(path: PathBuf, name: String, mmap: Mmap) -> Result<GgufFile, CheckpointError> {
        let file_len = mmap.len() as u64;
        let mut c = Cursor::new(&mmap, &name);
        let (version, n_tensors, n_kv) = Self::read_header(&mut c)?;
        let (metadata, metadata_index) = Self::read_metadata(&mut c, n_kv)?;
        let alignment = Self::alignment_from(&name, &metadata, &metadata_index)?;
        let (tensors, tensor_index) = Self::read_tensor_table(&mut c, &name, n_tensors)?;

        let end_of_table = c.pos() as u64;
        let data_offset = end_of_table
            .checked_next_multiple_of(alignment)
            .ok_or_else(|| {
                c.err(format!(
                    "data offset overflows aligning {end_of_table} to {alignment}"
                ))
            })?;
        Self::check_tensor_data(&name, &tensors, alignment, data_offset, file_len)?;

        Ok(GgufFile {
            path,
            name,
            mmap,
            version,
            alignment,
            data_offset,
            metadata,
            metadata_index,
            tensors,
            tensor_index,
        })
    }

    /// Reads the magic, version and counts; returns `(version, n_tensors, n_kv)`.
    fn read_header(c: &mut Cursor<'_>) -> Result<(u32, u64, u64), CheckpointError> {
        let magic = c.take(4, &|| "magic".into())?;
        if magic != b"GGUF" {
            return Err(c.err(format!(
                "bad magic {:?}: expected \"GGUF\"",
                magic.escape_ascii().to_string()
            )));
        }
        let version = c.u32(&|| "version".into())?;
        if version != 2 && version != 3 {
            let hint = if matches!(version.swap_bytes(), 2 | 3) {
                " (this looks like a big-endian file; only little-endian files are supported)"
            } else {
                ""
            };
            return Err(c.err(format!(
                "unsupported GGUF version {version}: expected 2 or 3{hint}"
            )));
        }
        let n_tensors = c.u64(&|| "tensor count".into())?;
        let n_kv = c.u64(&|| "metadata count".into())?;
        let rem = c.remaining();
        let need = n_kv.checked_mul(MIN_KV_BYTES).and_then(|a| {
            n_tensors
                .checked_mul(MIN_TENSOR_INFO_BYTES)
                .and_then(|b| a.checked_add(b))
        });
        if need.is_none_or(|need| need > rem) {
            return Err(c.err(format!(
                "header claims {n_kv} metadata entries and {n_tensors} tensors, which cannot fit in \
                 the {rem} bytes that follow"
            )));
        }
        Ok((version, n_tensors, n_kv))
    }

    /// Reads `n_kv` metadata entries with their key index, rejecting duplicate keys.
    fn read_metadata(c: &mut Cursor<'_>, n_kv: u64) -> Result<MetadataTable, CheckpointError> {
        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut metadata_index = HashMap::with_capacity(n_kv as usize);
        for i in 0..n_kv {
            let key = c.string(&|| format!("metadata key #{i}"))?;
            let value = c.tagged_value(&|| format!("metadata {key}"))?;
            if metadata_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(c.err(format!("metadata key {key} appears twice")));
            }
            metadata.push((key, value));
        }
        Ok((metadata, metadata_index))
    }

    /// `general.alignment` (a non-zero power of two), or the default when absent.
    fn alignment_from(
        name: &str,
        metadata: &[(String, GgufValue)],
        metadata_index: &HashMap<String, usize>,
    ) -> Result<u64, CheckpointError> {
        Ok(match metadata_index.get("general.alignment") {
            None => GGUF_DEFAULT_ALIGNMENT,
            Some(&i) => {
                let v = &metadata[i].1;
                match v.as_u64() {
                    Some(a) if a.is_power_of_two() => a,
                    _ => {
                        return Err(CheckpointError::Metadata {
                            file: name.to_string(),
                            key: "general.alignment".into(),
                            detail: format!("expected a non-zero power of two, found {v:?}"),
                        });
                    }
                }
            }
        })
    }

    /// Reads `n_tensors` tensor-table entries with their name index, rejecting duplicate names.
    fn read_tensor_table(
        c: &mut Cursor<'_>,
        name: &str,
        n_tensors: u64,
    ) -> Result<(Vec<TensorInfo>, HashMap<String, usize>), CheckpointError> {
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut tensor_index = HashMap::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let tname = c.string(&|| format!("tensor #{i} name"))?;
            let info = read_tensor_info(c, name, tname)?;
            if tensor_index
                .insert(info.name.clone(), tensors.len())
                .is_some()
            {
                return Err(tensor_err(
                    name,
                    &info.name,
                    "appears twice in the tensor table".into(),
                ));
            }
            tensors.push(info);
        }
        Ok((tensors, tensor_index))
    }

    /// Checks every tensor's offset is aligned and its data lies inside the file.
    fn check_tensor_data(
        name: &str,
        tensors: &[TensorInfo],
        alignment: u64,
        data_offset: u64,
        file_len: u64,
    ) -> Result<(), CheckpointError> {
        for t in tensors {
            if !t.offset.is_multiple_of(alignment) {
                return Err(tensor_err(
                    name,
                    &t.name,
                    format!(
                        "offset {} is not a multiple of the alignment {alignment}",
                        t.offset
                    ),
                ));
            }
            let range = data_offset
                .checked_add(t.offset)
                .and_then(|s| Some((s, s.checked_add(t.n_bytes)?)));
            let Some((start, end)) = range else {
                let detail = format!(
                    "data offset {data_offset} + {} + {} bytes overflows",
                    t.offset, t.n_bytes
                );
                return Err(tensor_err(name, &t.name, detail));
            };
            if end > file_len {
                let detail =
                    format!("data [{start}..{end}) lies past end of file ({file_len} bytes)");
                return Err(tensor_err(name, &t.name, detail));
            }
        }
        Ok(())
    }

    /// The path the file was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's name as used in error messages.
    pub fn file_name(&self) -> &str {
        &self.name
    }

    /// GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment of tensor data in bytes: `general.alignment`, or 32 when absent.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute file offset where the data section starts (end of the tensor table rounded up to
    /// the alignment).
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// All metadata entries in file order.
    pub fn metadata(&self) -> &[(String, GgufValue)] {
        &self.metadata
    }

    /// The metadata value under `key`, if present.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// The tensor table in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor-table entry named `name`, if present.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw stored bytes of tensor `name` (`n_bytes` long).
    ///
    /// # Errors
    /// [`CheckpointError::Tensor`] if there is no such tensor.
    pub fn tensor_data(&self, name: &str) -> Result<&[u8], CheckpointError> {
        let t = self.require_tensor(name)?;
        // `open` checked data_offset + offset + n_bytes <= file length, so these casts and the
        // slice are in bounds.
        let start = (self.data_offset + t.offset) as usize;
        Ok(&self.mmap[start..start + t.n_bytes as usize])
    }

    /// Tensor `name` dequantized to f32, row-major with `n_elements` values (shape
    /// [`TensorInfo::shape`]); as gguf-py's `dequantize` / ggml's `to_float`.
    ///
    /// # Errors
    /// [`CheckpointError::Tensor`] if there is no such tensor; [`CheckpointError::UnsupportedType`]
    /// if its type is not F32, F16, BF16, Q8_0, Q4_0 or Q4_1.
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>, CheckpointError> {
        let t = self.require_tensor(name)?;
        let data = self.tensor_data(name)?;
        let mut out = vec![0f32; t.n_elements as usize];
        dequantize(t.ggml_type, data, &mut out).map_err(|e| self.dequant_err(t, e))?;
        Ok(out)
    }

    pub(crate) fn dequant_err(
        &self,
        t: &TensorInfo,
        e: super::dequant::DequantError,
    ) -> CheckpointError {
        match e {
            super::dequant::DequantError::Unsupported(ty) => CheckpointError::UnsupportedType {
                file: self.name.clone(),
                tensor: t.name.clone(),
                ggml_type: ty.to_string(),
            },
            super::dequant::DequantError::Length { .. } => {
                tensor_err(&self.name, &t.name, e.to_string())
            }
        }
    }

    fn require_tensor(&self, name: &str) -> Result<&TensorInfo, CheckpointError> {
        self.tensor_info(name)
            .ok_or_else(|| tensor_err(&self.name, name, "no such tensor in the file".into()))
    }
}

/// A short description of a value for error messages (type, and the value for scalars).
pub(crate) fn brief(v: &GgufValue) -> String {
    match v {
        GgufValue::String(s) if s.chars().count() > 40 => {
            format!("string {:?}...", s.chars().take(40).collect::<String>())
        }
        GgufValue::Array(a) => format!("array of {} {}", a.len(), a.elem_type()),
        _ => format!("{} {v:?}", v.value_type()),
    }
}

pub(crate) fn tensor_err(file: &str, tensor: &str, detail: String) -> CheckpointError {
    CheckpointError::Tensor {
        file: file.to_string(),
        tensor: tensor.to_string(),
        detail,
    }
}
