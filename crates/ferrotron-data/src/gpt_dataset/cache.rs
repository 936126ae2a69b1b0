//! On-disk cache of dataset indices, laid out like Megatron's:
//! `{dir}/{hash}-{class}-{split}-{name}.npy` plus `{hash}-{class}-{split}-description.json`,
//! where `hash` is the SHA-256 (hex) of the description JSON (Megatron: MD5 of its
//! `unique_description`). The arrays are NumPy `.npy` v1.0 files with Megatron's dtypes, so
//! `numpy.load` reads them.
//!
//! The description file is written last and records the SHA-256 of every array file, so a
//! cache is used only when the description matches and every file is intact; anything else
//! (missing, truncated, edited, stale) is rebuilt. Every file is written to a temporary name in
//! the same folder and renamed into place, so readers never see a half-written file.

use super::DatasetError;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// What happened to a dataset's cached indices when it was built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheStatus {
    /// No `path_to_cache`: built in memory.
    Disabled,
    /// Loaded from the cache.
    Hit,
    /// Not cached yet: built and written.
    Built,
    /// A cache was there but unusable (the reason says which file and why): rebuilt, rewritten.
    Rebuilt(String),
}

/// Lowercase hex SHA-256 of bytes.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A 1-D or 2-D little-endian integer array in NumPy's `.npy` format.
#[derive(Clone, Debug, PartialEq)]
pub struct NpyArray {
    /// NumPy dtype string: `<i2`, `<i4`, `<u4` or `<i8`.
    pub descr: &'static str,
    /// `[n]` or `[n, 2]`.
    pub shape: Vec<usize>,
    /// Raw little-endian element bytes, row-major.
    pub data: Vec<u8>,
}

const DESCRS: [(&str, usize); 4] = [("<i2", 2), ("<i4", 4), ("<u4", 4), ("<i8", 8)];

impl NpyArray {
    /// Packs values (which must fit the dtype; callers choose the dtype from the value range).
    pub fn from_i64(
        descr: &'static str,
        shape: Vec<usize>,
        values: impl Iterator<Item = i64>,
    ) -> NpyArray {
        let mut data = Vec::new();
        for v in values {
            match descr {
                "<i2" => data.extend((v as i16).to_le_bytes()),
                "<i4" => data.extend((v as i32).to_le_bytes()),
                "<u4" => data.extend((v as u32).to_le_bytes()),
                _ => data.extend(v.to_le_bytes()),
            }
        }
        NpyArray { descr, shape, data }
    }

    /// The elements widened to `i64`.
    pub fn to_i64(&self) -> Vec<i64> {
        let size = DESCRS.iter().find(|d| d.0 == self.descr).map_or(8, |d| d.1);
        self.data
            .chunks_exact(size)
            .map(|b| match self.descr {
                "<i2" => i16::from_le_bytes([b[0], b[1]]) as i64,
                "<i4" => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
                "<u4" => u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
                _ => i64::from_le_bytes(b.try_into().unwrap_or([0; 8])),
            })
            .collect()
    }

