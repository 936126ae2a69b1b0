//! The model a run trains: loaded from an HF directory or a Ferrotron checkpoint
//! (`model.load`) or built from the explicit `[model]` dimensions with Megatron's random init
//! (pretraining from scratch): loaded weights in f32 (the trainer rounds them for bf16 /
//! fp16 and keeps them as the master weights), initialized ones in the dtype `[precision]`
//! asks for; with the run's activation recompute (Megatron's `model_provider` before
//! `get_model` splits it).

use super::{Context, RunError};
use crate::config::{ModelDims, ModelSource, Precision, Recompute, RecomputeMethod, RunConfig};
use ferrotron_checkpoint::convert::CheckpointWeights;
use ferrotron_checkpoint::dist::locate_checkpoint;
use ferrotron_checkpoint::gguf::load_gguf_model;
use ferrotron_checkpoint::{HfExportSource, PeftAdapter};
use ferrotron_data::Tokenizer;
use ferrotron_data::preprocess::megatron_eod_id;
use ferrotron_model::families::{HfConfigInputs, load_hf_model};
use ferrotron_model::{
    GptModel, InitConfig, OutputHead, RecomputeGranularity,
    RecomputeMethod as ModelRecomputeMethod, TransformerConfig,
};
use ferrotron_optim::Precision as OptimPrecision;
use ferrotron_tensor::DType;
use std::path::{Path, PathBuf};

/// The model of a run and what the rest of the run needs to know about where it came from.
pub struct RunModel {
    /// The full model: loaded weights in f32 (a bf16/fp16 trainer rounds its copy and keeps
    /// these values as the master weights), freshly initialized ones in the dtype
    /// `[precision]` asks for (Megatron initializes the bf16/fp16 params themselves).
    pub model: GptModel,
    /// End-of-document token id (Megatron's EOD), when known.
    pub eod: Option<u32>,
    /// An HF directory to take the tokenizer from (SFT encoding, HF export).
    pub tokenizer_dir: Option<PathBuf>,
    /// `config.json` token ids and extra fields for the HF export.
    pub export_source: HfExportSource,
}

/// The optimizer precision and the weight storage dtype of `[precision]`.
pub(super) fn precision(rc: &RunConfig) -> (OptimPrecision, DType) {
    match rc.precision {
        Precision::Fp32 => (OptimPrecision::Fp32, DType::F32),
        Precision::Bf16 => (OptimPrecision::Bf16, DType::BF16),
        Precision::Fp16 => (OptimPrecision::Fp16, DType::F16),
    }
}

/// Megatron's `recompute_granularity` / `recompute_method` / `recompute_num_layers`.
fn recompute(r: Recompute) -> Option<RecomputeGranularity> {
    match r {
        Recompute::None => None,
        Recompute::Selective => Some(RecomputeGranularity::Selective),
        Recompute::Full { method, num_layers } => Some(RecomputeGranularity::Full {
            method: match method {
                RecomputeMethod::Uniform => ModelRecomputeMethod::Uniform,
                RecomputeMethod::Block => ModelRecomputeMethod::Block,
            },
            num_layers,
        }),
    }
}

