use super::{INDEX_MAGIC, INDEX_VERSION, TokenDtype, data_paths};
use memmap2::Mmap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// Errors opening or reading an indexed dataset; each names the file and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum IndexedDatasetError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file is not a valid Megatron index / data file, or the two disagree.
    #[error("{path}: {detail}")]
    Corrupt { path: PathBuf, detail: String },
    /// A read outside a sequence.
    #[error("sequence {sequence}: tokens {start}..{end} are outside its {length} tokens")]
    OutOfRange {
        sequence: usize,
        start: usize,
        end: usize,
        length: usize,
    },
}

/// A memory-mapped Megatron `.bin/.idx` pair (reader). Opening validates the header, that the
/// index's size matches its counts, that document indices are monotone from 0 to the sequence
/// count, and that every sequence lies inside `.bin`; after that, reads cannot fail except by
/// asking for tokens outside a sequence.
pub struct IndexedDataset {
    bin_path: PathBuf,
    dtype: TokenDtype,
    sequence_lengths: Vec<u32>,  // [sequence_count]
    sequence_pointers: Vec<u64>, // [sequence_count], byte offsets into .bin
    document_indices: Vec<u64>,  // [documents + 1]
    bin: Option<Mmap>,           // None when .bin is empty (mmap of 0 bytes is an error)
}

fn corrupt(path: &Path, detail: impl Into<String>) -> IndexedDatasetError {
    IndexedDatasetError::Corrupt {
        path: path.to_path_buf(),
        detail: detail.into(),
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> IndexedDatasetError + '_ {
    move |source| IndexedDatasetError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Little-endian cursor over the `.idx` bytes with bounds-checked reads.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize, what: &str) -> Result<&[u8], IndexedDatasetError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| {
                corrupt(
                    self.path,
                    format!(
                        "truncated: {what} needs bytes {}..{}, file has {}",
                        self.pos,
                        self.pos.saturating_add(n),
                        self.bytes.len()
                    ),
                )
            })?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn u64(&mut self, what: &str) -> Result<u64, IndexedDatasetError> {
        Ok(u64::from_le_bytes(
            self.take(8, what)?.try_into().expect("8 bytes"),
        ))
    }

    fn array<T>(
        &mut self,
        count: u64,
        size: usize,
        what: &str,
        f: impl Fn(&[u8]) -> T,
    ) -> Result<Vec<T>, IndexedDatasetError> {
        let n = usize::try_from(count)
            .ok()
            .and_then(|c| c.checked_mul(size))
            .ok_or_else(|| corrupt(self.path, format!("{what}: count {count} overflows")))?;
        Ok(self.take(n, what)?.chunks_exact(size).map(f).collect())
    }
}

/// The `.idx` contents as stored, before they are checked against `.bin`.
struct RawIndex {
    dtype: TokenDtype,
    sequence_count: u64,
    sequence_lengths: Vec<i32>,
    sequence_pointers: Vec<i64>,
    document_indices: Vec<i64>,
}

/// Reads the magic, version and dtype code at the start of the `.idx`.
fn read_header(c: &mut Cursor) -> Result<TokenDtype, IndexedDatasetError> {
    let path = c.path;
    if c.take(9, "magic")? != INDEX_MAGIC {
        return Err(corrupt(
            path,
            "bad magic: not a Megatron index (expected MMIDIDX\\x00\\x00)",
        ));
    }
    let version = c.u64("version")?;
    if version != INDEX_VERSION {
        return Err(corrupt(
            path,
            format!("version {version}, expected {INDEX_VERSION}"),
        ));
    }
    let code = c.take(1, "dtype code")?[0];
    TokenDtype::from_code(code).ok_or_else(|| {
        corrupt(
            path,
            format!("dtype code {code} is not an integer token type (1-5, 8)"),
        )
    })
}

/// Parses the whole `.idx`: header, counts, the three arrays, and the allowed trailer.
fn parse_index(idx: &[u8], idx_path: &Path) -> Result<RawIndex, IndexedDatasetError> {
    let mut c = Cursor {
        bytes: idx,
        pos: 0,
        path: idx_path,
    };
    let dtype = read_header(&mut c)?;
    let sequence_count = c.u64("sequence_count")?;
    let document_count = c.u64("document_count")?;
    let sequence_lengths = c.array(sequence_count, 4, "sequence_lengths", |b| {
        i32::from_le_bytes(b.try_into().expect("4"))
    })?;
    let sequence_pointers = c.array(sequence_count, 8, "sequence_pointers", |b| {
        i64::from_le_bytes(b.try_into().expect("8"))
    })?;
    let document_indices = c.array(document_count, 8, "document_indices", |b| {
        i64::from_le_bytes(b.try_into().expect("8"))
    })?;
    // Megatron may append per-sequence modes (multimodal); anything else is corruption.
    let rest = idx.len() - c.pos;
    if rest != 0 && rest as u64 != sequence_count {
        return Err(corrupt(
            idx_path,
            format!("{rest} unexpected trailing bytes after document_indices"),
        ));
    }
    Ok(RawIndex {
        dtype,
        sequence_count,
        sequence_lengths,
        sequence_pointers,
        document_indices,
    })
}

