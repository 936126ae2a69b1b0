//! The `[training]`, `[optimizer]`, `[precision]` and `[checkpoint]` checks of
//! [`RunConfig::from_raw`](super::RunConfig::from_raw): batch sizes, the length of the run,
//! recompute, the learning-rate schedule (warmup in iterations from whichever unit was
//! given, as Megatron), AdamW's ranges, the loss scaler and saving. Each pushes its problems
//! (naming the key) and returns what it derived.

use super::sections::{
    CheckpointSection, OptimizerSection, ParallelSection, PrecisionSection, RawConfig,
    TrainingSection,
};
use super::types::{LrDecayStyle, ModelSource, Precision, Recompute, RecomputeMethod};
use super::values::{ceil_div, check_exists, nonneg, positive};
use ferrotron_model::LoraConfig;

/// `(micro_batch_size, global_batch_size)`: the global batch defaults to
/// `micro_batch_size · dp` (written back) and must be a multiple of it; under the interleaved
/// schedule its micro-batches per rank must be a multiple of the pipeline size.
pub(super) fn batch_sizes(
    t: &mut TrainingSection,
    par: &ParallelSection,
    dp_size: usize,
    p: &mut Vec<String>,
) -> (usize, usize) {
    if t.micro_batch_size == 0 {
        p.push("training.micro_batch_size must be positive".to_string());
    }
    let mbs = t.micro_batch_size.max(1);
    let gbs = *t.global_batch_size.get_or_insert(mbs * dp_size);
    if gbs == 0 || !gbs.is_multiple_of(mbs * dp_size) {
        p.push(format!("training.global_batch_size ({gbs}) is not a multiple of micro_batch_size ({mbs}) x data_parallel_size ({dp_size})"));
    } else if let Some(vp) = par.virtual_pipeline_model_parallel_size.filter(|&v| v > 1) {
        let (microbatches, pp) = (gbs / (mbs * dp_size), par.pipeline_model_parallel_size);
        if !microbatches.is_multiple_of(pp) {
            p.push(format!("training.global_batch_size ({gbs}) gives {microbatches} micro-batches per data-parallel rank; the interleaved schedule (parallel.virtual_pipeline_model_parallel_size = {vp}) needs a multiple of pipeline_model_parallel_size ({pp})"));
        }
    }
    (mbs, gbs)
}

/// Iterations of the run: `train_iters`, or `train_tokens` in iterations of
/// `tokens_per_iter` (rounded up); exactly one of them, giving at least one iteration.
pub(super) fn train_iters(t: &TrainingSection, tokens_per_iter: u64, p: &mut Vec<String>) -> u64 {
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
        p.push("training.train_iters/train_tokens must give at least one iteration".to_string());
    }
    train_iters
}

/// `training.eval_interval` and `log_interval` are positive.
pub(super) fn intervals(t: &TrainingSection, p: &mut Vec<String>) {
    for (k, v) in [
        ("eval_interval", t.eval_interval),
        ("log_interval", t.log_interval),
    ] {
        if v == 0 {
            p.push(format!("training.{k} must be positive"));
        }
    }
}

/// Megatron's `recompute_granularity` / `recompute_method` / `recompute_num_layers`
/// (`recompute_num_layers` defaults to 1 under "full", written back).
pub(super) fn recompute(
    t: &mut TrainingSection,
    model: &ModelSource,
    p: &mut Vec<String>,
) -> Recompute {
    match t.recompute_granularity.as_deref() {
        None | Some("none") => {
            if t.recompute_method.is_some() || t.recompute_num_layers.is_some() {
                p.push("training.recompute_method/recompute_num_layers need recompute_granularity = \"full\"".to_string());
            }
            Recompute::None
        }
        Some("selective") => Recompute::Selective,
        Some("full") => full_recompute(t, model, p),
        Some(o) => {
            p.push(format!(
                "training.recompute_granularity: `{o}` is not \"selective\", \"full\" or unset"
            ));
            Recompute::None
        }
    }
}

/// `recompute_granularity = "full"`: its method and layer count.
fn full_recompute(t: &mut TrainingSection, model: &ModelSource, p: &mut Vec<String>) -> Recompute {
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
            p.push(
                "training.recompute_method is required with recompute_granularity = \"full\""
                    .to_string(),
            );
            RecomputeMethod::Uniform
        }
    };
    let n = *t.recompute_num_layers.get_or_insert(1);
    if n == 0 {
        p.push("training.recompute_num_layers must be positive".to_string());
    }
    if let ModelSource::Explicit(dims) = model
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