    /// The `.npy` bytes (format 1.0, header padded to 64 bytes like NumPy).
    pub fn to_bytes(&self) -> Vec<u8> {
        let shape = match self.shape.as_slice() {
            [n] => format!("({n},)"),
            dims => format!(
                "({})",
                dims.iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        let mut header = format!(
            "{{'descr': '{}', 'fortran_order': False, 'shape': {shape}, }}",
            self.descr
        );
        let unpadded = 10 + header.len() + 1;
        header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
        header.push('\n');
        let mut out = b"\x93NUMPY\x01\x00".to_vec();
        out.extend((header.len() as u16).to_le_bytes());
        out.extend(header.as_bytes());
        out.extend(&self.data);
        out
    }

    /// Parses `.npy` bytes of the kind [`to_bytes`](Self::to_bytes) writes (C order, one of our
    /// dtypes); the element count must match the file size.
    pub fn parse(bytes: &[u8]) -> Result<NpyArray, String> {
        if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" || bytes[6] != 1 {
            return Err("not a .npy v1 file".into());
        }
        let hlen = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
        let header = bytes
            .get(10..10 + hlen)
            .and_then(|h| std::str::from_utf8(h).ok())
            .ok_or("truncated or non-UTF-8 header")?;
        let field = |key: &str| -> Option<&str> {
            let rest = &header[header.find(&format!("'{key}': "))? + key.len() + 4..];
            Some(rest)
        };
        let descr_s = field("descr").ok_or("no descr")?;
        let (descr, size) = *DESCRS
            .iter()
            .find(|(d, _)| descr_s.starts_with(&format!("'{d}'")))
            .ok_or("unsupported dtype")?;
        if !field("fortran_order").is_some_and(|f| f.starts_with("False")) {
            return Err("fortran_order must be False".into());
        }
        let shape_s = field("shape").ok_or("no shape")?;
        let inner = shape_s
            .strip_prefix('(')
            .and_then(|s| s.split(')').next())
            .ok_or("bad shape")?;
        let shape = inner
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<usize>()
                    .map_err(|_| format!("bad shape entry {s:?}"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let count = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or("shape overflows")?;
        let data = &bytes[10 + hlen..];
        if Some(data.len()) != count.checked_mul(size) {
            return Err(format!(
                "shape {shape:?} needs {count} x {size} bytes, file has {}",
                data.len()
            ));
        }
        Ok(NpyArray {
            descr,
            shape,
            data: data.to_vec(),
        })
    }
}

/// The cache files of one dataset: `{dir}/{hash}-{class}-{split}-*`.
pub struct IndexCache {
    dir: PathBuf,
    base: String,
    hash: String,
    description: Value,
}

impl IndexCache {
    /// `description` is the JSON identity of the dataset (all inputs of its indices).
    pub fn new(dir: &Path, class: &str, split: &str, description: &Value) -> IndexCache {
        let hash = sha256_hex(description.to_string().as_bytes());
        IndexCache {
            dir: dir.to_path_buf(),
            base: format!("{hash}-{class}-{split}"),
            hash,
            description: description.clone(),
        }
    }

    /// Path of the file `{base}-{affix}`.
    pub fn path(&self, affix: &str) -> PathBuf {
        self.dir.join(format!("{}-{affix}", self.base))
    }

    /// Loads the named arrays (`name` -> `{base}-{name}.npy`). `Ok(None)` when the cache does
    /// not exist; `Err(reason)` when it exists but is stale or corrupt.
    pub fn load(&self, names: &[&str]) -> Result<Option<Vec<NpyArray>>, String> {
        let desc_path = self.path("description.json");
        let Ok(text) = std::fs::read_to_string(&desc_path) else {
            return Ok(None);
        };
        let manifest: Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", desc_path.display()))?;
        // Compare hashes, not parsed floats (JSON float parsing need not round-trip exactly).
        if manifest["description_sha256"].as_str() != Some(self.hash.as_str()) {
            return Err(format!("{}: description differs", desc_path.display()));
        }
        let mut out = Vec::with_capacity(names.len());
        for name in names {
            let path = self.path(&format!("{name}.npy"));
            let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            let want = manifest["files"][format!("{name}.npy")].as_str();
            if want != Some(sha256_hex(&bytes).as_str()) {
                return Err(format!("{}: checksum mismatch", path.display()));
            }
            out.push(NpyArray::parse(&bytes).map_err(|e| format!("{}: {e}", path.display()))?);
        }
        Ok(Some(out))
    }

    /// Writes the arrays, then the description with their checksums (all atomically).
    pub fn store(&self, arrays: &[(&str, &NpyArray)]) -> Result<(), DatasetError> {
        std::fs::create_dir_all(&self.dir).map_err(|source| DatasetError::Io {
            path: self.dir.clone(),
            source,
        })?;
        let mut files = serde_json::Map::new();
        for (name, array) in arrays {
            let bytes = array.to_bytes();
            files.insert(format!("{name}.npy"), json!(sha256_hex(&bytes)));
            write_atomic(&self.path(&format!("{name}.npy")), &bytes)?;
        }
        let manifest = json!({
            "description": self.description,
            "description_sha256": self.hash,
            "files": files,
        });
        let text = serde_json::to_string_pretty(&manifest).unwrap_or_default();
        write_atomic(&self.path("description.json"), text.as_bytes())
    }
}

/// Writes `bytes` to a unique temporary file next to `path`, then renames it over `path`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), DatasetError> {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp-{}-{n}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |source| DatasetError::Io { path: p, source }
    };
    std::fs::write(&tmp, bytes).map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        DatasetError::Io {
            path: path.to_path_buf(),
            source: e,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npy_round_trip_and_header_alignment() {
        let a = NpyArray::from_i64("<i4", vec![3, 2], [1, 2, 3, 4, 5, -6].into_iter());
        let bytes = a.to_bytes();
        let hlen = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
        assert_eq!((10 + hlen) % 64, 0);
        let b = NpyArray::parse(&bytes).unwrap();
        assert_eq!(b, a);
        assert_eq!(b.to_i64(), [1, 2, 3, 4, 5, -6]);
        assert!(NpyArray::parse(&bytes[..bytes.len() - 1]).is_err());
    }
}
