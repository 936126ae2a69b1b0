//! Merging indexed datasets, as Megatron's `tools/merge_datasets.py` does with
//! `IndexedDatasetBuilder.add_index`: the inputs' sequences are concatenated in order, sequence
//! pointers are recomputed for the merged `.bin`, and each input's document indices are offset
//! by the number of sequences before it. The output is written atomically (temp names, renamed
//! at the end).

use super::builder::{BuildSummary, BuilderError, IndexedDatasetBuilder, io_err};
use super::{IndexedDataset, data_paths};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

impl IndexedDatasetBuilder {
    /// Appends every sequence and document of the dataset at `prefix` (Megatron's
    /// `add_index`). The input is opened with [`IndexedDataset::open`], so a truncated or
    /// corrupt input is reported before anything is copied. Only the bytes its sequences
    /// occupy are copied (in one block when they are contiguous, as Megatron writes them), so
    /// trailing garbage in an input `.bin` cannot shift the merged pointers.
    ///
    /// Errors: the input's dtype differs from the builder's ([`BuilderError::DtypeMismatch`]),
    /// the input cannot be opened, I/O errors. After an I/O error while copying, the builder
    /// holds partial data and should be dropped (which removes its temp files).
    pub fn add_index(&mut self, prefix: &Path) -> Result<(), BuilderError> {
        let ds = IndexedDataset::open(prefix)?;
        let (bin_path, idx_path) = data_paths(prefix);
        if ds.dtype() != self.dtype {
            return Err(BuilderError::DtypeMismatch {
                path: idx_path,
                expected: self.dtype.name(),
                found: ds.dtype().name(),
            });
        }
        let size = self.dtype.size() as u64;
        let lengths = ds.sequence_lengths();
        let pointers = ds.sequence_pointers();
        let total: u64 = lengths.iter().map(|&l| l as u64 * size).sum();
        let mut contiguous = true;
        let mut running = 0u64;
        for (&l, &p) in lengths.iter().zip(pointers) {
            contiguous &= p == running;
            running += l as u64 * size;
        }

        let out = self.bin.as_mut().expect("builder not finished");
        let mut input = File::open(&bin_path).map_err(io_err(&bin_path))?;
        let copy_err = |e: std::io::Error| BuilderError::Io {
            path: bin_path.clone(),
            source: e,
        };
        if contiguous {
            let copied = std::io::copy(&mut (&mut input).take(total), out).map_err(&copy_err)?;
            if copied != total {
                return Err(copy_err(std::io::ErrorKind::UnexpectedEof.into()));
            }
        } else {
            for (&l, &p) in lengths.iter().zip(pointers) {
                let n = l as u64 * size;
                input.seek(SeekFrom::Start(p)).map_err(&copy_err)?;
                let copied = std::io::copy(&mut (&mut input).take(n), out).map_err(&copy_err)?;
                if copied != n {
                    return Err(copy_err(std::io::ErrorKind::UnexpectedEof.into()));
                }
            }
        }
        self.bin_bytes += total;

        let offset = self.sequence_lengths.len() as i64;
        // Lengths were validated by the reader as non-negative int32 values.
        self.sequence_lengths
            .extend(lengths.iter().map(|&l| l as i32));
        self.document_indices.extend(
            ds.document_indices()[1..]
                .iter()
                .map(|&d| offset + d as i64),
        );
        Ok(())
    }
}

/// Merges the datasets at `inputs` (prefixes, in this order) into `output_prefix`. All inputs
/// must share one dtype, which the output takes. Returns the merged counts.
///
/// Errors: no inputs, a dtype mismatch (naming the input's `.idx`), an input that cannot be
/// opened, I/O errors; on any error nothing is left under the output names.
pub fn merge_datasets<P: AsRef<Path>>(
    inputs: &[P],
    output_prefix: &Path,
) -> Result<BuildSummary, BuilderError> {
    let first = inputs
        .first()
        .ok_or_else(|| BuilderError::NoInputs(output_prefix.to_path_buf()))?;
    let dtype = IndexedDataset::open(first.as_ref())?.dtype();
    let mut builder = IndexedDatasetBuilder::create(output_prefix, dtype)?;
    for p in inputs {
        builder.add_index(p.as_ref())?;
    }
    builder.finalize()
}

/// The dataset prefixes in `dir`, sorted, as `merge_datasets.py --input DIR` finds them: every
/// `NAME.bin` / `NAME.idx` file gives prefix `DIR/NAME`, and each must have its partner.
/// Other files are ignored.
///
/// Errors: an unreadable directory, a `.bin` without its `.idx` or the reverse.
pub fn dataset_prefixes_in_dir(dir: &Path) -> Result<Vec<PathBuf>, BuilderError> {
    let mut prefixes = std::collections::BTreeSet::new();
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let path = entry.map_err(io_err(dir))?.path();
        let ext = path.extension().and_then(|e| e.to_str());
        if !matches!(ext, Some("bin" | "idx")) || !path.is_file() {
            continue;
        }
        let prefix = path.with_extension("");
        let (bin, idx) = data_paths(&prefix);
        let partner = if ext == Some("bin") { idx } else { bin };
        if !partner.is_file() {
            return Err(BuilderError::Io {
                path: partner,
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("partner of {} is missing", path.display()),
                ),
            });
        }
        prefixes.insert(prefix);
    }
    Ok(prefixes.into_iter().collect())
}
