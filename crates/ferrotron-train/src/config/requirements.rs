//! Checks of a configuration that is well-formed key by key: what a run needs across
//! sections (an end-of-document id for the EOD flags, validation data for
//! `training.skip_train`) and what this build cannot run yet (`not supported yet: <key>`).
//! They are part of [`RunConfig::from_raw`], so a library user gets them as the CLI does.

use super::sections::RawConfig;
use super::types::{LrDecayStyle, ModelSource};
use crate::trainer::ShardingStrategy;
use ferrotron_nn::CpCommType;

/// Every set key this build cannot honour yet, as `not supported yet: <key> (why)` problems.
pub(super) fn unsupported(r: &RawConfig, lr_decay_style: LrDecayStyle, p: &mut Vec<String>) {
    let mut no = |key: &str, why: &str| p.push(format!("not supported yet: {key} ({why})"));
    if r.data.num_workers != 1 {
        no("data.num_workers", "the loader uses one worker thread");
    }
    if lr_decay_style == LrDecayStyle::Wsd {
        no("optimizer.lr_decay_style = \"WSD\"", "no WSD schedule");
    }
    let par = &r.parallel;
    if par.overlap_grad_reduce && par.pipeline_model_parallel_size > 1 {
        no(
            "parallel.overlap_grad_reduce with pipeline_model_parallel_size > 1",
            "the pipeline schedule reduces after its last backward",
        );
    }
    if r.moe.moe_pad_expert_input_to_capacity
        && par.expert_tensor_parallel_size == Some(1)
        && par.tensor_model_parallel_size > 1
    {
        no(
            "moe.moe_pad_expert_input_to_capacity with parallel.expert_tensor_parallel_size = 1 \
             under tensor parallelism",
            "whole experts share the rows of a tensor-parallel group unpadded",
        );
    }
}

/// The problem when the EOD flags are set and no end-of-document id can be known.
pub(crate) const NO_EOD_ID: &str = "data.eod_mask_loss / reset_position_ids / reset_attention_mask need \
     an end-of-document id: give model.load an HF directory whose config.json has eos_token_id, \
     or set data.tokenizer_model";

/// The problem when `training.skip_train` has no validation to run.
pub(crate) const SKIP_TRAIN_WITHOUT_VALIDATION: &str = "training.skip_train needs validation data: \
     training.eval_iters > 0, training.eval_interval > 0 and a data.split with a validation part";

/// What the run needs across sections, as far as the configuration alone tells: a model
/// built from explicit dimensions has an end-of-document id only through
/// `data.tokenizer_model` (a loaded model's comes from its files, checked when it is
/// loaded); `training.skip_train` needs a validation split and `eval_iters > 0`.
pub(super) fn run_requirements(
    r: &RawConfig,
    model: &ModelSource,
    split: [f64; 3],
    p: &mut Vec<String>,
) {
    let d = &r.data;
    let eod_flags = d.eod_mask_loss || d.reset_position_ids || d.reset_attention_mask;
    if eod_flags && matches!(model, ModelSource::Explicit(_)) && d.tokenizer_model.is_none() {
        p.push(NO_EOD_ID.to_string());
    }
    let t = &r.training;
    if t.skip_train && (t.eval_iters == 0 || t.eval_interval == 0 || split[1] <= 0.0) {
        p.push(SKIP_TRAIN_WITHOUT_VALIDATION.to_string());
    }
}

/// `parallel.cp_comm_type` by Megatron's names, and what context parallelism needs across
/// sections: `model.seq_length` splitting into `2·cp` chunks.
pub(super) fn context_parallel(
    r: &RawConfig,
    seq_length: usize,
    p: &mut Vec<String>,
) -> CpCommType {
    let par = &r.parallel;
    let Some(comm_type) = CpCommType::from_name(&par.cp_comm_type) else {
        p.push(format!(
            "parallel.cp_comm_type: `{}` is not one of p2p, all_gather, a2a",
            par.cp_comm_type
        ));
        return CpCommType::P2p;
    };
    let cp = par.context_parallel_size;
    if cp <= 1 {
        return comm_type;
    }
    if !seq_length.is_multiple_of(2 * cp) {
        p.push(format!(
            "model.seq_length ({seq_length}) must divide by 2 x parallel.context_parallel_size \
             = {} (each rank holds two equal chunks)",
            2 * cp
        ));
    }
    comm_type
}

/// `parallel.data_parallel_sharding_strategy` by Megatron-FSDP's names (unset: what
/// `use_distributed_optimizer` says), and the options it cannot be combined with:
/// `overlap_param_gather` without a sharded optimizer, `use_distributed_optimizer = true`
/// with `no_shard`, `overlap_param_gather` with
/// `optim_grads_params` (which gathers per layer itself) and ZeRO-2/3 under expert
/// parallelism (not supported yet).
pub(super) fn sharding_strategy(r: &RawConfig, p: &mut Vec<String>) -> ShardingStrategy {
    let par = &r.parallel;
    let default = ShardingStrategy::from_distributed_optimizer(par.use_distributed_optimizer);
    let strategy = match &par.data_parallel_sharding_strategy {
        None => None,
        Some(name) => ShardingStrategy::parse(name).or_else(|| {
            let names: Vec<&str> = ShardingStrategy::ALL.iter().map(|s| s.name()).collect();
            p.push(format!(
                "parallel.data_parallel_sharding_strategy: `{name}` is not one of {}",
                names.join(", ")
            ));
            None
        }),
    };
    if par.overlap_param_gather && !strategy.unwrap_or(default).shards_optimizer() {
        p.push(
            "parallel.overlap_param_gather needs parallel.use_distributed_optimizer".to_string(),
        );
    }
    let Some(strategy) = strategy else {
        return default;
    };
    let key = format!("parallel.data_parallel_sharding_strategy = \"{strategy}\"");
    if par.use_distributed_optimizer && !strategy.shards_optimizer() {
        p.push(format!(
            "{key} contradicts parallel.use_distributed_optimizer = true (which shards the \
             optimizer state)"
        ));
    }
    if par.overlap_param_gather && strategy.shards_params() {
        p.push(format!(
            "{key} cannot be combined with parallel.overlap_param_gather (it gathers each \
             layer's weights just before use, prefetching the next)"
        ));
    }
    if strategy.shards_grads() && par.expert_model_parallel_size > 1 {
        p.push(format!(
            "not supported yet: {key} with parallel.expert_model_parallel_size > 1"
        ));
    }
    strategy
}
