//! Writer of Megatron `.bin/.idx` pairs, mirroring `IndexedDatasetBuilder` and `_IndexWriter` in
//! `megatron/core/datasets/indexed_dataset.py`: the same calls (`add_item`, `end_document`,
//! `add_document`, `finalize`) produce byte-identical files. Unlike Megatron, both files are
//! written under temporary names next to the final ones and renamed only at the end, tokens
//! that do not fit the dtype are an error instead of wrapping, and `add_document` checks that its
//! lengths add up.

use super::{INDEX_MAGIC, INDEX_VERSION, IndexedDatasetError, TokenDtype, data_paths};
use std::ffi::OsString;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Errors writing or merging indexed datasets; each names the file concerned.
#[derive(Debug, thiserror::Error)]
pub enum BuilderError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A token does not fit the dataset's dtype (e.g. 70000 in a `uint16` dataset).
    #[error(
        "{path}: token {token} at position {position} of sequence {sequence} does not fit {dtype}"
    )]
    TokenOutOfRange {
        path: PathBuf,
        sequence: usize,
        position: usize,
        token: i64,
        dtype: &'static str,
    },
    /// `add_document`'s lengths do not add up to its token count, or a length is too large.
    #[error("{path}: {detail}")]
    BadLengths { path: PathBuf, detail: String },
    /// A dataset being merged has another dtype than the output.
    #[error("{path}: dtype {found}, but the merged dataset is {expected}")]
    DtypeMismatch {
        path: PathBuf,
        expected: &'static str,
        found: &'static str,
    },
    /// `merge_datasets` was given nothing to merge.
    #[error("no datasets to merge into {0}")]
    NoInputs(PathBuf),
    /// An input dataset could not be opened (missing, truncated, corrupt).
    #[error(transparent)]
    Read(#[from] IndexedDatasetError),
}

pub(super) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> BuilderError + '_ {
    move |source| BuilderError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Counts, in-process, temp files so that two builders never share a name.
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// `FINAL.tmp.PID.N`: beside the final file so that the rename stays on one file system.
fn temp_path(final_path: &Path) -> PathBuf {
    let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut s = OsString::from(final_path.as_os_str());
    s.push(format!(".tmp.{}.{n}", std::process::id()));
    s.into()
}

/// Inclusive range of token values a dtype can hold.
fn dtype_range(dtype: TokenDtype) -> (i64, i64) {
    match dtype {
        TokenDtype::U8 => (0, u8::MAX as i64),
        TokenDtype::I8 => (i8::MIN as i64, i8::MAX as i64),
        TokenDtype::I16 => (i16::MIN as i64, i16::MAX as i64),
        TokenDtype::U16 => (0, u16::MAX as i64),
        TokenDtype::I32 => (i32::MIN as i64, i32::MAX as i64),
        TokenDtype::I64 => (i64::MIN, i64::MAX),
    }
}

/// Streams token sequences into `PREFIX.bin` and, at [`finalize`](Self::finalize), writes
/// `PREFIX.idx` (Megatron's `IndexedDatasetBuilder`). Writes are buffered; the index lives in
/// memory (12 bytes per sequence, 8 per document) until the end. Dropping a builder that was
/// not finalized removes its temporary files, so nothing ever appears under the final names
/// unless the whole dataset was written.
pub struct IndexedDatasetBuilder {
    pub(super) bin_path: PathBuf, // final PREFIX.bin
    idx_path: PathBuf,            // final PREFIX.idx
    bin_tmp: PathBuf,
    idx_tmp: PathBuf,
    pub(super) bin: Option<BufWriter<File>>, // None once finished
    pub(super) dtype: TokenDtype,
    pub(super) sequence_lengths: Vec<i32>, // [sequences]
    pub(super) document_indices: Vec<i64>, // [documents + 1], starts with 0
    pub(super) bin_bytes: u64,
    scratch: Vec<u8>,
}

impl IndexedDatasetBuilder {
    /// Starts a dataset at `PREFIX.bin` / `PREFIX.idx` (the parent directory must exist). Existing
    /// files under those names are replaced only when the builder is finalized.
    pub fn create(prefix: &Path, dtype: TokenDtype) -> Result<Self, BuilderError> {
        let (bin_path, idx_path) = data_paths(prefix);
        let bin_tmp = temp_path(&bin_path);
        let idx_tmp = temp_path(&idx_path);
        let file = File::create(&bin_tmp).map_err(io_err(&bin_tmp))?;
        Ok(IndexedDatasetBuilder {
            bin_path,
            idx_path,
            bin_tmp,
            idx_tmp,
            bin: Some(BufWriter::with_capacity(1 << 20, file)),
            dtype,
            sequence_lengths: Vec::new(),
            document_indices: vec![0],
            bin_bytes: 0,
            scratch: Vec::new(),
        })
    }

