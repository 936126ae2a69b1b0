//! `ferrotron convert upcycle`: a dense HF model -> the MoE model upcycled from it
//! (Megatron's `--moe-use-upcycling`, offline).

use super::DtypeArg;
use anyhow::{Context, Result};
use clap::Args;
use ferrotron_checkpoint::upcycle_hf;
use ferrotron_model::{InitConfig, UpcycleOptions};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
pub struct UpcycleArgs {
    /// The dense HF model directory (LLaMA or Mistral family: config.json, safetensors,
    /// tokenizer files).
    #[arg(long)]
    hf: PathBuf,
    /// The directory to create: a Mixtral HF model (written to a temporary name, renamed when
    /// complete).
    #[arg(long)]
    output: PathBuf,
    /// Routed experts per layer (Megatron's --num-experts).
    #[arg(long, default_value_t = 8)]
    num_experts: usize,
    /// Experts per token (--moe-router-topk).
    #[arg(long, default_value_t = 2)]
    moe_router_topk: usize,
    /// Each expert is 1/G of the dense MLP's width; the experts are num_experts/G copies of
    /// the G slices, weights scaled to keep the output (--moe-upcycling-granularity).
    #[arg(long, default_value_t = 1)]
    moe_upcycling_granularity: usize,
    /// Load-balancing loss coefficient written as router_aux_loss_coef, with
    /// output_router_logits on (--moe-aux-loss-coeff; Megatron's Mixtral recipe: 0.01).
    #[arg(long, default_value_t = 0.01)]
    moe_aux_loss_coeff: f32,
    /// Seed of the router's random init (--seed).
    #[arg(long, default_value_t = 1234)]
    seed: u64,
    /// Std of the router's normal init (--init-method-std).
    #[arg(long, default_value_t = 0.02)]
    init_method_std: f32,
    /// Element type of the output weights [default: the input's torch_dtype].
    #[arg(long, value_enum)]
    dtype: Option<DtypeArg>,
    /// Replace an existing non-empty output directory.
    #[arg(long)]
    force: bool,
}

pub fn upcycle(a: UpcycleArgs) -> Result<ExitCode> {
    let options = UpcycleOptions {
        num_experts: a.num_experts,
        topk: a.moe_router_topk,
        granularity: a.moe_upcycling_granularity,
        pre_softmax: false,
        aux_loss_coeff: a.moe_aux_loss_coeff,
        init: InitConfig {
            seed: a.seed,
            init_method_std: a.init_method_std,
            ..InitConfig::default()
        },
    };
    let bar = super::spinner(format!("upcycling {}", a.hf.display()));
    let result = upcycle_hf(
        &a.hf,
        &a.output,
        &options,
        a.dtype.map(DtypeArg::output),
        a.force,
    );
    bar.finish_and_clear();
    let report = result.with_context(|| format!("convert upcycle {}", a.hf.display()))?;
    let (dense, moe) = report.parameters;
    println!(
        "wrote {}: {} with {} experts (top-{}, granularity {}), {dense} -> {moe} parameters",
        report.output.display(),
        report.architecture,
        a.num_experts,
        a.moe_router_topk,
        a.moe_upcycling_granularity
    );
    Ok(ExitCode::SUCCESS)
}
