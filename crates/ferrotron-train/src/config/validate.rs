//! Validation of a [`RawConfig`] into a [`RunConfig`]: every problem is collected, each naming
//! its key; derived values (gradient accumulation, iterations from tokens, warmup in
//! iterations) are computed the way Megatron does. [`RunConfig::from_raw`] runs the checks
//! section by section (this file: `[model]`, `[data]`, `[parallel]`; `training.rs`: the
//! rest), then the checks across sections (`requirements.rs`).

use super::ConfigError;
use super::requirements;
use super::sections::{DataSection, ModelSection, ParallelSection, RawConfig};
use super::training::{
    adam_ranges, batch_sizes, checkpoint, dpo, finetune, intervals, lora, lr_schedule, precision,
    recompute, reward, train_iters,
};
use super::types::*;
use super::values::{blend_tokens, check_exists, parse_blend, parse_split, positive};
use ferrotron_model::ModelFamily;
use std::path::Path;

impl RunConfig {
    /// Validates `raw`, collecting every problem into one [`ConfigError`] (in the order of
    /// the sections), and fills in the derived defaults of [`RunConfig::resolved`].
    ///
    /// # Errors
    /// [`ConfigError`] with one line per problem, each naming its key.
    pub fn from_raw(raw: RawConfig) -> Result<RunConfig, ConfigError> {
        let mut p = Vec::new();
        let mut r = raw;
        let (seq_length, model) = model_source(&mut r.model, &mut p);
        model_numbers(&r.model, &mut p);
        let data = data_section(&r.data, &mut p);
        let dp_size = validate_parallel(&r.parallel, &mut p);
        if r.model.make_vocab_size_divisible_by == 0 {
            p.push("model.make_vocab_size_divisible_by must be at least 1".to_string());
        }
        let (mbs, gbs) = batch_sizes(&mut r.training, &r.parallel, dp_size, &mut p);
        let tokens_per_iter = (gbs.max(1) * seq_length) as u64;
        let train_iters = train_iters(&r.training, tokens_per_iter, &mut p);
        intervals(&r.training, &mut p);
        let recompute = recompute(&mut r.training, &model, &mut p);
        finetune(&r, &mut p);
        let schedule = lr_schedule(&mut r.optimizer, gbs, tokens_per_iter, train_iters, &mut p);
        adam_ranges(&r.optimizer, &mut p);
        let precision = precision(&r.precision, &mut p);
        let lora = lora(&r, &mut p);
        let dpo = dpo(&r, data.dataset_type, lora.is_some(), &mut p);
        let reward = reward(&r, data.dataset_type, &mut p);
        let dims = match &model {
            ModelSource::Explicit(d) => Some((d.num_layers, d.ffn_hidden_size)),
            ModelSource::Load(_) => None,
        };
        let moe = super::moe::moe_settings(&r.moe, dims.is_none(), dims, &mut p);
        let family = match &model {
            ModelSource::Explicit(d) => Some(d.family),
            ModelSource::Load(_) => None,
        };
        let mla = super::mla::mla_settings(&r.mla, family.is_none(), family, &mut p);
        checkpoint(&r.checkpoint, &mut p);
        // Across sections, and what this build cannot run yet.
        requirements::run_requirements(&r, &model, data.split, &mut p);
        let cp_comm_type = requirements::context_parallel(&r, seq_length, &mut p);
        let sharding = requirements::sharding_strategy(&r, &mut p);
        let offload = super::offload::offload(&r, &mut p);
        requirements::unsupported(&r, schedule.lr_decay_style, &mut p);
        if !p.is_empty() {
            return Err(ConfigError { problems: p });
        }
        Ok(RunConfig {
            resolved: r,
            model,
            seq_length,
            blend: data.blend,
            split: data.split,
            dataset_type: data.dataset_type,
            data_parallel_size: dp_size,
            global_batch_size: gbs,
            grad_accum_steps: gbs / (mbs * dp_size),
            train_iters,
            lr_warmup_iters: schedule.lr_warmup_iters,
            lr_decay_iters: schedule.lr_decay_iters,
            lr: schedule.lr,
            lr_decay_style: schedule.lr_decay_style,
            precision,
            recompute,
            lora,
            dpo,
            reward,
            moe,
            mla,
            cp_comm_type,
            sharding,
            offload,
        })
    }
}

