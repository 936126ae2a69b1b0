//! [`CheckpointReader`]: opens an iteration directory, validates `metadata.json` (format,
//! version, shard cover) and reads any box of any tensor, assembling it from whichever shards
//! overlap it. Loading under a layout other than the save's is therefore just reading other
//! boxes (Megatron `dist_checkpointing`'s resharding on load).

use super::metadata::{
    CheckpointMetadata, FORMAT_NAME, FORMAT_VERSION, METADATA_FILE, ShardRecord, StoredDtype,
    TensorRecord, volume,
};
use crate::CheckpointError;
use memmap2::Mmap;
use safetensors::SafeTensors;
use safetensors::tensor::Metadata;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// An opened checkpoint directory.
pub struct CheckpointReader {
    dir: PathBuf,
    metadata: CheckpointMetadata,
    /// Memory-mapped safetensors files by name, headers parsed once.
    files: BTreeMap<String, MappedFile>,
}

/// One mapped shard file and its parsed header.
struct MappedFile {
    mmap: Mmap,
    /// Start of the data section (after the 8-byte length and the header).
    data_start: usize,
    header: Metadata,
}

fn format_err(path: &Path, detail: impl Into<String>) -> CheckpointError {
    CheckpointError::Format {
        file: path.display().to_string(),
        detail: detail.into(),
    }
}

impl CheckpointReader {
    /// Opens `dir` (an iteration directory such as `save/iter_0000100`).
    ///
    /// # Errors
    /// Missing or malformed `metadata.json`, another format or version, shards that do not
    /// cover their tensor, or a missing/unreadable shard file.
    pub fn open(dir: &Path) -> Result<CheckpointReader, CheckpointError> {
        let meta_path = dir.join(METADATA_FILE);
        let text = std::fs::read(&meta_path).map_err(|e| CheckpointError::io(&meta_path, e))?;
        let metadata: CheckpointMetadata = serde_json::from_slice(&text)
            .map_err(|e| format_err(&meta_path, format!("invalid metadata: {e}")))?;
        if metadata.format != FORMAT_NAME {
            return Err(format_err(
                &meta_path,
                format!("format is `{}`, expected `{FORMAT_NAME}`", metadata.format),
            ));
        }
        if metadata.format_version != FORMAT_VERSION {
            return Err(format_err(
                &meta_path,
                format!(
                    "format_version {} is not supported by this build (it reads {FORMAT_VERSION})",
                    metadata.format_version
                ),
            ));
        }
        let mut files = BTreeMap::new();
        for (key, t) in &metadata.tensors {
            t.check_cover()
                .map_err(|e| format_err(&meta_path, format!("tensor {key}: {e}")))?;
            for s in &t.shards {
                if files.contains_key(&s.file) {
                    continue;
                }
                let path = dir.join(&s.file);
                let file = File::open(&path).map_err(|e| CheckpointError::io(&path, e))?;
                // SAFETY: read-only mapping of a file nobody writes while we load (checkpoint
                // directories are immutable once committed).
                let mmap =
                    unsafe { Mmap::map(&file) }.map_err(|e| CheckpointError::io(&path, e))?;
                let (header_len, header) = SafeTensors::read_metadata(&mmap)
                    .map_err(|e| format_err(&path, format!("invalid safetensors file: {e}")))?;
                files.insert(
                    s.file.clone(),
                    MappedFile {
                        mmap,
                        data_start: 8 + header_len,
                        header,
                    },
                );
            }
        }
        Ok(CheckpointReader {
            dir: dir.to_path_buf(),
            metadata,
            files,
        })
    }

    /// The parsed `metadata.json`.
    pub fn metadata(&self) -> &CheckpointMetadata {
        &self.metadata
    }

    /// The directory this reader opened.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Checks that the checkpoint holds exactly the tensors `expected` (key, global shape)
    /// among the keys starting with `prefix`: one error listing every missing key, every extra
    /// key and every shape mismatch.
    ///
    /// # Errors
    /// [`CheckpointError::Format`] naming `metadata.json` and the offending keys.
    pub fn check_tensors(
        &self,
        prefix: &str,
        expected: &[(String, Vec<usize>)],
    ) -> Result<(), CheckpointError> {
        let want: BTreeMap<&str, &Vec<usize>> =
            expected.iter().map(|(k, s)| (k.as_str(), s)).collect();
        let mut problems = self.shape_problems(want.iter().map(|(k, s)| (*k, s.as_slice())));
        for key in self.metadata.tensors.keys() {
            if key.starts_with(prefix) && !want.contains_key(key.as_str()) {
                problems.push(format!("unexpected tensor {key}"));
            }
        }
        self.problems_to_result(problems)
    }

