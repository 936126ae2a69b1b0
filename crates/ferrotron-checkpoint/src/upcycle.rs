//! `upcycle_hf`: an HF dense model directory -> the MoE model upcycled from it
//! ([`GptModel::upcycle`], Megatron's `--moe-use-upcycling` done offline, as
//! Pai-Megatron-Patch's `hf2mcore_qwen1.5_dense_mha_to_moe.py`), written as an HF directory
//! (a LLaMA or Mistral model becomes a Mixtral) with the tokenizer and generation config.

use std::path::{Path, PathBuf};

use ferrotron_model::families::{HfConfigInputs, load_hf_model};
use ferrotron_model::{GptModel, UpcycleOptions};
use ferrotron_tensor::DType;

use crate::hf_export::{HfExportOptions, HfExportSource, export_hf, input_dtype, model_err};
use crate::{CheckpointError, OutputDtype};

/// What [`upcycle_hf`] wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct UpcycleReport {
    /// The output directory.
    pub output: PathBuf,
    /// Parameters of the dense and of the MoE model.
    pub parameters: (usize, usize),
    /// The HF architecture written (`MixtralForCausalLM`).
    pub architecture: String,
}

/// Upcycles the dense HF model in `hf` with `options` and writes it to `output` in `dtype`
/// (`None`: the input's `torch_dtype`); `force` replaces a non-empty `output`. Token ids
/// (`bos`, `eos`, `pad`), `generation_config.json` and the tokenizer files are kept; the rest
/// of `config.json` is the MoE family's.
///
/// # Errors
/// An unreadable or unsupported input (naming the file and field), options the upcycling
/// rejects ([`GptModel::upcycle`]), or a failed write (nothing is left at `output` then).
pub fn upcycle_hf(
    hf: &Path,
    output: &Path,
    options: &UpcycleOptions,
    dtype: Option<OutputDtype>,
    force: bool,
) -> Result<UpcycleReport, CheckpointError> {
    let source = HfExportSource::from_dir(hf)?;
    let dtype = dtype.unwrap_or_else(|| input_dtype(source.config.original.as_ref()));
    let (dense, _) = load_hf_model(hf, DType::F32).map_err(|e| model_err(&e))?;
    let moe = dense.upcycle(options).map_err(|e| model_err(&e))?;
    // The original config.json is the dense family's: keep its token ids only.
    let source = HfExportSource {
        config: HfConfigInputs {
            original: None,
            ..source.config
        },
        generation_config: source.generation_config,
    };
    let opts = HfExportOptions {
        dtype,
        force,
        tokenizer_dir: has_tokenizer(hf).then(|| hf.to_path_buf()),
        ..HfExportOptions::default()
    };
    export_hf(&moe, &source, output, &opts)?;
    Ok(UpcycleReport {
        output: output.to_path_buf(),
        parameters: (count(&dense), count(&moe)),
        architecture: moe.config().family.hf_architecture().to_string(),
    })
}

fn count(model: &GptModel) -> usize {
    model.config().num_parameters()
}

fn has_tokenizer(dir: &Path) -> bool {
    !crate::tokenizer_files(dir).is_empty()
}