/// `training.finetune` needs weights to start from: `checkpoint.load` (which must exist)
/// or `model.load`.
pub(super) fn finetune(r: &RawConfig, p: &mut Vec<String>) {
    if !r.training.finetune {
        return;
    }
    match &r.checkpoint.load {
        None if r.model.load.is_none() => {
            p.push("training.finetune needs checkpoint.load (or model.load)".to_string())
        }
        None => {}
        Some(l) => check_exists("checkpoint.load", l, p),
    }
}

/// `[lora]` when enabled: its keys as a [`LoraConfig`] (each problem naming its key), on a
/// loaded base (`model.load`); `lora.adapter` must exist. `checkpoint.export_peft` needs it.
pub(super) fn lora(r: &RawConfig, p: &mut Vec<String>) -> Option<LoraConfig> {
    let l = &r.lora;
    if !l.enabled {
        if r.checkpoint.export_peft.is_some() {
            p.push("checkpoint.export_peft needs a LoRA run (lora.enabled = true)".into());
        }
        if let Some(gguf) = r.model.load.as_ref().filter(|l| is_gguf(l)) {
            p.push(format!(
                "model.load {}: a GGUF base trains LoRA adapters only (set lora.enabled = true, \
                 or `ferrotron convert gguf-to-hf` it for full training)",
                gguf.display()
            ));
        }
        return None;
    }
    if r.model.load.is_none() {
        p.push("lora.enabled needs model.load: the pretrained base the adapters train on".into());
    }
    if let Some(dir) = &l.adapter {
        check_exists("lora.adapter", dir, p);
    }
    let config = LoraConfig {
        target_modules: l.target_modules.clone(),
        rank: l.rank,
        alpha: l.alpha as f32,
        dropout: l.dropout as f32,
    };
    match config.validate() {
        Ok(()) => Some(config),
        Err(e) => {
            p.push(e.to_string());
            None
        }
    }
}

/// `[dpo]` as the trainer's options when `data.dataset_type = "dpo"` (`lora`: the run trains
/// LoRA adapters, which "auto" takes the base of as the reference); each bad key named.
pub(super) fn dpo(
    r: &RawConfig,
    dataset_type: super::types::DatasetType,
    lora: bool,
    p: &mut Vec<String>,
) -> Option<crate::trainer::DpoOptions> {
    use crate::trainer::{DpoOptions, DpoReference};
    if dataset_type != super::types::DatasetType::Dpo {
        return None;
    }
    let d = &r.dpo;
    if !(d.beta.is_finite() && d.beta > 0.0) {
        p.push(format!("dpo.beta must be > 0, got {}", d.beta));
    }
    if !(0.0..0.5).contains(&d.label_smoothing) {
        p.push(format!(
            "dpo.label_smoothing must be in [0, 0.5), got {}",
            d.label_smoothing
        ));
    }
    let reference = match (d.reference.as_str(), lora) {
        ("base", true) | ("auto", true) => DpoReference::AdaptersDisabled,
        ("frozen_copy", _) | ("auto", false) => DpoReference::FrozenCopy,
        ("base", false) => {
            p.push("dpo.reference = \"base\" needs a LoRA run (lora.enabled = true)".into());
            DpoReference::FrozenCopy
        }
        (other, _) => {
            p.push(format!(
                "dpo.reference: `{other}` is not one of \"auto\", \"base\", \"frozen_copy\""
            ));
            DpoReference::FrozenCopy
        }
    };
    Some(DpoOptions {
        beta: d.beta,
        label_smoothing: d.label_smoothing,
        reference,
    })
}

/// `[reward]` as the trainer's options when `data.dataset_type = "reward"`; each bad key
/// named.
pub(super) fn reward(
    r: &RawConfig,
    dataset_type: super::types::DatasetType,
    p: &mut Vec<String>,
) -> Option<crate::trainer::RewardOptions> {
    if dataset_type != super::types::DatasetType::Reward {
        return None;
    }
    let c = r.reward.center_rewards_coefficient;
    if !(c.is_finite() && c >= 0.0) {
        p.push(format!(
            "reward.center_rewards_coefficient must be >= 0, got {c}"
        ));
    }
    Some(crate::trainer::RewardOptions {
        center_rewards_coefficient: c,
        // The model's, set once the model and data are loaded (`run::Run::setup`).
        pad_token_id: None,
    })
}

