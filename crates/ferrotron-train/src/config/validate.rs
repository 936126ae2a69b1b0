//! Validation of a [`RawConfig`] into a [`RunConfig`]: every problem is collected, each naming
//! its key; derived values (gradient accumulation, iterations from tokens, warmup in
//! iterations) are computed the way Megatron does.

use super::ConfigError;
use super::requirements;
use super::sections::RawConfig;
use super::types::*;
use super::values::{
    blend_tokens, ceil_div, check_exists, nonneg, parse_blend, parse_split, positive,
};
use std::path::Path;

impl RunConfig {
    /// Validates `raw`, collecting every problem into one [`ConfigError`].
    pub fn from_raw(raw: RawConfig) -> Result<RunConfig, ConfigError> {
        let mut p = Vec::new();
        let mut r = raw;
        let (m, t, o) = (&mut r.model, &mut r.training, &mut r.optimizer);

        // [model]
        let seq_length = m.seq_length.unwrap_or_else(|| {
            p.push("model.seq_length is required".to_string());
            1
        });
        if m.seq_length == Some(0) {
            p.push("model.seq_length must be positive".to_string());
        }
        let model = if let Some(load) = &m.load {
            check_exists("model.load", load, &mut p);
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
            ModelSource::Load(load.clone())
        } else {
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
                p.push(format!("model.seq_length ({seq_length}) exceeds model.max_position_embeddings ({max_pos})"));
            }
            (m.ffn_hidden_size, m.num_query_groups) = (Some(ffn), Some(groups));
            (m.kv_channels, m.max_position_embeddings) = (Some(kv), Some(max_pos));
            ModelSource::Explicit(ModelDims {
                num_layers,
                hidden_size,
                ffn_hidden_size: ffn,
                num_attention_heads: heads,
                num_query_groups: groups,
                kv_channels: kv,
                vocab_size,
                max_position_embeddings: max_pos,
            })
        };
        if !positive(m.rotary_base) {
            p.push(format!(
                "model.rotary_base ({}) must be positive",
                m.rotary_base
            ));
        }
        if !positive(m.init_method_std) {
            p.push(format!(
                "model.init_method_std ({}) must be positive",
                m.init_method_std
            ));
        }
        if !positive(m.norm_epsilon) {
            p.push(format!(
                "model.norm_epsilon ({}) must be positive",
                m.norm_epsilon
            ));
        }

        // [data]
        let d = &r.data;
        let dataset_type = match d.dataset_type.as_str() {
            "gpt" => DatasetType::Gpt,
            "sft_raw" => DatasetType::SftRaw,
            "sft_mmap" => DatasetType::SftMmap,
            other => {
                p.push(format!(
                    "data.dataset_type: `{other}` is not one of \"gpt\", \"sft_raw\", \"sft_mmap\""
                ));
                DatasetType::Gpt
            }
        };
        let blend = match &d.data_path {
            None => {
                p.push("data.data_path is required".to_string());
                Vec::new()
            }
            Some(dp) => parse_blend(&blend_tokens(dp), &mut p),
        };
        for (_, prefix) in &blend {
            if dataset_type == DatasetType::SftRaw {
                check_exists("data.data_path", prefix, &mut p);
            } else {
                for ext in ["bin", "idx"] {
                    let mut f = prefix.clone().into_os_string();
                    f.push(format!(".{ext}"));
                    check_exists("data.data_path", Path::new(&f), &mut p);
                }
            }
        }
        let split = parse_split(&d.split, &mut p);
        if let Some(tok) = &d.tokenizer_model {
            check_exists("data.tokenizer_model", tok, &mut p);
        }
        if d.prefetch == 0 {
            p.push("data.prefetch must be at least 1".to_string());
        }

        // [parallel]
        let dp_size = validate_parallel(&r.parallel, &mut p);
        if m.make_vocab_size_divisible_by == 0 {
            p.push("model.make_vocab_size_divisible_by must be at least 1".to_string());
        }