    /// Checks that the checkpoint holds the tensors `expected` (key, global shape), extra
    /// keys allowed (a pipeline stage reads its own part): one error listing every missing
    /// key and every shape mismatch.
    ///
    /// # Errors
    /// [`CheckpointError::Format`] naming `metadata.json` and the offending keys.
    pub fn check_tensors_present(
        &self,
        expected: &[(String, Vec<usize>)],
    ) -> Result<(), CheckpointError> {
        let problems =
            self.shape_problems(expected.iter().map(|(k, s)| (k.as_str(), s.as_slice())));
        self.problems_to_result(problems)
    }

    /// "missing tensor K" / "tensor K has shape .., expected .." for each expected tensor
    /// that is absent or of another global shape.
    fn shape_problems<'a>(
        &self,
        expected: impl Iterator<Item = (&'a str, &'a [usize])>,
    ) -> Vec<String> {
        expected
            .filter_map(|(key, shape)| match self.metadata.tensors.get(key) {
                None => Some(format!("missing tensor {key}")),
                Some(t) if t.global_shape != shape => Some(format!(
                    "tensor {key} has shape {:?}, expected {shape:?}",
                    t.global_shape
                )),
                Some(_) => None,
            })
            .collect()
    }

    /// One error naming `metadata.json` and every problem, or `Ok` when there are none.
    fn problems_to_result(&self, problems: Vec<String>) -> Result<(), CheckpointError> {
        if problems.is_empty() {
            return Ok(());
        }
        Err(format_err(
            &self.dir.join(METADATA_FILE),
            problems.join("; "),
        ))
    }

    /// The whole tensor `key` as f32, row-major in its global shape.
    ///
    /// # Errors
    /// Unknown key, or a shard missing from its file or of the wrong size.
    pub fn read(&self, key: &str) -> Result<Vec<f32>, CheckpointError> {
        let t = self.record(key)?;
        let shape = t.global_shape.clone();
        self.read_box(key, &vec![0; shape.len()], &shape)
    }

    /// The box `offset .. offset + shape` of tensor `key` as f32, row-major in `shape`.
    ///
    /// # Errors
    /// Unknown key, a box outside the tensor or of another rank, or a damaged shard.
    pub fn read_box(
        &self,
        key: &str,
        offset: &[usize],
        shape: &[usize],
    ) -> Result<Vec<f32>, CheckpointError> {
        let t = self.record(key)?;
        let meta_path = self.dir.join(METADATA_FILE);
        let rank = t.global_shape.len();
        let inside = offset.len() == rank
            && shape.len() == rank
            && (0..rank).all(|d| offset[d] + shape[d] <= t.global_shape[d]);
        if !inside {
            return Err(format_err(
                &meta_path,
                format!(
                    "tensor {key}: box at {offset:?} of shape {shape:?} is not inside {:?}",
                    t.global_shape
                ),
            ));
        }
        let n = volume(shape).ok_or_else(|| format_err(&meta_path, "box size overflows"))?;
        let mut out = vec![0f32; n];
        for s in &t.shards {
            self.copy_overlap(key, t.dtype, s, offset, shape, &mut out)?;
        }
        Ok(out)
    }

    /// A rank's local array of `len` elements of tensor `key` whose runs lie in the full
    /// tensor at `boxes` (see [`ferrotron_model::TpSplit::boxes`]; `local_start` relative to
    /// the array); elements in no box (vocabulary padding) are zero.
    ///
    /// # Errors
    /// As [`read_box`](Self::read_box), or a box that does not fit in `len`.
    pub fn read_local(
        &self,
        key: &str,
        boxes: &[ferrotron_model::ParamBox],
        len: usize,
    ) -> Result<Vec<f32>, CheckpointError> {
        let mut out = vec![0f32; len];
        for b in boxes {
            let values = self.read_box(key, &b.global_offset, &b.shape)?;
            let dst = out
                .get_mut(b.local_start..b.local_start + values.len())
                .ok_or_else(|| {
                    format_err(
                        &self.dir.join(METADATA_FILE),
                        format!(
                            "tensor {key}: a box at {} exceeds the local {len}",
                            b.local_start
                        ),
                    )
                })?;
            dst.copy_from_slice(&values);
        }
        Ok(out)
    }

    /// Lets the kernel drop the resident pages of the elements `span` of shard `s` once
    /// copied out: a later read faults them back in from the page cache, and streaming a
    /// large checkpoint keeps its resident set at the tensors in use, not the files' size.
    fn release_read(&self, s: &ShardRecord, dtype: StoredDtype, span: std::ops::Range<usize>) {
        let file = &self.files[&s.file];
        if let Some(info) = file.header.info(&s.name) {
            let start = file.data_start + info.data_offsets.0 + span.start * dtype.size();
            ferrotron_model::families::release_pages(&file.mmap, start, span.len() * dtype.size());
        }
    }

    fn record(&self, key: &str) -> Result<&TensorRecord, CheckpointError> {
        self.metadata.tensors.get(key).ok_or_else(|| {
            format_err(
                &self.dir.join(METADATA_FILE),
                format!("no tensor {key} in this checkpoint"),
            )
        })
    }

    /// Copies the part of shard `s` that overlaps the box (`offset`, `shape`) into `out`.
    fn copy_overlap(
        &self,
        key: &str,
        dtype: StoredDtype,
        s: &ShardRecord,
        offset: &[usize],
        shape: &[usize],
        out: &mut [f32],
    ) -> Result<(), CheckpointError> {
        let rank = shape.len();
        let lo: Vec<usize> = (0..rank)
            .map(|d| offset[d].max(s.global_offset[d]))
            .collect();
        let hi: Vec<usize> = (0..rank)
            .map(|d| (offset[d] + shape[d]).min(s.global_offset[d] + s.local_shape[d]))
            .collect();
        if (0..rank).any(|d| lo[d] >= hi[d]) {
            return Ok(());
        }
        let bytes = self.shard_bytes(key, dtype, s)?;
        if rank == 0 {
            decode_run(dtype, bytes, 0, &mut out[..1]);
            return Ok(());
        }
        copy_runs((bytes, dtype), s, (offset, shape), (&lo, &hi), out);
        // The elements read lie between the overlap's first and last index (row-major).
        let last: Vec<usize> = hi.iter().map(|&h| h - 1).collect();
        let span = flat(&lo, &s.global_offset, &s.local_shape)
            ..flat(&last, &s.global_offset, &s.local_shape) + 1;
        self.release_read(s, dtype, span);
        Ok(())
    }

    /// The raw little-endian bytes of one shard, checked against its dtype and shape.
    fn shard_bytes(
        &self,
        key: &str,
        dtype: StoredDtype,
        s: &ShardRecord,
    ) -> Result<&[u8], CheckpointError> {
        let path = self.dir.join(&s.file);
        let file = &self.files[&s.file];
        let info = file.header.info(&s.name).ok_or_else(|| {
            format_err(
                &path,
                format!("no tensor {} (of {key}) in this file", s.name),
            )
        })?;
        if info.shape != s.local_shape || info.dtype.to_string() != dtype.safetensors_name() {
            return Err(format_err(
                &path,
                format!(
                    "tensor {}: stored as {} {:?}, metadata says {} {:?}",
                    s.name,
                    info.dtype,
                    info.shape,
                    dtype.safetensors_name(),
                    s.local_shape
                ),
            ));
        }
        let (start, end) = info.data_offsets;
        let expected = volume(&s.local_shape)
            .unwrap_or(usize::MAX)
            .saturating_mul(dtype.size());
        file.mmap
            .get(file.data_start + start..file.data_start + end)
            .filter(|b| b.len() == expected)
            .ok_or_else(|| {
                format_err(
                    &path,
                    format!("tensor {}: data lies past the end of the file", s.name),
                )
            })
    }
}