/// Loads or initializes the full model of `rc` (every rank builds it; [`crate::parallelize`]
/// then takes the rank's slice).
///
/// # Errors
/// An unreadable `model.load` (HF directory or checkpoint), explicit dimensions the model
/// rejects (naming the key), a recompute setting the model rejects, or a
/// `data.tokenizer_model` without a usable tokenizer.
pub fn build_model(rc: &RunConfig) -> Result<RunModel, RunError> {
    let dtype = match rc.model {
        // Loaded weights stay f32 here: under bf16/fp16 the trainer rounds the model's copy
        // and starts the optimizer's master weights from these values.
        ModelSource::Load(_) => DType::F32,
        ModelSource::Explicit(_) => precision(rc).1,
    };
    let tokenizer_model = rc.resolved.data.tokenizer_model.clone();
    let mut run = match &rc.model {
        ModelSource::Load(file) if crate::config::is_gguf(file) => {
            from_gguf(rc, file, dtype, tokenizer_model)?
        }
        ModelSource::Load(dir)
            if locate_checkpoint(dir)
                .with_context(|| format!("model.load {}", dir.display()))?
                .is_some() =>
        {
            from_checkpoint(dir, dtype, tokenizer_model)?
        }
        ModelSource::Load(dir) => {
            let (model, info) = load_hf_model(dir, dtype)
                .with_context(|| format!("loading model.load {}", dir.display()))?;
            let export_source = HfExportSource::from_dir(dir)
                .with_context(|| format!("reading model.load {}", dir.display()))?;
            RunModel {
                model,
                eod: info.eos_token_ids.first().copied(),
                tokenizer_dir: Some(tokenizer_model.unwrap_or_else(|| dir.clone())),
                export_source,
            }
        }
        ModelSource::Explicit(dims) => from_scratch(rc, dims, dtype, tokenizer_model)?,
    };
    if rc.reward.is_some() && run.model.config().output_head != OutputHead::Score {
        let init = InitConfig {
            seed: rc.resolved.training.seed,
            init_method_std: rc.resolved.model.init_method_std as f32,
            params_dtype: dtype,
        };
        run.model = run
            .model
            .with_score_head(&init)
            .context("the reward model's score head")?;
    }
    if rc.moe.options.any() {
        let options = &rc.moe.options;
        run.model
            .update_moe(|m| options.apply(m))
            .context("[moe]")?;
    }
    run.model = with_lora(rc, run.model, dtype)?;
    run.model
        .set_recompute_granularity(recompute(rc.recompute))
        .context("training.recompute_num_layers")?;
    Ok(run)
}

/// `model` with the run's LoRA adapters (`[lora]`): fresh ones (seed `training.seed`,
/// stored in `dtype`) or those of `lora.adapter`; `model` as it is without `[lora]`.
fn with_lora(rc: &RunConfig, model: GptModel, dtype: DType) -> Result<GptModel, RunError> {
    let Some(lora) = &rc.lora else {
        return Ok(model);
    };
    if let Some(dir) = &rc.resolved.lora.adapter {
        let adapter =
            PeftAdapter::read(dir).with_context(|| format!("lora.adapter {}", dir.display()))?;
        return adapter
            .apply_to_with_dropout(model, lora.dropout)
            .with_context(|| format!("lora.adapter {}", dir.display()));
    }
    let init = InitConfig {
        seed: rc.resolved.training.seed,
        init_method_std: rc.resolved.model.init_method_std as f32,
        params_dtype: dtype,
    };
    model.with_lora(lora.clone(), &init).context("[lora]")
}

/// The frozen base of a LoRA run from a GGUF file: quantized weights kept in their blocks
/// (multiplied by the int8 / bf16-tile kernels, never trained), the rest stored in `dtype`.
/// Without `data.tokenizer_model` the file's tokenizer is written to
/// `logging.output_dir/gguf-tokenizer` for the run (SFT encoding, exports).
fn from_gguf(
    rc: &RunConfig,
    file: &Path,
    dtype: DType,
    tokenizer_model: Option<PathBuf>,
) -> Result<RunModel, RunError> {
    let context = || format!("loading model.load {}", file.display());
    let gguf = load_gguf_model(file, dtype).with_context(context)?;
    let tokenizer_dir = match tokenizer_model {
        Some(dir) => dir,
        None => {
            let dir = rc.resolved.logging.output_dir.join("gguf-tokenizer");
            gguf.tokenizer
                .write(&dir)
                .with_context(|| format!("writing {}", dir.display()))?;
            dir
        }
    };
    let info = gguf.info;
    let export_source = HfExportSource {
        config: HfConfigInputs {
            original: None,
            bos_token_id: info.bos_token_id,
            eos_token_ids: info.eos_token_ids.clone(),
            pad_token_id: None,
        },
        generation_config: None,
    };
    Ok(RunModel {
        model: gguf.model,
        eod: info.eos_token_ids.first().copied(),
        tokenizer_dir: Some(tokenizer_dir),
        export_source,
    })
}