        // [training]
        if t.micro_batch_size == 0 {
            p.push("training.micro_batch_size must be positive".to_string());
        }
        let mbs = t.micro_batch_size.max(1);
        let gbs = *t.global_batch_size.get_or_insert(mbs * dp_size);
        if gbs == 0 || gbs % (mbs * dp_size) != 0 {
            p.push(format!("training.global_batch_size ({gbs}) is not a multiple of micro_batch_size ({mbs}) x data_parallel_size ({dp_size})"));
        } else if let Some(vp) = r
            .parallel
            .virtual_pipeline_model_parallel_size
            .filter(|&v| v > 1)
        {
            let (microbatches, pp) = (
                gbs / (mbs * dp_size),
                r.parallel.pipeline_model_parallel_size,
            );
            if !microbatches.is_multiple_of(pp) {
                p.push(format!("training.global_batch_size ({gbs}) gives {microbatches} micro-batches per data-parallel rank; the interleaved schedule (parallel.virtual_pipeline_model_parallel_size = {vp}) needs a multiple of pipeline_model_parallel_size ({pp})"));
            }
        }
        let tokens_per_iter = (gbs.max(1) * seq_length) as u64;
        let train_iters = match (t.train_iters, t.train_tokens) {
            (Some(i), None) => i,
            (None, Some(tok)) => ceil_div(tok, tokens_per_iter),
            (Some(_), Some(_)) => {
                p.push("training: give only one of train_iters and train_tokens".to_string());
                1
            }
            (None, None) => {
                p.push("training: one of train_iters or train_tokens is required".to_string());
                1
            }
        };
        if train_iters == 0 && (t.train_iters.is_some() || t.train_tokens.is_some()) {
            p.push(
                "training.train_iters/train_tokens must give at least one iteration".to_string(),
            );
        }
        for (k, v) in [
            ("eval_interval", t.eval_interval),
            ("log_interval", t.log_interval),
        ] {
            if v == 0 {
                p.push(format!("training.{k} must be positive"));
            }
        }
        let recompute = match t.recompute_granularity.as_deref() {
            None | Some("none") => {
                if t.recompute_method.is_some() || t.recompute_num_layers.is_some() {
                    p.push("training.recompute_method/recompute_num_layers need recompute_granularity = \"full\"".to_string());
                }
                Recompute::None
            }
            Some("selective") => Recompute::Selective,
            Some("full") => {
                let method = match t.recompute_method.as_deref() {
                    Some("uniform") => RecomputeMethod::Uniform,
                    Some("block") => RecomputeMethod::Block,
                    Some(o) => {
                        p.push(format!(
                            "training.recompute_method: `{o}` is not \"uniform\" or \"block\""
                        ));
                        RecomputeMethod::Uniform
                    }
                    None => {
                        p.push("training.recompute_method is required with recompute_granularity = \"full\"".to_string());
                        RecomputeMethod::Uniform
                    }
                };
                let n = *t.recompute_num_layers.get_or_insert(1);
                if n == 0 {
                    p.push("training.recompute_num_layers must be positive".to_string());
                }
                if let ModelSource::Explicit(dims) = &model
                    && n > dims.num_layers
                {
                    p.push(format!(
                        "training.recompute_num_layers ({n}) exceeds model.num_layers ({})",
                        dims.num_layers
                    ));
                }
                Recompute::Full {
                    method,
                    num_layers: n,
                }
            }
            Some(o) => {
                p.push(format!(
                    "training.recompute_granularity: `{o}` is not \"selective\", \"full\" or unset"
                ));
                Recompute::None
            }
        };
        let ck = &r.checkpoint;
        if t.finetune {
            match &ck.load {
                None if m.load.is_none() => {
                    p.push("training.finetune needs checkpoint.load (or model.load)".to_string())
                }
                None => {}
                Some(l) => check_exists("checkpoint.load", l, &mut p),
            }
        }

