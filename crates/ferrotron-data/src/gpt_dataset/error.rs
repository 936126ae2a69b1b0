use crate::indexed::IndexedDatasetError;
use std::path::PathBuf;

/// Errors building or reading GPT / blended datasets and running the data loader. Every variant
/// names the field, file or index it is about; none of them is a panic in disguise.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// A configuration value is unusable (`field` names it as in the config or CLI).
    #[error("invalid {field}: {detail}")]
    Config { field: &'static str, detail: String },
    /// The underlying `.bin/.idx` dataset could not be opened or read.
    #[error(transparent)]
    Indexed(#[from] IndexedDatasetError),
    /// Reading or writing a cache file failed (other than a stale/corrupt cache, which is rebuilt).
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// An index could not be built for these inputs (e.g. the documents ran out before the
    /// requested samples: a broken invariant of the inputs, reported instead of a panic).
    #[error("{what}: {detail}")]
    Index { what: &'static str, detail: String },
    /// `get(index)` past the end.
    #[error("sample {index} is out of range: the dataset has {len} samples")]
    OutOfRange { index: usize, len: usize },
    /// The loader's worker thread failed outside a dataset read (it panicked).
    #[error("data loader worker: {0}")]
    Loader(String),
}

impl DatasetError {
    pub(crate) fn config(field: &'static str, detail: impl Into<String>) -> DatasetError {
        DatasetError::Config {
            field,
            detail: detail.into(),
        }
    }

    pub(crate) fn index(what: &'static str, detail: impl Into<String>) -> DatasetError {
        DatasetError::Index {
            what,
            detail: detail.into(),
        }
    }
}
