//! Converts a LLaMA-family GGUF file to an HF model directory.
//!
//! Usage: `cargo run --release -p ferrotron-checkpoint --example gguf_to_hf -- IN.gguf OUT_DIR
//! [f32|bf16|f16] [--force]`

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use ferrotron_checkpoint::{GgufToHfOptions, OutputDtype, gguf_to_hf};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let force = args.iter().any(|a| a == "--force");
    let pos: Vec<&String> = args.iter().filter(|a| !a.starts_with("--")).collect();
    if pos.len() < 2 {
        eprintln!("usage: gguf_to_hf IN.gguf OUT_DIR [f32|bf16|f16] [--force]");
        return ExitCode::from(2);
    }
    let dtype = match pos.get(2).map(|s| s.as_str()) {
        None | Some("f32") => OutputDtype::F32,
        Some("bf16") => OutputDtype::BF16,
        Some("f16") => OutputDtype::F16,
        Some(other) => {
            eprintln!("unknown dtype {other} (expected f32, bf16 or f16)");
            return ExitCode::from(2);
        }
    };
    let opts = GgufToHfOptions {
        dtype,
        force,
        ..Default::default()
    };
    let t = Instant::now();
    match gguf_to_hf(&PathBuf::from(pos[0]), &PathBuf::from(pos[1]), &opts) {
        Ok(r) => {
            println!(
                "wrote {} tensors ({} bytes in total) to {} in {:.2}s; source types {:?}; {:?} added tokens",
                r.tensors_written,
                r.bytes_written,
                r.output.display(),
                t.elapsed().as_secs_f64(),
                r.source_type_counts,
                r.added_tokens
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
