use std::path::PathBuf;

/// Errors from reading model configs, mapping weights and running the model. Messages name the
/// file, field or tensor and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A config file could not be read or parsed.
    #[error("{path}: {message}")]
    ConfigFile { path: PathBuf, message: String },
    /// A config field is missing, has the wrong type, or has a value we do not support.
    #[error("config field `{field}`: {message}")]
    ConfigField { field: String, message: String },
    /// A weight the model needs is absent from the checkpoint.
    #[error("missing weight tensor `{0}`")]
    MissingWeight(String),
    /// Checkpoint tensors that no model parameter uses.
    #[error("unused weight tensors in checkpoint (unexpected for this architecture): {0:?}")]
    UnusedWeights(Vec<String>),
    /// Running the model with inputs it cannot take (e.g. a sequence past the KV-cache capacity).
    #[error("{0}")]
    Input(String),
    /// A collective between model shards failed (often: another rank failed first).
    #[error("model-parallel communication: {0}")]
    Comm(String),
    /// A layer-level error (parameter shapes, token ids).
    #[error(transparent)]
    Nn(#[from] ferrotron_nn::NnError),
    /// A tensor-level error.
    #[error(transparent)]
    Tensor(#[from] ferrotron_tensor::TensorError),
}