/// `model.seq_length` and where the model comes from: `model.load` (then no explicit
/// dimension may be set) or the explicit dimensions ([`explicit_dims`]).
fn model_source(m: &mut ModelSection, p: &mut Vec<String>) -> (usize, ModelSource) {
    let seq_length = m.seq_length.unwrap_or_else(|| {
        p.push("model.seq_length is required".to_string());
        1
    });
    if m.seq_length == Some(0) {
        p.push("model.seq_length must be positive".to_string());
    }
    let Some(load) = &m.load else {
        return (
            seq_length,
            ModelSource::Explicit(explicit_dims(m, seq_length, p)),
        );
    };
    check_exists("model.load", load, p);
    if m.family.is_some() {
        p.push(
            "model.family cannot be combined with model.load (the architecture comes from it)"
                .to_string(),
        );
    }
    let explicit = [
        ("num_layers", m.num_layers),
        ("hidden_size", m.hidden_size),
        ("ffn_hidden_size", m.ffn_hidden_size),
        ("num_attention_heads", m.num_attention_heads),
        ("num_query_groups", m.num_query_groups),
        ("kv_channels", m.kv_channels),
        ("vocab_size", m.vocab_size),
        ("max_position_embeddings", m.max_position_embeddings),
    ];
    for (k, _) in explicit.iter().filter(|(_, v)| v.is_some()) {
        p.push(format!(
            "model.{k} cannot be combined with model.load (the architecture comes from it)"
        ));
    }
    (seq_length, ModelSource::Load(load.clone()))
}

/// The explicit `[model]` dimensions with Megatron's defaults (`ffn_hidden_size` 4h,
/// `num_query_groups` = heads, `kv_channels` h/a, `max_position_embeddings` = seq_length),
/// written back into `m` so the resolved config shows them.
fn explicit_dims(m: &mut ModelSection, seq_length: usize, p: &mut Vec<String>) -> ModelDims {
    let mut req = |k: &str, v: Option<usize>| match v {
        Some(0) => {
            p.push(format!("model.{k} must be positive"));
            1
        }
        Some(v) => v,
        None => {
            p.push(format!("model.{k} is required (or set model.load)"));
            1
        }
    };
    let num_layers = req("num_layers", m.num_layers);
    let hidden_size = req("hidden_size", m.hidden_size);
    let heads = req("num_attention_heads", m.num_attention_heads);
    let vocab_size = req("vocab_size", m.vocab_size);
    let groups = req("num_query_groups", m.num_query_groups.or(Some(heads)));
    let ffn = req(
        "ffn_hidden_size",
        m.ffn_hidden_size.or(Some(4 * hidden_size)),
    );
    let max_pos = req(
        "max_position_embeddings",
        m.max_position_embeddings.or(Some(seq_length)),
    );
    let kv = req(
        "kv_channels",
        m.kv_channels.or(Some((hidden_size / heads).max(1))),
    );
    if m.kv_channels.is_none() && !hidden_size.is_multiple_of(heads) {
        p.push(format!("model.hidden_size ({hidden_size}) is not a multiple of model.num_attention_heads ({heads}); set model.kv_channels"));
    }
    if heads % groups != 0 {
        p.push(format!("model.num_attention_heads ({heads}) is not a multiple of model.num_query_groups ({groups})"));
    }
    if seq_length > max_pos {
        p.push(format!(
            "model.seq_length ({seq_length}) exceeds model.max_position_embeddings ({max_pos})"
        ));
    }
    let family_name = m.family.get_or_insert_with(|| "llama".to_string());
    let family = ModelFamily::from_model_type(family_name).unwrap_or_else(|| {
        p.push(format!(
            "model.family `{family_name}` is not one of {}",
            ModelFamily::ALL.map(|f| f.model_type()).join(", ")
        ));
        ModelFamily::Llama
    });
    (m.ffn_hidden_size, m.num_query_groups) = (Some(ffn), Some(groups));
    (m.kv_channels, m.max_position_embeddings) = (Some(kv), Some(max_pos));
    ModelDims {
        family,
        num_layers,
        hidden_size,
        ffn_hidden_size: ffn,
        num_attention_heads: heads,
        num_query_groups: groups,
        kv_channels: kv,
        vocab_size,
        max_position_embeddings: max_pos,
    }
}

/// `model.rotary_base`, `init_method_std` and `norm_epsilon` are positive.
fn model_numbers(m: &ModelSection, p: &mut Vec<String>) {
    for (key, value) in [
        ("rotary_base", m.rotary_base),
        ("init_method_std", m.init_method_std),
        ("norm_epsilon", m.norm_epsilon),
    ] {
        if !positive(value) {
            p.push(format!("model.{key} ({value}) must be positive"));
        }
    }
}

/// The typed view of `[data]`.
struct DataView {
    dataset_type: DatasetType,
    blend: Vec<(f64, std::path::PathBuf)>,
    split: [f64; 3],
}

