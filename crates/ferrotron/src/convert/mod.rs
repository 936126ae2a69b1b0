//! `ferrotron convert`: GGUF -> HF, HF <-> distributed checkpoint (any tp x pp), with dry
//! runs and forward checks; vocabulary expansion of an HF model.

mod check;
mod checkpoint;
mod upcycle;
mod vocab;

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
    /// HuggingFace directory -> Ferrotron distributed checkpoint laid out for tensor x pipeline
    /// (x expert) parallel ranks (Pai-Megatron-Patch hf2mcore): q/k/v packed per query group
    /// into linear_qkv, gate/up into linear_fc1, each rank's boxes in
    /// model_tp{t}_pp{p}.safetensors (expert-parallel rank e's experts in ..._ep{e}).
    /// Writes CKPT/iter_0000000 + latest_checkpointed_iteration.txt; train from it with
    /// checkpoint.load = CKPT (or model.load = CKPT).
    HfToCkpt(checkpoint::HfToCkptArgs),
    /// Ferrotron checkpoint (converted or saved by `train`, any layout) -> HuggingFace directory
    /// that transformers loads (Pai-Megatron-Patch mcore2hf).
    CkptToHf(checkpoint::CkptToHfArgs),
    /// Ferrotron checkpoint (any layout) -> its weights as a checkpoint laid out for another
    /// tensor x pipeline-parallel size (resharding; training also reshards on load, optimizer
    /// state included, so this is for handing weights on).
    CkptToCkpt(checkpoint::CkptToCkptArgs),
    /// HuggingFace directory -> the same model with tokens added to its vocabulary
    /// (Pai-Megatron-Patch's vocabulary expansion): tokenizer.json gains them as HF's
    /// `add_tokens` adds them, each new embedding (and untied output) row is the mean of the
    /// rows of the pieces the old tokenizer split the token into, config.json's vocab_size
    /// grows (padded with --pad-to-multiple-of). Logits over the old vocabulary are unchanged.
    ExpandVocab(vocab::ExpandVocabArgs),
    /// Dense HuggingFace model -> the mixture-of-experts model upcycled from it (Megatron's
    /// --moe-use-upcycling, offline): a LLaMA or Mistral model becomes a Mixtral whose
    /// experts copy its MLPs (or, with --moe-upcycling-granularity G, slices of them, scaled)
    /// and whose routers are drawn N(0, --init-method-std). With whole copies its logits
    /// equal the dense model's.
    Upcycle(upcycle::UpcycleArgs),
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

impl DtypeArg {
    fn output(self) -> OutputDtype {
        match self {
            DtypeArg::F32 => OutputDtype::F32,
            DtypeArg::Bf16 => OutputDtype::BF16,
            DtypeArg::F16 => OutputDtype::F16,
        }
    }
}

/// A spinner showing `message` and the elapsed time until dropped.
pub(crate) fn spinner(message: String) -> ProgressBar {
    let bar = ProgressBar::new_spinner().with_style(
        ProgressStyle::with_template("{spinner} {msg} [{elapsed}]").expect("valid template"),
    );
    bar.set_message(message);
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

pub fn run(cmd: ConvertCommand) -> Result<ExitCode> {
    match cmd {
        ConvertCommand::GgufToHf(a) => {
            let opts = GgufToHfOptions {
                dtype: a.dtype.output(),
                force: a.force,
                ..Default::default()
            };
            let bar = spinner(format!("converting {}", a.input.display()));
            let start = Instant::now();
            let result = gguf_to_hf(&a.input, &a.output, &opts);
            bar.finish_and_clear();
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
        ConvertCommand::HfToCkpt(a) => checkpoint::hf_to_ckpt(a),
        ConvertCommand::CkptToHf(a) => checkpoint::ckpt_to_hf(a),
        ConvertCommand::CkptToCkpt(a) => checkpoint::ckpt_to_ckpt(a),
        ConvertCommand::ExpandVocab(a) => vocab::expand(a),
        ConvertCommand::Upcycle(a) => upcycle::upcycle(a),
    }
}