        // [optimizer]
        let lr = o.lr.unwrap_or_else(|| {
            p.push("optimizer.lr is required".to_string());
            0.0
        });
        if o.lr.is_some_and(|lr| !nonneg(lr)) {
            p.push(format!("optimizer.lr ({lr}) must be non-negative"));
        }
        if lr < o.min_lr && o.lr.is_some() {
            p.push(format!(
                "optimizer.lr ({lr}) is below optimizer.min_lr ({})",
                o.min_lr
            ));
        }
        let lr_decay_style = match o.lr_decay_style.as_str() {
            "constant" => LrDecayStyle::Constant,
            "linear" => LrDecayStyle::Linear,
            "cosine" => LrDecayStyle::Cosine,
            "inverse-square-root" => LrDecayStyle::InverseSquareRoot,
            "WSD" => LrDecayStyle::Wsd,
            s => {
                p.push(format!("optimizer.lr_decay_style: `{s}` is not one of constant, linear, cosine, inverse-square-root, WSD"));
                LrDecayStyle::Linear
            }
        };
        let units = [
            ("lr_warmup_iters", o.lr_warmup_iters),
            ("lr_warmup_samples", o.lr_warmup_samples),
            ("lr_warmup_tokens", o.lr_warmup_tokens),
        ];
        let given: Vec<&str> = units
            .iter()
            .filter(|(_, v)| v.is_some())
            .map(|(k, _)| *k)
            .collect();
        if given.len() > 1 {
            p.push(format!(
                "optimizer: give only one warmup unit (got {})",
                given.join(", ")
            ));
        }
        let lr_warmup_iters = match units {
            [(_, Some(i)), ..] => i,
            [_, (_, Some(s)), _] => ceil_div(s, gbs as u64),
            [_, _, (_, Some(tok))] => ceil_div(tok, tokens_per_iter),
            _ => {
                o.lr_warmup_iters = Some(0);
                0
            }
        };
        let lr_decay_iters = *o.lr_decay_iters.get_or_insert(train_iters);
        if lr_warmup_iters >= lr_decay_iters {
            p.push(format!("optimizer: warmup ({lr_warmup_iters} iterations) must be shorter than lr_decay_iters ({lr_decay_iters})"));
        }
        for (k, v, ok) in [
            ("weight_decay", o.weight_decay, o.weight_decay >= 0.0),
            (
                "adam_beta1",
                o.adam_beta1,
                (0.0..1.0).contains(&o.adam_beta1),
            ),
            (
                "adam_beta2",
                o.adam_beta2,
                (0.0..1.0).contains(&o.adam_beta2),
            ),
            ("adam_eps", o.adam_eps, o.adam_eps > 0.0),
            ("clip_grad", o.clip_grad, o.clip_grad >= 0.0),
        ] {
            if !ok {
                p.push(format!("optimizer.{k} ({v}) is out of range"));
            }
        }

        // [precision]
        let pr = &r.precision;
        let precision = match (pr.bf16, pr.fp16) {
            (true, true) => {
                p.push("precision: bf16 and fp16 are mutually exclusive".to_string());
                Precision::Bf16
            }
            (true, false) => Precision::Bf16,
            (false, true) => Precision::Fp16,
            (false, false) => Precision::Fp32,
        };
        if pr.loss_scale.is_some_and(|s| !positive(s)) {
            p.push("precision.loss_scale must be positive".to_string());
        }
        if !positive(pr.min_loss_scale) || pr.min_loss_scale > pr.initial_loss_scale {
            p.push(format!("precision.min_loss_scale ({}) must be positive and at most initial_loss_scale ({})", pr.min_loss_scale, pr.initial_loss_scale));
        }
        if pr.loss_scale_window == 0 {
            p.push("precision.loss_scale_window must be positive".to_string());
        }

        // [checkpoint]
        if ck.save_interval.is_some() && ck.save.is_none() {
            p.push("checkpoint.save_interval needs checkpoint.save".to_string());
        }
        if ck.save_interval == Some(0) {
            p.push("checkpoint.save_interval must be positive".to_string());
        }
        if ck.keep_last == Some(0) {
            p.push("checkpoint.keep_last must be positive".to_string());
        }

        // Across sections, and what this build cannot run yet.
        requirements::run_requirements(&r, &model, split, &mut p);
        requirements::unsupported(&r, lr_decay_style, &mut p);

        if !p.is_empty() {
            return Err(ConfigError { problems: p });
        }
        Ok(RunConfig {
            resolved: r,
            model,
            seq_length,
            blend,
            split,
            dataset_type,
            data_parallel_size: dp_size,
            global_batch_size: gbs,
            grad_accum_steps: gbs / (mbs * dp_size),
            train_iters,
            lr_warmup_iters,
            lr_decay_iters,
            lr,
            lr_decay_style,
            precision,
            recompute,
        })
    }
}

/// Checks the `[parallel]` sizes (the process grid's own rules) and returns the
/// data-parallel size (1 when unset).
fn validate_parallel(par: &super::ParallelSection, p: &mut Vec<String>) -> usize {
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
    if let Err(e) = ferrotron_comm::ParallelState::new(world, 0, config) {
        p.push(format!("[parallel]: {e}"));
    }
    if par.ddp_bucket_size == Some(0) {
        p.push("parallel.ddp_bucket_size must be at least 1".to_string());
    }
    if par.overlap_param_gather && !par.use_distributed_optimizer {
        p.push(
            "parallel.overlap_param_gather needs parallel.use_distributed_optimizer".to_string(),
        );
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
