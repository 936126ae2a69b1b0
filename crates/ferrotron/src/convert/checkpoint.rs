//! `convert hf-to-ckpt`, `ckpt-to-hf` and `ckpt-to-ckpt`: arguments, `--dry-run` listings and
//! the `--check` forward comparison around `ferrotron_checkpoint::convert`.

use anyhow::{Context, Result};
use clap::Args;
use ferrotron_checkpoint::convert::{
    CheckpointWeights, ConvertReport, HfToCkptOptions, HfToCkptPlan, MODEL_PREFIX,
    ckpt_to_hf as convert_ckpt_to_hf, hf_to_ckpt as convert_hf_to_ckpt, plan_hf_to_ckpt,
    plan_reshard, reshard_ckpt,
};
use ferrotron_checkpoint::dist::{StoredDtype, locate_checkpoint};
use ferrotron_checkpoint::{CheckpointError, HfExportOptions};
use ferrotron_model::module::ExpertTensorParallel;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use super::check::{DEFAULT_PROMPT, check_forward};
use super::{DtypeArg, spinner};

/// Exit code of a `--check` whose differences exceed `--tolerance`.
const CHECK_FAILED: u8 = 4;

#[derive(Args)]
pub struct HfToCkptArgs {
    /// The HuggingFace model directory (config.json, safetensors, tokenizer files).
    #[arg(long)]
    hf: PathBuf,
    #[command(flatten)]
    layout: LayoutArgs,
    #[command(flatten)]
    check: CheckArgs,
}

#[derive(Args)]
pub struct CkptToCkptArgs {
    /// The checkpoint to reshard: an iteration directory, or a save directory whose
    /// latest_checkpointed_iteration.txt names one.
    #[arg(long)]
    ckpt: PathBuf,
    #[command(flatten)]
    layout: LayoutArgs,
}

/// The checkpoint to write and its layout (hf-to-ckpt, ckpt-to-ckpt).
#[derive(Args)]
pub struct LayoutArgs {
    /// The checkpoint directory to create (written to a temporary name, renamed when
    /// complete).
    #[arg(long)]
    output: PathBuf,
    /// Tensor-parallel ranks the checkpoint is laid out for (heads, query groups and the FFN
    /// size must divide by it).
    #[arg(long, default_value_t = 1)]
    tensor_model_parallel_size: usize,
    /// Pipeline stages the checkpoint is laid out for (the layers must split over them).
    #[arg(long, default_value_t = 1)]
    pipeline_model_parallel_size: usize,
    /// Layers of the first pipeline stage (the rest split evenly); default: all even.
    #[arg(long)]
    decoder_first_pipeline_num_layers: Option<usize>,
    /// Expert-parallel ranks the routed experts are laid out for (MoE models; the experts
    /// must split evenly): rank e's in model_tp{t}_pp{p}_ep{e}.safetensors.
    #[arg(long, default_value_t = 1)]
    expert_model_parallel_size: usize,
    /// Tensor-parallel ranks splitting each expert's width: the tensor-parallel size (the
    /// default) or 1 (every expert whole on tensor-parallel rank 0's files).
    #[arg(long)]
    expert_tensor_parallel_size: Option<usize>,
    /// Pad the vocabulary (on load) to a multiple of this times the tensor-parallel size,
    /// recorded in the metadata (Megatron's default 128).
    #[arg(long, default_value_t = 128)]
    make_vocab_size_divisible_by: usize,
    /// Element type of the stored weights (f32 keeps any source exactly).
    #[arg(long, value_enum, default_value_t = DtypeArg::F32)]
    dtype: DtypeArg,
    /// Replace an existing non-empty output directory.
    #[arg(long)]
    force: bool,
    /// List every Megatron tensor with its sources and shard boxes, and every problem with
    /// the source; write nothing (exit 1 when there are problems).
    #[arg(long)]
    dry_run: bool,
}

impl LayoutArgs {
    /// The converter's options.
    ///
    /// # Errors
    /// An expert tensor-parallel size other than 1 or the tensor-parallel size.
    fn options(&self) -> Result<HfToCkptOptions> {
        let t = self.tensor_model_parallel_size;
        let expert_tensor_parallel = match self.expert_tensor_parallel_size {
            Some(1) if t > 1 => ExpertTensorParallel::Whole,
            Some(e) if e != 1 && e != t => anyhow::bail!(
                "--expert-tensor-parallel-size {e}: must be 1 or --tensor-model-parallel-size ({t})"
            ),
            _ => ExpertTensorParallel::Split,
        };
        Ok(HfToCkptOptions {
            tensor_model_parallel_size: t,
            pipeline_model_parallel_size: self.pipeline_model_parallel_size,
            decoder_first_pipeline_num_layers: self.decoder_first_pipeline_num_layers,
            make_vocab_size_divisible_by: self.make_vocab_size_divisible_by,
            dtype: stored_dtype(self.dtype),
            force: self.force,
            expert_model_parallel_size: self.expert_model_parallel_size,
            expert_tensor_parallel,
        })
    }
}