/// The model of a Ferrotron checkpoint (converted from HF or saved by a run, any layout):
/// the whole model assembled from its shards, its HF config and tokenizer from the
/// checkpoint (the tokenizer of `data.tokenizer_model` when given).
fn from_checkpoint(
    dir: &Path,
    dtype: DType,
    tokenizer_model: Option<PathBuf>,
) -> Result<RunModel, RunError> {
    let context = || format!("loading model.load {}", dir.display());
    let weights = CheckpointWeights::open(dir, dtype).with_context(context)?;
    let export_source = HfExportSource {
        config: HfConfigInputs::from_original(weights.hf_config().clone()).with_context(context)?,
        generation_config: weights.generation_config().cloned(),
    };
    let tokenizer_dir = tokenizer_model.or_else(|| weights.tokenizer_dir());
    let (model, info) = weights.load_model().with_context(context)?;
    Ok(RunModel {
        model,
        eod: info.eos_token_ids.first().copied(),
        tokenizer_dir,
        export_source,
    })
}

/// A model of `dims` (its family's skeleton) with Megatron's init (seed `training.seed`); the EOD id from
/// the tokenizer in `data.tokenizer_model`, when one is given.
fn from_scratch(
    rc: &RunConfig,
    dims: &ModelDims,
    dtype: DType,
    tokenizer_dir: Option<PathBuf>,
) -> Result<RunModel, RunError> {
    let m = &rc.resolved.model;
    let mut config = TransformerConfig::llama(
        dims.num_layers,
        dims.hidden_size,
        dims.ffn_hidden_size,
        dims.num_attention_heads,
        dims.num_query_groups,
        dims.vocab_size,
        dims.max_position_embeddings,
    )
    .context("[model]")?;
    config.kv_channels = dims.kv_channels;
    config.layernorm_epsilon = m.norm_epsilon as f32;
    config.set_family(dims.family);
    config.rotary_base = m.rotary_base as f32;
    config.untie_embeddings_and_output_weights = m.untie_embeddings_and_output_weights;
    config.moe = rc.moe.build.clone();
    if let Some(mla) = &rc.mla {
        // MLA's core attention: one head per query head at the padded head dim.
        config.multi_latent_attention = Some(mla.config);
        config.kv_channels = mla.config.attention_head_dim();
        config.num_query_groups = config.num_attention_heads;
        config.rotary_interleaved = true;
        config.rope_scaling = mla.rope_scaling.clone();
    }
    config.validate().context("[model]")?;
    let init = InitConfig {
        seed: rc.resolved.training.seed,
        init_method_std: m.init_method_std as f32,
        params_dtype: dtype,
    };
    let model = GptModel::init_random(config, init).context("initializing the model")?;
    let eod = match &tokenizer_dir {
        Some(dir) => {
            let tok = Tokenizer::from_dir(dir)
                .with_context(|| format!("data.tokenizer_model {}", dir.display()))?;
            if tok.vocab_size() > dims.vocab_size {
                return Err(RunError::Config(format!(
                    "model.vocab_size {} is smaller than the tokenizer's {} tokens (data.tokenizer_model {})",
                    dims.vocab_size,
                    tok.vocab_size(),
                    dir.display()
                )));
            }
            Some(
                megatron_eod_id(dir, &tok)
                    .with_context(|| format!("data.tokenizer_model {}", dir.display()))?,
            )
        }
        None => None,
    };
    let export_source = HfExportSource {
        config: HfConfigInputs {
            original: None,
            bos_token_id: None,
            eos_token_ids: eod.into_iter().collect(),
            pad_token_id: None,
        },
        generation_config: None,
    };
    Ok(RunModel {
        model,
        eod,
        tokenizer_dir,
        export_source,
    })
}
