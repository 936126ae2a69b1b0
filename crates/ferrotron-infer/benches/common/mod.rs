//! Shared by the benches: which weights a model path is benched with, and loading them.

use ferrotron_checkpoint::gguf::load_gguf_model;
use ferrotron_model::GptModel;
use ferrotron_model::families::load_hf_model;
use ferrotron_tensor::DType;
use std::path::Path;

fn is_gguf(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "gguf")
}

/// `(label, dtype)` of each run: an HF directory in f32 and bf16, a GGUF file once (its
/// quantized weights in their blocks, the rest f32), labelled `gguf`.
pub fn variants(path: &Path) -> Vec<(String, DType)> {
    match is_gguf(path) {
        true => vec![("gguf".into(), DType::F32)],
        false => [DType::F32, DType::BF16]
            .map(|d| (d.to_string(), d))
            .to_vec(),
    }
}

/// The model at `path` (HF directory or GGUF file), unquantized weights stored as `dtype`.
pub fn load(path: &Path, dtype: DType) -> GptModel {
    match is_gguf(path) {
        true => load_gguf_model(path, dtype).expect("load GGUF").model,
        false => load_hf_model(path, dtype).expect("load model").0,
    }
}
