//! Loads an HF model directory into a `GptModel` and writes it back with `export_hf` (config,
//! generation config and tokenizer files, if any, taken from the source directory; an existing
//! OUT is replaced), for checking the export with transformers (`tools/check_hf_export.py`):
//!
//! ```sh
//! cargo run --release -p ferrotron-checkpoint --example export_hf -- SRC OUT [f32|bf16|f16] [MAX_SHARD_BYTES]
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use ferrotron_checkpoint::{
    HfExportOptions, HfExportSource, OutputDtype, TOKENIZER_FILES, export_hf,
};
use ferrotron_model::families::load_hf_model;
use ferrotron_tensor::DType;

fn run(args: &[String]) -> Result<(), String> {
    let [src, out, rest @ ..] = args else {
        return Err("usage: export_hf SRC OUT [f32|bf16|f16] [MAX_SHARD_BYTES]".into());
    };
    let dtype = match rest.first().map(String::as_str) {
        None | Some("f32") => OutputDtype::F32,
        Some("bf16") => OutputDtype::BF16,
        Some("f16") => OutputDtype::F16,
        Some(other) => return Err(format!("dtype `{other}`: expected f32, bf16 or f16")),
    };
    let src = PathBuf::from(src);
    let has_tokenizer = TOKENIZER_FILES.iter().any(|f| src.join(f).is_file());
    let mut opts = HfExportOptions {
        dtype,
        force: true,
        tokenizer_dir: has_tokenizer.then(|| src.clone()),
        ..Default::default()
    };
    if let Some(s) = rest.get(1) {
        opts.max_shard_size = s
            .parse()
            .map_err(|e| format!("MAX_SHARD_BYTES `{s}`: {e}"))?;
    }
    let (model, _) = load_hf_model(&src, DType::F32).map_err(|e| e.to_string())?;
    let source = HfExportSource::from_dir(&src).map_err(|e| e.to_string())?;
    let report =
        export_hf(&model, &source, &PathBuf::from(out), &opts).map_err(|e| e.to_string())?;
    println!(
        "wrote {} ({} tensors, {} shard(s), {} bytes): {}",
        report.output.display(),
        report.tensors_written,
        report.shards,
        report.bytes_written,
        report.files.join(", ")
    );
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("export_hf: {e}");
            ExitCode::FAILURE
        }
    }
}