/// Checks that every sequence lies inside the `bin_len`-byte `.bin`; returns the lengths and
/// pointers unsigned.
fn check_sequences(
    raw: &RawIndex,
    bin_path: &Path,
    bin_len: u64,
) -> Result<(Vec<u32>, Vec<u64>), IndexedDatasetError> {
    let dtype = raw.dtype;
    let mut lengths = Vec::with_capacity(raw.sequence_lengths.len());
    let mut pointers = Vec::with_capacity(raw.sequence_pointers.len());
    for (i, (&len, &ptr)) in raw
        .sequence_lengths
        .iter()
        .zip(&raw.sequence_pointers)
        .enumerate()
    {
        let end = u64::try_from(len)
            .ok()
            .zip(u64::try_from(ptr).ok())
            .and_then(|(l, p)| p.checked_add(l.checked_mul(dtype.size() as u64)?));
        match end {
            Some(e) if e <= bin_len => {}
            _ => {
                return Err(corrupt(
                    bin_path,
                    format!(
                        "sequence {i} (pointer {ptr}, {len} tokens of {}) lies outside the {bin_len}-byte file",
                        dtype.name()
                    ),
                ));
            }
        }
        lengths.push(len as u32);
        pointers.push(ptr as u64);
    }
    Ok((lengths, pointers))
}

/// Checks that the document indices rise from 0 to the sequence count; returns them unsigned.
fn check_documents(raw: &RawIndex, idx_path: &Path) -> Result<Vec<u64>, IndexedDatasetError> {
    let sequence_count = raw.sequence_count;
    let docs: Vec<u64> = raw
        .document_indices
        .iter()
        .map(|&d| d.max(0) as u64)
        .collect();
    let monotone = docs.windows(2).all(|w| w[0] <= w[1]);
    if docs.first() != Some(&0)
        || docs.last() != Some(&sequence_count)
        || !monotone
        || raw.document_indices.iter().any(|&d| d < 0)
    {
        return Err(corrupt(
            idx_path,
            format!("document_indices must rise from 0 to sequence_count {sequence_count}"),
        ));
    }
    Ok(docs)
}

impl IndexedDataset {
    /// Opens `PREFIX.bin` and `PREFIX.idx`.
    pub fn open(prefix: &Path) -> Result<IndexedDataset, IndexedDatasetError> {
        let (bin_path, idx_path) = data_paths(prefix);
        let idx = std::fs::read(&idx_path).map_err(io(&idx_path))?;
        let raw = parse_index(&idx, &idx_path)?;
        let bin_file = File::open(&bin_path).map_err(io(&bin_path))?;
        let bin_len = bin_file.metadata().map_err(io(&bin_path))?.len();
        let (lengths, pointers) = check_sequences(&raw, &bin_path, bin_len)?;
        let docs = check_documents(&raw, &idx_path)?;
        let bin = if bin_len == 0 {
            None
        } else {
            // SAFETY: read-only map; the dataset assumes the file is not truncated while open.
            Some(unsafe { Mmap::map(&bin_file) }.map_err(io(&bin_path))?)
        };
        Ok(IndexedDataset {
            bin_path,
            dtype: raw.dtype,
            sequence_lengths: lengths,
            sequence_pointers: pointers,
            document_indices: docs,
            bin,
        })
    }

    /// Token storage type.
    pub fn dtype(&self) -> TokenDtype {
        self.dtype
    }

    /// Number of sequences (`len(IndexedDataset)` in Megatron).
    pub fn len(&self) -> usize {
        self.sequence_lengths.len()
    }

    /// True when there are no sequences.
    pub fn is_empty(&self) -> bool {
        self.sequence_lengths.is_empty()
    }

    /// Tokens per sequence, `[sequence_count]`.
    pub fn sequence_lengths(&self) -> &[u32] {
        &self.sequence_lengths
    }

    /// Byte offset of each sequence in `.bin`, `[sequence_count]`.
    pub fn sequence_pointers(&self) -> &[u64] {
        &self.sequence_pointers
    }

    /// Sequence index where each document starts, then `sequence_count`: `[documents + 1]`.
    pub fn document_indices(&self) -> &[u64] {
        &self.document_indices
    }

    /// Number of documents.
    pub fn num_documents(&self) -> usize {
        self.document_indices.len() - 1
    }

    /// Total tokens over all sequences.
    pub fn num_tokens(&self) -> u64 {
        self.sequence_lengths.iter().map(|&l| l as u64).sum()
    }

    /// The `.bin` path (for messages).
    pub fn bin_path(&self) -> &Path {
        &self.bin_path
    }

    /// Appends tokens `offset..offset+length` of sequence `i` to `out` (Megatron's
    /// `IndexedDataset.get(idx, offset, length)`); tokens widen to `u32`.
    pub fn read_into(
        &self,
        i: usize,
        offset: usize,
        length: usize,
        out: &mut Vec<u32>,
    ) -> Result<(), IndexedDatasetError> {
        let seq_len = *self
            .sequence_lengths
            .get(i)
            .ok_or(IndexedDatasetError::OutOfRange {
                sequence: i,
                start: offset,
                end: offset + length,
                length: 0,
            })? as usize;
        if offset.checked_add(length).is_none_or(|e| e > seq_len) {
            return Err(IndexedDatasetError::OutOfRange {
                sequence: i,
                start: offset,
                end: offset.saturating_add(length),
                length: seq_len,
            });
        }
        let size = self.dtype.size();
        let start = self.sequence_pointers[i] as usize + offset * size;
        let bytes = match &self.bin {
            Some(m) => &m[start..start + length * size],
            None => &[][..],
        };
        out.extend(
            bytes
                .chunks_exact(size)
                .map(|b| self.dtype.decode(b) as u32),
        );
        Ok(())
    }

    /// All tokens of sequence `i`.
    pub fn sequence(&self, i: usize) -> Result<Vec<u32>, IndexedDatasetError> {
        let len = *self.sequence_lengths.get(i).unwrap_or(&0) as usize;
        let mut out = Vec::with_capacity(len);
        self.read_into(i, 0, len, &mut out)?;
        Ok(out)
    }
}