/// Copies the overlap `lo .. hi` of shard `s` (its bytes `bytes`) into the box (`offset`,
/// `shape`) held in `out`, one run along the last dimension per index of the others.
fn copy_runs(
    (bytes, dtype): (&[u8], StoredDtype),
    s: &ShardRecord,
    (offset, shape): (&[usize], &[usize]),
    (lo, hi): (&[usize], &[usize]),
    out: &mut [f32],
) {
    let rank = shape.len();
    // Walk every index of the overlap except the last dimension; copy one run per index.
    let run = hi[rank - 1] - lo[rank - 1];
    let mut idx = lo.to_vec();
    loop {
        let src = flat(&idx, &s.global_offset, &s.local_shape);
        let dst = flat(&idx, offset, shape);
        decode_run(dtype, bytes, src, &mut out[dst..dst + run]);
        // Next index in row-major order over dims 0..rank-1.
        let mut d = rank - 1;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < hi[d] {
                break;
            }
            idx[d] = lo[d];
        }
    }
}

/// Row-major flat index of global index `idx` inside the box (`offset`, `shape`).
fn flat(idx: &[usize], offset: &[usize], shape: &[usize]) -> usize {
    idx.iter()
        .zip(offset)
        .zip(shape)
        .fold(0, |acc, ((&i, &o), &n)| acc * n + (i - o))
}

/// Elements `start .. start + out.len()` of little-endian `bytes` of type `dtype`, widened to
/// f32 into `out`.
fn decode_run(dtype: StoredDtype, bytes: &[u8], start: usize, out: &mut [f32]) {
    let n = dtype.size();
    let src = bytes[start * n..(start + out.len()) * n].chunks_exact(n);
    match dtype {
        StoredDtype::F32 => {
            for (o, b) in out.iter_mut().zip(src) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        StoredDtype::BF16 => {
            for (o, b) in out.iter_mut().zip(src) {
                *o = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        StoredDtype::F16 => {
            for (o, b) in out.iter_mut().zip(src) {
                *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
    }
}
