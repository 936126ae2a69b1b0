use super::{HfModelInfo, WeightSource, gpt_model_from_hf, read_hf_config};
use crate::{GptModel, ModelError, Result};
use ferrotron_tensor::{DType, Storage, Tensor, convert_slice};
use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors, tensor::Metadata};
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// HF safetensors weights of one model directory, memory-mapped: `model.safetensors`, or the
/// shards listed in `model.safetensors.index.json` (`weight_map`). Tensors are read on
/// [`WeightSource::take`] and converted to the requested storage dtype.
pub struct HfSafetensors {
    files: Vec<MappedFile>,
    /// Tensor name -> index into `files`, for tensors not taken yet.
    index: BTreeMap<String, usize>,
    dtype: DType,
}

struct MappedFile {
    path: PathBuf,
    mmap: Mmap,
    header_len: usize,
    metadata: Metadata,
}

fn file_err(path: &Path, message: impl Into<String>) -> ModelError {
    ModelError::ConfigFile {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

impl HfSafetensors {
    /// Opens the safetensors files of `dir`, converting tensors to `dtype` when taken.
    /// Errors name the file: missing files, a bad index, a malformed header.
    pub fn open(dir: &Path, dtype: DType) -> Result<HfSafetensors> {
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        let shard_names: Vec<String> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .map_err(|e| file_err(&index_path, format!("cannot read: {e}")))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| file_err(&index_path, format!("invalid JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| file_err(&index_path, "missing object field `weight_map`"))?;
            let mut names: Vec<String> = map
                .values()
                .map(|f| f.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or_else(|| file_err(&index_path, "`weight_map` values must be file names"))?;
            names.sort();
            names.dedup();
            names
        } else if single.exists() {
            vec!["model.safetensors".to_string()]
        } else {
            return Err(file_err(
                dir,
                "no model.safetensors or model.safetensors.index.json in this directory",
            ));
        };
        let mut files = Vec::new();
        let mut index = BTreeMap::new();
        for name in shard_names {
            let path = dir.join(&name);
            let file =
                File::open(&path).map_err(|e| file_err(&path, format!("cannot open: {e}")))?;
            // SAFETY: the file is opened read-only; we assume nobody truncates it while loading.
            let mmap = unsafe { Mmap::map(&file) }
                .map_err(|e| file_err(&path, format!("cannot map: {e}")))?;
            let (header_len, metadata) = SafeTensors::read_metadata(&mmap)
                .map_err(|e| file_err(&path, format!("invalid safetensors header: {e}")))?;
            for tensor in metadata.tensors().keys() {
                if index.insert(tensor.clone(), files.len()).is_some() {
                    return Err(file_err(
                        &path,
                        format!("tensor `{tensor}` appears in two shards"),
                    ));
                }
            }
            files.push(MappedFile {
                path,
                mmap,
                header_len,
                metadata,
            });
        }
        Ok(HfSafetensors {
            files,
            index,
            dtype,
        })
    }
}

impl WeightSource for HfSafetensors {
    fn take(&mut self, name: &str) -> Result<Option<Tensor>> {
        let Some(fi) = self.index.remove(name) else {
            return Ok(None);
        };
        let f = &self.files[fi];
        let info = f.metadata.info(name).ok_or_else(|| {
            file_err(&f.path, format!("tensor `{name}` vanished from the header"))
        })?;
        let (start, end) = info.data_offsets;
        let base = 8 + f.header_len;
        let bytes = f.mmap.get(base + start..base + end).ok_or_else(|| {
            file_err(
                &f.path,
                format!("tensor `{name}`: data lies past end of file"),
            )
        })?;
        let storage = decode_streaming(&f.mmap, base + start, bytes, info.dtype, self.dtype)
            .ok_or_else(|| {
                file_err(
                    &f.path,
                    format!(
                        "tensor `{name}`: dtype {:?} not supported (F32, BF16, F16)",
                        info.dtype
                    ),
                )
            })?;
        Tensor::new(&info.shape, storage)
            .map_err(|e| file_err(&f.path, format!("tensor `{name}`: {e}")))
            .map(Some)
    }

    fn remaining(&self) -> Vec<String> {
        self.index.keys().cloned().collect()
    }
}

/// Tells the kernel the mapped bytes `offset .. offset + len` (a tensor already copied out,
/// never read again) may be dropped from this process's resident set, so streaming a
/// checkpoint through memory maps keeps the peak RSS at one tensor, not the file size.
/// Best effort: whole 4 KiB pages inside the range only; errors are ignored.
pub fn release_pages(mmap: &Mmap, offset: usize, len: usize) {
    const PAGE: usize = 4096;
    let start = offset.div_ceil(PAGE) * PAGE;
    let end = (offset + len) / PAGE * PAGE;
    if end > start {
        // SAFETY: MADV_DONTNEED on a read-only file mapping only drops cached pages; a later
        // read of the range faults the file's unchanged contents back in. No reference into
        // the range is alive here (the caller copied the tensor out).
        #[cfg(unix)]
        let _ = unsafe {
            mmap.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
        };
    }
}

impl HfSafetensors {
    /// The shape of tensor `name` from the file headers (nothing is read), `None` when
    /// absent or already taken.
    pub fn tensor_shape(&self, name: &str) -> Option<Vec<usize>> {
        let f = &self.files[*self.index.get(name)?];
        f.metadata.info(name).map(|i| i.shape.clone())
    }

    /// The names not taken yet with their shapes.
    pub fn tensor_shapes(&self) -> Vec<(String, Vec<usize>)> {
        self.index
            .keys()
            .filter_map(|n| Some((n.clone(), self.tensor_shape(n)?)))
            .collect()
    }
}

/// [`decode`] of the mapped `bytes` (at `offset` in `mmap`) in 8 MiB pieces, each piece's
/// pages released once decoded, so a tensor costs its decoded size, not twice that.
fn decode_streaming(
    mmap: &Mmap,
    offset: usize,
    bytes: &[u8],
    src: Dtype,
    dst: DType,
) -> Option<Storage> {
    const PIECE: usize = 8 << 20;
    let n = bytes.len() / (src.bitsize() / 8).max(1);
    let mut out = match dst {
        DType::F32 => Storage::F32(Vec::with_capacity(n)),
        DType::BF16 => Storage::BF16(Vec::with_capacity(n)),
        DType::F16 => Storage::F16(Vec::with_capacity(n)),
    };
    for (i, piece) in bytes.chunks(PIECE).enumerate() {
        match (&mut out, decode(piece, src, dst)?) {
            (Storage::F32(a), Storage::F32(b)) => a.extend_from_slice(&b),
            (Storage::BF16(a), Storage::BF16(b)) => a.extend_from_slice(&b),
            (Storage::F16(a), Storage::F16(b)) => a.extend_from_slice(&b),
            _ => return None,
        }
        release_pages(mmap, offset + i * PIECE, piece.len());
    }
    Some(out)
}

/// Little-endian bytes of `src` dtype -> storage of `dst` dtype.
fn decode(bytes: &[u8], src: Dtype, dst: DType) -> Option<Storage> {
    fn words<const N: usize>(bytes: &[u8]) -> impl Iterator<Item = [u8; N]> + '_ {
        bytes
            .chunks_exact(N)
            .map(|c| c.try_into().expect("chunk of N bytes"))
    }
    let storage = match src {
        Dtype::F32 => Storage::F32(words::<4>(bytes).map(f32::from_le_bytes).collect()),
        Dtype::BF16 => Storage::BF16(
            words::<2>(bytes)
                .map(|w| bf16::from_bits(u16::from_le_bytes(w)))
                .collect(),
        ),
        Dtype::F16 => Storage::F16(
            words::<2>(bytes)
                .map(|w| f16::from_bits(u16::from_le_bytes(w)))
                .collect(),
        ),
        _ => return None,
    };
    Some(match (storage, dst) {
        (s, d) if s.dtype() == d => s,
        (Storage::F32(v), DType::BF16) => Storage::BF16(convert_slice(&v)),
        (Storage::F32(v), DType::F16) => Storage::F16(convert_slice(&v)),
        (Storage::BF16(v), DType::F32) => Storage::F32(convert_slice(&v)),
        (Storage::BF16(v), DType::F16) => Storage::F16(convert_slice(&v)),
        (Storage::F16(v), DType::F32) => Storage::F32(convert_slice(&v)),
        (Storage::F16(v), DType::BF16) => Storage::BF16(convert_slice(&v)),
        (s, _) => s,
    })
}

/// Loads an HF model directory (`config.json` + safetensors) with weights stored as `dtype`.
pub fn load_hf_model(dir: &Path, dtype: DType) -> Result<(GptModel, HfModelInfo)> {
    let info = read_hf_config(dir)?;
    let mut src = HfSafetensors::open(dir, dtype)?;
    let model = gpt_model_from_hf(info.config.clone(), &mut src)?;
    Ok((model, info))
}