/// Whether `path` names a GGUF file (by its extension, as `ferrotron serve --model` does).
pub(crate) fn is_gguf(path: &std::path::Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// The learning-rate schedule of `[optimizer]`, in iterations.
pub(super) struct LrSchedule {
    /// Peak learning rate (`optimizer.lr`).
    pub lr: f64,
    /// Decay shape.
    pub lr_decay_style: LrDecayStyle,
    /// Warmup from whichever unit was given.
    pub lr_warmup_iters: u64,
    /// Decay length (`train_iters` by default).
    pub lr_decay_iters: u64,
}

/// `optimizer.lr` (required, non-negative, at least `min_lr`), the decay style, the warmup
/// (one unit of iterations, samples of `gbs` or tokens of `tokens_per_iter`; 0 written back
/// when none is given) and `lr_decay_iters` (default `train_iters`, written back), which
/// must be longer than the warmup.
pub(super) fn lr_schedule(
    o: &mut OptimizerSection,
    gbs: usize,
    tokens_per_iter: u64,
    train_iters: u64,
    p: &mut Vec<String>,
) -> LrSchedule {
    let lr = peak_lr(o, p);
    let lr_decay_style = decay_style(&o.lr_decay_style, p);
    let lr_warmup_iters = warmup_iters(o, gbs, tokens_per_iter, p);
    let lr_decay_iters = *o.lr_decay_iters.get_or_insert(train_iters);
    if lr_warmup_iters >= lr_decay_iters {
        p.push(format!("optimizer: warmup ({lr_warmup_iters} iterations) must be shorter than lr_decay_iters ({lr_decay_iters})"));
    }
    LrSchedule {
        lr,
        lr_decay_style,
        lr_warmup_iters,
        lr_decay_iters,
    }
}

/// `optimizer.lr`: required, non-negative, not below `min_lr`.
fn peak_lr(o: &OptimizerSection, p: &mut Vec<String>) -> f64 {
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
    lr
}

/// `optimizer.lr_decay_style` by Megatron's names.
fn decay_style(style: &str, p: &mut Vec<String>) -> LrDecayStyle {
    match style {
        "constant" => LrDecayStyle::Constant,
        "linear" => LrDecayStyle::Linear,
        "cosine" => LrDecayStyle::Cosine,
        "inverse-square-root" => LrDecayStyle::InverseSquareRoot,
        "WSD" => LrDecayStyle::Wsd,
        s => {
            p.push(format!("optimizer.lr_decay_style: `{s}` is not one of constant, linear, cosine, inverse-square-root, WSD"));
            LrDecayStyle::Linear
        }
    }
}

/// The warmup in iterations from the one unit given (`lr_warmup_iters`, `_samples` or
/// `_tokens`, rounded up); none given: 0, written back as `lr_warmup_iters`.
fn warmup_iters(
    o: &mut OptimizerSection,
    gbs: usize,
    tokens_per_iter: u64,
    p: &mut Vec<String>,
) -> u64 {
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
    match units {
        [(_, Some(i)), ..] => i,
        [_, (_, Some(s)), _] => ceil_div(s, gbs as u64),
        [_, _, (_, Some(tok))] => ceil_div(tok, tokens_per_iter),
        _ => {
            o.lr_warmup_iters = Some(0);
            0
        }
    }
}

/// AdamW's settings are in range: `weight_decay >= 0`, betas in `[0, 1)`, `adam_eps > 0`,
/// `clip_grad >= 0`.
pub(super) fn adam_ranges(o: &OptimizerSection, p: &mut Vec<String>) {
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
}

/// `[precision]`: bf16 or fp16 (not both) or neither, and the fp16 loss scaler's settings.
pub(super) fn precision(pr: &PrecisionSection, p: &mut Vec<String>) -> Precision {
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
        p.push(format!(
            "precision.min_loss_scale ({}) must be positive and at most initial_loss_scale ({})",
            pr.min_loss_scale, pr.initial_loss_scale
        ));
    }
    if pr.loss_scale_window == 0 {
        p.push("precision.loss_scale_window must be positive".to_string());
    }
    precision
}

/// `[checkpoint]`: an interval needs a directory; intervals and `keep_last` are positive.
pub(super) fn checkpoint(ck: &CheckpointSection, p: &mut Vec<String>) {
    if ck.save_interval.is_some() && ck.save.is_none() {
        p.push("checkpoint.save_interval needs checkpoint.save".to_string());
    }
    if ck.save_interval == Some(0) {
        p.push("checkpoint.save_interval must be positive".to_string());
    }
    if ck.keep_last == Some(0) {
        p.push("checkpoint.keep_last must be positive".to_string());
    }
}
