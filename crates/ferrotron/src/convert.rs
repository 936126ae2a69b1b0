use anyhow::{Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use ferrotron_checkpoint::{GgufToHfOptions, OutputDtype, gguf_to_hf};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

#[derive(Subcommand)]
pub enum ConvertCommand {
    /// GGUF (llama.cpp) -> HuggingFace directory: config.json, model.safetensors,
    /// tokenizer.json, tokenizer_config.json. Dequantizes F32/F16/BF16/Q8_0/Q4_0/Q4_1 and undoes
    /// llama.cpp's q/k row permutation.
    GgufToHf(GgufToHfArgs),
}

#[derive(Args)]
pub struct GgufToHfArgs {
    /// The .gguf file to read.
    #[arg(long)]
    input: PathBuf,
    /// The directory to create (written to a temporary name, renamed when complete).
    #[arg(long)]
    output: PathBuf,
    /// Element type of model.safetensors.
    #[arg(long, value_enum, default_value_t = DtypeArg::F32)]
    dtype: DtypeArg,
    /// Replace an existing non-empty output directory.
    #[arg(long)]
    force: bool,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum DtypeArg {
    F32,
    Bf16,
    F16,
}

pub fn run(cmd: ConvertCommand) -> Result<ExitCode> {
    match cmd {
        ConvertCommand::GgufToHf(a) => {
            let opts = GgufToHfOptions {
                dtype: match a.dtype {
                    DtypeArg::F32 => OutputDtype::F32,
                    DtypeArg::Bf16 => OutputDtype::BF16,
                    DtypeArg::F16 => OutputDtype::F16,
                },
                force: a.force,
                ..Default::default()
            };
            let spinner = ProgressBar::new_spinner().with_style(
                ProgressStyle::with_template("{spinner} {msg} [{elapsed}]")
                    .expect("valid template"),
            );
            spinner.set_message(format!("converting {}", a.input.display()));
            spinner.enable_steady_tick(Duration::from_millis(120));
            let start = Instant::now();
            let result = gguf_to_hf(&a.input, &a.output, &opts);
            spinner.finish_and_clear();
            let report =
                result.with_context(|| format!("convert gguf-to-hf {}", a.input.display()))?;
            let secs = start.elapsed().as_secs_f64();
            println!(
                "wrote {} ({} tensors, {:.1} MB in {:.1} s; source types {:?}; files {})",
                report.output.display(),
                report.tensors_written,
                report.bytes_written as f64 / 1e6,
                secs,
                report.source_type_counts,
                report.files.join(", ")
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}