#[derive(Args)]
pub struct CkptToHfArgs {
    /// The checkpoint: an iteration directory, or a save directory whose
    /// latest_checkpointed_iteration.txt names one.
    #[arg(long)]
    ckpt: PathBuf,
    /// The HF directory to create (written to a temporary name, renamed when complete).
    #[arg(long)]
    output: PathBuf,
    /// Element type of the safetensors files (and torch_dtype in config.json).
    #[arg(long, value_enum, default_value_t = DtypeArg::F32)]
    dtype: DtypeArg,
    /// Largest safetensors file (tensor bytes), e.g. 2GB, 500MB, 1GiB; above it the weights
    /// are split into model-0000i-of-0000n.safetensors with an index (transformers' rule).
    #[arg(long, default_value = "50GB", value_parser = parse_size)]
    max_shard_size: u64,
    /// Copy the tokenizer files from this directory (default: the checkpoint's tokenizer/).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Replace an existing non-empty output directory.
    #[arg(long)]
    force: bool,
    /// List every HF tensor with the checkpoint rows it comes from; write nothing.
    #[arg(long)]
    dry_run: bool,
    #[command(flatten)]
    check: CheckArgs,
}

#[derive(Args)]
pub struct CheckArgs {
    /// After converting, run a prompt through the HF model (one rank) and the checkpoint's
    /// model at its layout (its ranks in-process); print per layer the max |diff| of the
    /// hidden states and the count above 1e-5, and the logits' (exit 4 above --tolerance or
    /// when an argmax differs).
    #[arg(long)]
    check: bool,
    /// Largest max |diff| / max |reference| of any layer's hidden state or of the logits
    /// that --check accepts (relative: hidden states carry outliers of 1e4 and more).
    #[arg(long, default_value_t = 1e-4)]
    tolerance: f32,
    /// The prompt of --check (tokenized with the HF directory's tokenizer).
    #[arg(long, default_value = DEFAULT_PROMPT)]
    prompt: String,
}

/// `"2GB"` -> 2e9 bytes: decimal KB/MB/GB/TB, binary KiB/MiB/GiB/TiB, or plain bytes.
fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size like 2GB or 500MB"))?;
    let mult: f64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1.0,
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        "KIB" => 1024.0,
        "MIB" => 1024.0 * 1024.0,
        "GIB" => 1024.0 * 1024.0 * 1024.0,
        "TIB" => 1024f64.powi(4),
        other => {
            return Err(format!(
                "unknown size unit `{other}` in `{s}` (use B, KB, MB, GB, KiB, MiB, GiB)"
            ));
        }
    };
    let bytes = (n * mult).round();
    if bytes < 1.0 {
        return Err(format!("`{s}` must be at least 1 byte"));
    }
    Ok(bytes as u64)
}

fn stored_dtype(d: DtypeArg) -> StoredDtype {
    match d {
        DtypeArg::F32 => StoredDtype::F32,
        DtypeArg::Bf16 => StoredDtype::BF16,
        DtypeArg::F16 => StoredDtype::F16,
    }
}

/// Runs `--check` when asked: exit 4 when it fails.
fn maybe_check(check: &CheckArgs, hf: &Path, ckpt: &Path) -> Result<ExitCode> {
    if !check.check {
        return Ok(ExitCode::SUCCESS);
    }
    let dir = locate_checkpoint(ckpt)?.context("--check: no checkpoint written")?;
    if check_forward(hf, &dir, &check.prompt, check.tolerance)? {
        Ok(ExitCode::SUCCESS)
    } else {
        Ok(ExitCode::from(CHECK_FAILED))
    }
}

pub fn hf_to_ckpt(a: HfToCkptArgs) -> Result<ExitCode> {
    let done = write_checkpoint(
        "hf-to-ckpt",
        &a.hf,
        &a.layout,
        plan_hf_to_ckpt,
        convert_hf_to_ckpt,
    )?;
    match done {
        Some(code) => Ok(code),
        None => maybe_check(&a.check, &a.hf, &a.layout.output),
    }
}

pub fn ckpt_to_ckpt(a: CkptToCkptArgs) -> Result<ExitCode> {
    let done = write_checkpoint(
        "ckpt-to-ckpt",
        &a.ckpt,
        &a.layout,
        plan_reshard,
        reshard_ckpt,
    )?;
    Ok(done.unwrap_or(ExitCode::SUCCESS))
}

type PlanFn = fn(&Path, &HfToCkptOptions) -> Result<HfToCkptPlan, CheckpointError>;
type WriteFn = fn(&Path, &Path, &HfToCkptOptions) -> Result<ConvertReport, CheckpointError>;