/// `[data]`: the dataset type, the blend (its files must exist: `PREFIX.bin` + `.idx`, or
/// the JSONL file itself for `sft_raw`), the split, the tokenizer path and the prefetch.
fn data_section(d: &DataSection, p: &mut Vec<String>) -> DataView {
    let dataset_type = match d.dataset_type.as_str() {
        "gpt" => DatasetType::Gpt,
        "sft_raw" => DatasetType::SftRaw,
        "sft_mmap" => DatasetType::SftMmap,
        "dpo" => DatasetType::Dpo,
        "reward" => DatasetType::Reward,
        other => {
            p.push(format!(
                "data.dataset_type: `{other}` is not one of \"gpt\", \"sft_raw\", \"sft_mmap\", \
                 \"dpo\", \"reward\""
            ));
            DatasetType::Gpt
        }
    };
    let blend = match &d.data_path {
        None => {
            p.push("data.data_path is required".to_string());
            Vec::new()
        }
        Some(dp) => parse_blend(&blend_tokens(dp), p),
    };
    for (_, prefix) in &blend {
        if matches!(
            dataset_type,
            DatasetType::SftRaw | DatasetType::Dpo | DatasetType::Reward
        ) {
            check_exists("data.data_path", prefix, p);
        } else {
            for ext in ["bin", "idx"] {
                let mut f = prefix.clone().into_os_string();
                f.push(format!(".{ext}"));
                check_exists("data.data_path", Path::new(&f), p);
            }
        }
    }
    let split = parse_split(&d.split, p);
    if let Some(tok) = &d.tokenizer_model {
        check_exists("data.tokenizer_model", tok, p);
    }
    if d.prefetch == 0 {
        p.push("data.prefetch must be at least 1".to_string());
    }
    DataView {
        dataset_type,
        blend,
        split,
    }
}

/// Checks the `[parallel]` sizes (the process grid's own rules) and returns the
/// data-parallel size (1 when unset).
fn validate_parallel(par: &ParallelSection, p: &mut Vec<String>) -> usize {
    let dp = par.data_parallel_size.unwrap_or(1);
    if dp == 0 {
        p.push("parallel.data_parallel_size must be at least 1".to_string());
        return 1;
    }
    let config = ferrotron_comm::ParallelConfig {
        tensor_model_parallel_size: par.tensor_model_parallel_size,
        pipeline_model_parallel_size: par.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size: par.virtual_pipeline_model_parallel_size,
        context_parallel_size: par.context_parallel_size,
        expert_model_parallel_size: par.expert_model_parallel_size,
    };
    let world = dp
        * par.tensor_model_parallel_size
        * par.pipeline_model_parallel_size
        * par.context_parallel_size;
    // With data_parallel_size unset, an `mpirun` world decides it at launch: the expert
    // grid (ep must divide the data-parallel ranks) is checked there.
    let world_known = par.data_parallel_size.is_some() || par.expert_model_parallel_size == 1;
    if let Err(e) = ferrotron_comm::ParallelState::new(world, 0, config)
        && world_known
    {
        p.push(format!("[parallel]: {e}"));
    }
    if let Some(etp) = par.expert_tensor_parallel_size
        && etp != 1
        && etp != par.tensor_model_parallel_size
    {
        p.push(format!(
            "parallel.expert_tensor_parallel_size ({etp}) must be 1 or \
             tensor_model_parallel_size ({})",
            par.tensor_model_parallel_size
        ));
    }
    if par.ddp_bucket_size == Some(0) {
        p.push("parallel.ddp_bucket_size must be at least 1".to_string());
    }
    if !par.grad_reduce_in_fp32 && par.overlap_grad_reduce {
        p.push(
            "parallel.grad_reduce_in_fp32 = false cannot be combined with overlap_grad_reduce \
             (overlapped buckets are reduced in f32)"
                .to_string(),
        );
    }
    if par.decoder_first_pipeline_num_layers.is_some() && par.pipeline_model_parallel_size < 2 {
        p.push(
            "parallel.decoder_first_pipeline_num_layers needs pipeline_model_parallel_size > 1"
                .to_string(),
        );
    }
    if par.decoder_first_pipeline_num_layers.is_some()
        && par
            .virtual_pipeline_model_parallel_size
            .is_some_and(|v| v > 1)
    {
        p.push(
            "parallel.decoder_first_pipeline_num_layers cannot be combined with \
             virtual_pipeline_model_parallel_size > 1 (the interleaved split is even)"
                .to_string(),
        );
    }
    if par.sequence_parallel && par.tensor_model_parallel_size == 1 {
        p.push("parallel.sequence_parallel needs tensor_model_parallel_size > 1".to_string());
    }
    dp
}