    /// Token storage type.
    pub fn dtype(&self) -> TokenDtype {
        self.dtype
    }

    /// Sequences added so far.
    pub fn num_sequences(&self) -> usize {
        self.sequence_lengths.len()
    }

    /// Documents ended so far.
    pub fn num_documents(&self) -> usize {
        self.document_indices.len() - 1
    }

    /// Bytes of token data written to `.bin` so far (tokens x dtype size).
    pub fn bin_bytes(&self) -> u64 {
        self.bin_bytes
    }

    /// Tokens written so far.
    pub fn num_tokens(&self) -> u64 {
        self.bin_bytes / self.dtype.size() as u64
    }

    /// Final `.bin` and `.idx` paths.
    pub fn paths(&self) -> (&Path, &Path) {
        (&self.bin_path, &self.idx_path)
    }

    /// Encodes `tokens` into `scratch` as little-endian `dtype`, checking every value's range
    /// before anything is written (a rejected call leaves the builder unchanged).
    fn encode<T: Copy + Into<i64>>(&mut self, tokens: &[T]) -> Result<(), BuilderError> {
        let (lo, hi) = dtype_range(self.dtype);
        if let Some(pos) = tokens.iter().position(|&t| {
            let v: i64 = t.into();
            v < lo || v > hi
        }) {
            return Err(BuilderError::TokenOutOfRange {
                path: self.bin_path.clone(),
                sequence: self.sequence_lengths.len(),
                position: pos,
                token: tokens[pos].into(),
                dtype: self.dtype.name(),
            });
        }
        let s = &mut self.scratch;
        s.clear();
        s.reserve(tokens.len() * self.dtype.size());
        let it = tokens.iter().map(|&t| t.into());
        match self.dtype {
            TokenDtype::U8 | TokenDtype::I8 => s.extend(it.map(|v: i64| v as u8)),
            TokenDtype::U16 | TokenDtype::I16 => {
                it.for_each(|v: i64| s.extend_from_slice(&(v as u16).to_le_bytes()))
            }
            TokenDtype::I32 => it.for_each(|v: i64| s.extend_from_slice(&(v as i32).to_le_bytes())),
            TokenDtype::I64 => it.for_each(|v: i64| s.extend_from_slice(&v.to_le_bytes())),
        }
        Ok(())
    }

    fn write_scratch(&mut self) -> Result<(), BuilderError> {
        let bin = self.bin.as_mut().expect("builder not finished");
        bin.write_all(&self.scratch)
            .map_err(io_err(&self.bin_tmp))?;
        self.bin_bytes += self.scratch.len() as u64;
        Ok(())
    }

    fn check_length(&self, len: usize) -> Result<i32, BuilderError> {
        i32::try_from(len).map_err(|_| BuilderError::BadLengths {
            path: self.bin_path.clone(),
            detail: format!("sequence of {len} tokens exceeds the int32 length field"),
        })
    }

    /// Appends one sequence to the current document (Megatron's `add_item`). Call
    /// [`end_document`](Self::end_document) after the document's last sequence.
    ///
    /// Errors: a token outside the dtype's range (nothing is written), I/O errors.
    pub fn add_item<T: Copy + Into<i64>>(&mut self, tokens: &[T]) -> Result<(), BuilderError> {
        let len = self.check_length(tokens.len())?;
        self.encode(tokens)?;
        self.write_scratch()?;
        self.sequence_lengths.push(len);
        Ok(())
    }

    /// Ends the current document: every sequence added since the previous document boundary
    /// belongs to it (Megatron's `end_document`; a document may have no sequences).
    pub fn end_document(&mut self) {
        self.document_indices
            .push(self.sequence_lengths.len() as i64);
    }

    /// Appends a whole document: `tokens` holds its sequences back to back, `lengths` their
    /// token counts (Megatron's `add_document`, used by `preprocess_data.py` with one length per
    /// sentence).
    ///
    /// Errors: `lengths` not summing to `tokens.len()`, tokens outside the dtype, I/O errors; a
    /// rejected call writes nothing.
    pub fn add_document<T: Copy + Into<i64>>(
        &mut self,
        tokens: &[T],
        lengths: &[usize],
    ) -> Result<(), BuilderError> {
        let sum = lengths.iter().try_fold(0usize, |a, &l| a.checked_add(l));
        if sum != Some(tokens.len()) {
            return Err(BuilderError::BadLengths {
                path: self.bin_path.clone(),
                detail: format!(
                    "document {}: sequence lengths {lengths:?} do not add up to its {} tokens",
                    self.num_documents(),
                    tokens.len()
                ),
            });
        }
        let lens = lengths
            .iter()
            .map(|&l| self.check_length(l))
            .collect::<Result<Vec<_>, _>>()?;
        self.encode(tokens)?;
        self.write_scratch()?;
        self.sequence_lengths.extend(lens);
        self.end_document();
        Ok(())
    }