/// `convert <what>`: the `--dry-run` listing of `plan` (returns its exit code), or `write`
/// from `source` into the layout's output with a spinner and a report (returns `None`).
fn write_checkpoint(
    what: &str,
    source: &Path,
    layout: &LayoutArgs,
    plan: PlanFn,
    write: WriteFn,
) -> Result<Option<ExitCode>> {
    let opts = layout.options()?;
    let context = || format!("convert {what}");
    if layout.dry_run {
        let plan = plan(source, &opts).with_context(context)?;
        return Ok(Some(print_plan(&plan)));
    }
    let bar = spinner(format!(
        "writing {} for tp {} x pp {} x ep {}",
        source.display(),
        opts.tensor_model_parallel_size,
        opts.pipeline_model_parallel_size,
        opts.expert_model_parallel_size
    ));
    let result = write(source, &layout.output, &opts);
    bar.finish_and_clear();
    print_report(&result.with_context(context)?);
    Ok(None)
}

/// The `--dry-run` listing of a plan; exit 1 when it has problems.
fn print_plan(plan: &HfToCkptPlan) -> ExitCode {
    for p in &plan.params {
        let m = &p.mapping;
        let sources: Vec<String> =
            m.hf.iter()
                .map(|h| format!("{} {:?}", h.name, h.shape))
                .collect();
        println!(
            "{MODEL_PREFIX}{} {:?} {:?} stage {} <- {}",
            m.name,
            m.shape,
            m.split,
            p.stage,
            sources.join(" + ")
        );
        for s in &p.shards {
            println!("    {} at {:?} {:?}", s.file, s.global_offset, s.shape);
        }
    }
    for n in &plan.ignored {
        println!("ignored (not a parameter): {n}");
    }
    let problems = plan.problems();
    for problem in &problems {
        println!("problem: {problem}");
    }
    println!(
        "dry run: {} tensors into {} files ({}); {} problems; nothing written",
        plan.params.len(),
        plan.files.len(),
        plan.files.join(", "),
        problems.len()
    );
    if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn print_report(report: &ConvertReport) {
    println!(
        "wrote {} ({} tensors in {} files, {:.1} MB in {:.2} s, {:.0} MB/s)",
        report.output.display(),
        report.tensors,
        report.files.len(),
        report.bytes_written as f64 / 1e6,
        report.seconds,
        report.bytes_written as f64 / 1e6 / report.seconds.max(1e-9)
    );
}

pub fn ckpt_to_hf(a: CkptToHfArgs) -> Result<ExitCode> {
    let context = || "convert ckpt-to-hf".to_string();
    if a.dry_run {
        dry_run_ckpt_to_hf(&a.ckpt).with_context(context)?;
        return Ok(ExitCode::SUCCESS);
    }
    let opts = HfExportOptions {
        dtype: a.dtype.output(),
        max_shard_size: a.max_shard_size,
        force: a.force,
        tokenizer_dir: a.tokenizer.clone(),
    };
    let bar = spinner(format!("converting {}", a.ckpt.display()));
    let start = std::time::Instant::now();
    let result = convert_ckpt_to_hf(&a.ckpt, &a.output, &opts);
    bar.finish_and_clear();
    let report = result.with_context(context)?;
    let secs = start.elapsed().as_secs_f64();
    println!(
        "wrote {} ({} tensors, {} safetensors files, {:.1} MB in {:.2} s, {:.0} MB/s; files {})",
        report.output.display(),
        report.tensors_written,
        report.shards,
        report.bytes_written as f64 / 1e6,
        secs,
        report.bytes_written as f64 / 1e6 / secs.max(1e-9),
        report.files.join(", ")
    );
    maybe_check(&a.check, &a.output, &a.ckpt)
}

/// Lists every HF tensor of the checkpoint's model with the rows of the checkpoint tensor it
/// comes from and the shards holding that tensor.
fn dry_run_ckpt_to_hf(ckpt: &Path) -> Result<()> {
    let weights = CheckpointWeights::open(ckpt, ferrotron_tensor::DType::F32)?;
    let meta = weights.metadata();
    let tensors = weights.hf_tensors();
    for (name, shape) in &tensors {
        let (key, rows) = weights.source(name).context("listed by hf_tensors")?;
        let rows: Vec<String> = rows.iter().map(|r| format!("{r:?}")).collect();
        println!(
            "{name} {shape:?} <- {key} rows {} ({} shards)",
            rows.join(","),
            meta.tensors[key].shards.len()
        );
    }
    println!(
        "dry run: {} HF tensors from {} (saved at tp {} x pp {} x dp {}, iteration {}); nothing written",
        tensors.len(),
        weights.dir().display(),
        meta.parallel.tensor_model_parallel_size,
        meta.parallel.pipeline_model_parallel_size,
        meta.parallel.data_parallel_size,
        meta.iteration
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_parse_like_transformers() {
        assert_eq!(parse_size("2GB"), Ok(2_000_000_000));
        assert_eq!(parse_size("500MB"), Ok(500_000_000));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("1.5 kb"), Ok(1500));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("2XB").unwrap_err().contains("unknown size unit"));
        assert!(parse_size("GB").is_err());
        assert!(parse_size("0").is_err());
    }
}
