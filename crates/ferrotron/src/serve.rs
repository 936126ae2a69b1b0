//! `ferrotron serve`: the OpenAI-compatible server (`ferrotron_serve`) over the serving
//! engine, with vLLM's flag names.

use crate::model_dir::{LoadedModel, WeightDtype};
use anyhow::{Context, Result};
use clap::Args;
use ferrotron_infer::engine::{
    Engine, EngineConfig, EngineHandle, NgramConfig, SchedulerConfig, SpeculativeConfig,
};
use ferrotron_serve::{AppState, LoraRegistry, ServedModel};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

#[derive(Args)]
pub struct ServeArgs {
    /// HF model directory (config.json, safetensors, tokenizer.json, tokenizer_config.json),
    /// or a GGUF file (quantized weights served in their blocks; tokenizer and chat template
    /// from its metadata).
    #[arg(long)]
    model: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The model name clients pass as `model` (default: the --model path as given).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Most requests running at once (continuous batching); also the largest `n`.
    #[arg(long, default_value_t = 32)]
    max_num_seqs: usize,
    /// Most new tokens per engine step: long prompts are prefilled in chunks of this size
    /// beside the running decodes (smaller: shorter stalls of the decodes, i.e. lower p99
    /// inter-token latency; larger: fewer steps per long prompt).
    #[arg(long, default_value_t = 256)]
    max_num_batched_tokens: usize,
    /// Memory for the paged KV cache, GiB. Must hold at least one full context.
    #[arg(long, default_value_t = 2.0)]
    kv_cache_memory: f64,
    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Turn off automatic prefix caching (reuse of earlier prompts' full KV blocks).
    #[arg(long)]
    no_enable_prefix_caching: bool,
    /// Speculative decoding, vLLM's JSON: prompt lookup, e.g. '{"method": "ngram",
    /// "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'.
    /// Greedy outputs are identical with and without it; sampled ones keep their distribution.
    #[arg(long, conflicts_with = "draft_model")]
    speculative_config: Option<String>,
    /// Speculative decoding by a draft model: a smaller HF directory or GGUF file with the
    /// same tokenizer (e.g. a Q4_0 GGUF of the served model) proposes tokens greedily.
    #[arg(long)]
    draft_model: Option<PathBuf>,
    /// Tokens the draft model proposes per step.
    #[arg(long, default_value_t = 4, requires = "draft_model")]
    num_speculative_tokens: usize,
    /// Propose nothing in steps that start with at least this many requests running
    /// (speculation pays at small batches, where decoding is memory-bound).
    #[arg(long)]
    speculative_disable_by_batch_size: Option<usize>,
    /// Weight storage in memory; bf16 multiplies in bf16 with f32 accumulation.
    #[arg(long, value_enum, default_value_t = WeightDtype::F32)]
    dtype: WeightDtype,
    /// A LoRA adapter to serve as NAME: a PEFT adapter directory (adapter_config.json +
    /// adapter_model.safetensors) for this model, selected by requests whose `model` is NAME
    /// (repeat the flag for several; vLLM's --lora-modules).
    #[arg(long = "lora", alias = "lora-modules", value_name = "NAME=DIR", value_parser = parse_lora)]
    lora: Vec<(String, PathBuf)>,
    /// Allow loading and unloading LoRA adapters while serving, through
    /// POST /v1/load_lora_adapter {"lora_name", "lora_path"} and POST
    /// /v1/unload_lora_adapter {"lora_name"} (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    #[arg(long)]
    allow_runtime_lora_updating: bool,
    /// Seconds between throughput log lines while busy (0: off).
    #[arg(long, default_value_t = 10)]
    log_stats_interval: u64,
}

/// `NAME=DIR` of `--lora`.
fn parse_lora(value: &str) -> Result<(String, PathBuf), String> {
    match value.split_once('=') {
        Some((name, dir)) if !name.is_empty() && !dir.is_empty() => {
            Ok((name.to_string(), PathBuf::from(dir)))
        }
        _ => Err(format!(
            "`{value}`: expected NAME=DIR (e.g. sql=adapters/sql)"
        )),
    }
}

pub fn run(args: ServeArgs) -> Result<ExitCode> {
    let mut speculative = args
        .speculative_config
        .as_deref()
        .map(NgramConfig::from_json)
        .transpose()
        .map_err(|e| anyhow::anyhow!("--speculative-config: {e}"))?
        .map(SpeculativeConfig::Ngram);
    let loaded = LoadedModel::load(&args.model, args.dtype)?;
    let eos_token_ids = loaded.stop_token_ids(&args.model)?;
    let model = Arc::new(loaded.model);
    let draft = match &args.draft_model {
        Some(path) => {
            speculative = Some(SpeculativeConfig::DraftModel {
                num_speculative_tokens: args.num_speculative_tokens,
            });
            let draft = LoadedModel::load(path, args.dtype).context("--draft-model")?;
            Some(Arc::new(draft.model))
        }
        None => None,
    };
    let bytes = (args.kv_cache_memory.max(0.0) * (1u64 << 30) as f64) as u64;
    let models: Vec<&ferrotron_model::GptModel> =
        std::iter::once(&*model).chain(draft.as_deref()).collect();
    let block_size = args.block_size.max(1);
    let num_blocks = EngineConfig::blocks_for_memory(&models, block_size, bytes);
    let context = model.config().max_position_embeddings;
    if num_blocks * block_size < context {
        let need = EngineConfig::memory_for_tokens(&models, block_size, context);
        anyhow::bail!(
            "--kv-cache-memory: {:.3} GiB holds {} tokens of keys and values ({}), less than \
             the model's context of {context}: give it at least {:.3} GiB",
            args.kv_cache_memory,
            num_blocks * block_size,
            if draft.is_some() {
                "the model's and the draft model's"
            } else {
                "the model's"
            },
            need as f64 / (1u64 << 30) as f64
        );
    }
    let config = EngineConfig {
        block_size,
        num_blocks,
        scheduler: SchedulerConfig {
            max_num_seqs: args.max_num_seqs,
            max_num_batched_tokens: args.max_num_batched_tokens,
        },
        enable_prefix_caching: !args.no_enable_prefix_caching,
        speculative,
        speculative_disable_by_batch_size: args.speculative_disable_by_batch_size,
    };
    let mut engine =
        Engine::new(model.clone(), config).context("--kv-cache-memory / --max-num-seqs")?;
    if let Some(draft) = draft {
        engine = engine.with_draft_model(draft).context("--draft-model")?;
    }
    // Steps free and re-allocate MBs of activations: keep them instead of re-faulting pages.
    ferrotron_tensor::allocator::retain_freed_memory();
    let handle = EngineHandle::spawn(engine)?;
    let name = args
        .served_model_name
        .unwrap_or_else(|| args.model.display().to_string());
    let served = ServedModel {
        name: name.clone(),
        tokenizer: Arc::new(loaded.tokenizer),
        chat_template: loaded.chat_template,
        eos_token_ids,
    };
    let adapters = LoraRegistry::new(model, &name, args.allow_runtime_lora_updating);
    for (lora_name, dir) in &args.lora {
        adapters
            .load(lora_name, dir)
            .map_err(|e| anyhow::anyhow!("--lora {lora_name}={}: {}", dir.display(), e.message))?;
    }
    for a in adapters.list() {
        let (name, dir, rank) = (a.name, a.path.display(), a.rank);
        eprintln!("ferrotron serve: LoRA adapter {name} from {dir} (rank {rank})");
    }
    let state = Arc::new(AppState::new(served, handle, adapters, args.max_num_seqs));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("--host/--port: cannot listen on {addr}"))?;
        eprintln!(
            "ferrotron serve: serving {name} on http://{} ({} KV blocks of {} tokens, \
             max {} sequences, {} tokens per step, prefix caching {})",
            listener.local_addr()?,
            config.num_blocks,
            config.block_size,
            config.scheduler.max_num_seqs,
            config.scheduler.max_num_batched_tokens,
            if config.enable_prefix_caching {
                "on"
            } else {
                "off"
            },
        );
        let every =
            (args.log_stats_interval > 0).then(|| Duration::from_secs(args.log_stats_interval));
        ferrotron_serve::serve(listener, state, ferrotron_serve::shutdown_signal(), every).await?;
        eprintln!("ferrotron serve: stopped");
        Ok(ExitCode::SUCCESS)
    })
}