    /// The `.idx` bytes for the current state (Megatron's `_IndexWriter.write`): header, counts,
    /// int32 lengths, int64 pointers (running byte offsets), int64 document indices.
    fn index_bytes(&self) -> Vec<u8> {
        let n = self.sequence_lengths.len();
        let d = self.document_indices.len();
        let mut out = Vec::with_capacity(34 + 12 * n + 8 * d);
        out.extend_from_slice(INDEX_MAGIC);
        out.extend_from_slice(&INDEX_VERSION.to_le_bytes());
        out.push(self.dtype.code());
        out.extend_from_slice(&(n as u64).to_le_bytes());
        out.extend_from_slice(&(d as u64).to_le_bytes());
        for &l in &self.sequence_lengths {
            out.extend_from_slice(&l.to_le_bytes());
        }
        let size = self.dtype.size() as i64;
        let mut ptr = 0i64;
        for &l in &self.sequence_lengths {
            out.extend_from_slice(&ptr.to_le_bytes());
            ptr += l as i64 * size;
        }
        for &di in &self.document_indices {
            out.extend_from_slice(&di.to_le_bytes());
        }
        out
    }

    /// Completes both files under their temporary names (flushed and synced) without renaming
    /// them; [`FinishedDataset::commit`] puts them in place. Lets a caller writing several
    /// datasets rename them only once all are complete. Documents still open (sequences added
    /// after the last `end_document`) are not closed: like Megatron, they are counted as
    /// sequences but belong to no document.
    pub fn finish(mut self) -> Result<FinishedDataset, BuilderError> {
        let bin = self.bin.take().expect("builder not finished");
        let file = bin
            .into_inner()
            .map_err(|e| e.into_error())
            .map_err(io_err(&self.bin_tmp))?;
        file.sync_all().map_err(io_err(&self.bin_tmp))?;
        drop(file);
        let mut idx = File::create(&self.idx_tmp).map_err(io_err(&self.idx_tmp))?;
        idx.write_all(&self.index_bytes())
            .and_then(|_| idx.sync_all())
            .map_err(io_err(&self.idx_tmp))?;
        let summary = BuildSummary {
            dtype: self.dtype,
            sequences: self.sequence_lengths.len(),
            documents: self.num_documents(),
            tokens: self.num_tokens(),
        };
        Ok(FinishedDataset {
            paths: [
                (
                    std::mem::take(&mut self.bin_tmp),
                    std::mem::take(&mut self.bin_path),
                ),
                (
                    std::mem::take(&mut self.idx_tmp),
                    std::mem::take(&mut self.idx_path),
                ),
            ],
            summary,
            committed: false,
        })
    }

    /// Writes the index and moves both files to `PREFIX.bin` / `PREFIX.idx` (Megatron's
    /// `finalize`). `.idx` is renamed last, so a prefix whose `.idx` exists is complete.
    pub fn finalize(self) -> Result<BuildSummary, BuilderError> {
        self.finish()?.commit()
    }
}

impl Drop for IndexedDatasetBuilder {
    fn drop(&mut self) {
        // Not finished: remove the partial temp files (finish() empties the paths). The
        // buffered tail is discarded, not flushed.
        if let Some(bin) = self.bin.take() {
            drop(bin.into_parts());
        }
        for p in [&self.bin_tmp, &self.idx_tmp] {
            if !p.as_os_str().is_empty() {
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

/// What a finalized dataset holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BuildSummary {
    pub dtype: TokenDtype,
    pub sequences: usize,
    pub documents: usize,
    pub tokens: u64,
}

/// A dataset complete under temporary names, waiting for [`commit`](Self::commit); dropping it
/// removes the temporary files.
pub struct FinishedDataset {
    paths: [(PathBuf, PathBuf); 2], // (temp, final) for .bin then .idx
    summary: BuildSummary,
    committed: bool,
}

impl FinishedDataset {
    /// Counts of the finished dataset.
    pub fn summary(&self) -> &BuildSummary {
        &self.summary
    }

    /// Renames `.bin` then `.idx` to their final names. If the second rename fails, the first
    /// is undone (the new `.bin` is removed) so the prefix is never half new.
    pub fn commit(mut self) -> Result<BuildSummary, BuilderError> {
        let [(bin_tmp, bin), (idx_tmp, idx)] = &self.paths;
        std::fs::rename(bin_tmp, bin).map_err(io_err(bin))?;
        if let Err(e) = std::fs::rename(idx_tmp, idx) {
            let _ = std::fs::remove_file(bin);
            return Err(io_err(idx)(e));
        }
        self.committed = true;
        Ok(self.summary.clone())
    }
}

impl Drop for FinishedDataset {
    fn drop(&mut self) {
        if !self.committed {
            for (tmp, _) in &self.paths {
                let _ = std::fs::remove_file(tmp);
            }
        }
    }
}
