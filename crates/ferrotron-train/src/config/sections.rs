//! The raw `run.toml` sections as written by the user (serde, `deny_unknown_fields`), with
//! Megatron's defaults. Every key carries a docstring (units, default, Megatron flag) that
//! [`super::documented_keys`] exposes for `--help` / `--print-config`.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// One entry of a `data_path` list: a blend weight or a path prefix.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum BlendItem {
    /// A blend weight (e.g. `0.3`).
    Weight(f64),
    /// A path prefix or file, or a weight written as a string (`"0.3"`).
    Text(String),
}

/// `data_path`: a Megatron blend string (`"0.3 prefixA 0.7 prefixB"`) or a list of its tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DataPath {
    /// Whitespace-separated tokens, exactly like Megatron's `--data-path`.
    Blend(String),
    /// The same tokens as a TOML list: `[0.3, "prefixA", 0.7, "prefixB"]` or `["prefixA"]`.
    List(Vec<BlendItem>),
}

/// Declares one config section: the struct (with per-field docs), its `Default` (Megatron's
/// defaults) and `KEYS`, the `(key, doc)` table used for help text.
macro_rules! section {
    ($(#[doc = $sdoc:literal])* $name:ident, $section:literal {
        $( $(#[doc = $doc:literal])+ $field:ident : $ty:ty = $default:expr, )*
    }) => {
        $(#[doc = $sdoc])*
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(default, deny_unknown_fields)]
        pub struct $name {
            $( $(#[doc = $doc])+ pub $field: $ty, )*
        }

        impl Default for $name {
            fn default() -> Self {
                Self { $( $field: $default, )* }
            }
        }

        impl $name {
            /// The TOML table name of this section.
            pub const SECTION: &'static str = $section;
            /// `(key, docstring)` for every key of this section, in declaration order.
            pub const KEYS: &'static [(&'static str, &'static str)] =
                &[ $( (stringify!($field), concat!($($doc, "\n"),+)), )* ];
        }
    };
}

pub(super) use section;

section! {
    /// `[model]`: where the weights/architecture come from.
    ModelSection, "model" {
        /// HF directory (config.json + safetensors) or Ferrotron checkpoint to initialise from,
        /// or a GGUF file as a LoRA run's frozen base (its quantized weights kept in their
        /// blocks; the tokenizer from its metadata unless `data.tokenizer_model`).
        /// When set, the architecture comes from it and the explicit keys below must be unset
        /// (except `seq_length`). Default: unset. Megatron: `--load` / `--pretrained-checkpoint`.
        load: Option<PathBuf> = None,
        /// Architecture family of a model built from the keys below, by its HF `model_type`:
        /// llama, mistral, qwen2, olmo, olmo2, gemma, phi3, starcoder2, falcon, bloom, or the
        /// MoE families mixtral, qwen2_moe and olmoe (with `[moe]`), or deepseek_v2 (with
        /// `[mla]`, and `[moe]` for its experts). It
        /// fixes the skeleton's switches (norm kind, gated MLP and activation, position
        /// embedding, parallel attention, extra norms, biases) as that family's HF modeling
        /// code does. Unset with `load`. Default: llama.
        family: Option<String> = None,
        /// Number of transformer layers. Required without `load`. Megatron: `--num-layers`.
        num_layers: Option<usize> = None,
        /// Model width. Required without `load`. Megatron: `--hidden-size`.
        hidden_size: Option<usize> = None,
        /// MLP inner width. Default: 4 x hidden_size. Megatron: `--ffn-hidden-size`.
        ffn_hidden_size: Option<usize> = None,
        /// Attention heads. Required without `load`. Megatron: `--num-attention-heads`.
        num_attention_heads: Option<usize> = None,
        /// KV heads (GQA). Default: num_attention_heads (MHA). Megatron: `--num-query-groups`.
        num_query_groups: Option<usize> = None,
        /// Per-head dimension. Default: hidden_size / num_attention_heads. Megatron: `--kv-channels`.
        kv_channels: Option<usize> = None,
        /// Vocabulary size (tokens). Required without `load`. Megatron: `--vocab-size`.
        vocab_size: Option<usize> = None,
        /// Training sequence length in tokens. Required. Megatron: `--seq-length`.
        seq_length: Option<usize> = None,
        /// Longest position the model supports. Default: seq_length.
        /// Megatron: `--max-position-embeddings`.
        max_position_embeddings: Option<usize> = None,
        /// RoPE base (theta). Default: 10000. Megatron: `--rotary-base`.
        rotary_base: f64 = 10000.0,
        /// Norm epsilon (OLMo's is fixed at 1e-5). Default: 1e-5. Megatron: `--norm-epsilon`.
        norm_epsilon: f64 = 1e-5,
        /// Std of the normal init of a model built from the keys above (output projections:
        /// std / sqrt(2 x num_layers)); unused with `load`. Default: 0.02. Megatron:
        /// `--init-method-std`.
        init_method_std: f64 = 0.02,
        /// Use a separate output projection instead of the tied embedding. Default: false.
        /// Megatron: `--untie-embeddings-and-output-weights`.
        untie_embeddings_and_output_weights: bool = false,
        /// Pad the vocabulary to a multiple of this x tensor_model_parallel_size rows when
        /// the embedding is split over tensor-parallel ranks (the padded ids never enter the
        /// loss). Default: 128. Megatron: `--make-vocab-size-divisible-by`.
        make_vocab_size_divisible_by: usize = 128,
    }
}

section! {
    /// `[data]`: datasets, blending and batching of samples.
    DataSection, "data" {
        /// Blend `"W1 PREFIX1 W2 PREFIX2"` or a single prefix (string or list). `gpt`/`sft_mmap`:
        /// `PREFIX.bin` + `PREFIX.idx` must exist; `sft_raw`: JSONL files. Required.
        /// Megatron: `--data-path`.
        data_path: Option<DataPath> = None,
        /// Train/valid/test split weights. Default: "969,30,1". Megatron: `--split`.
        split: String = "969,30,1".to_string(),
        /// "gpt" (pretraining on indexed data), "sft_raw" (chat JSONL), "sft_mmap"
        /// (pre-tokenised SFT), "dpo" (preference pairs: JSONL with prompt / chosen /
        /// rejected, plain or chat; see `[dpo]`) or "reward" (a reward model on the same
        /// pairs; see `[reward]`). Default: "gpt".
        dataset_type: String = "gpt".to_string(),
        /// Tokenizer (tokenizer.json or HF dir) for `sft_raw` and `dpo`. Default: unset (from `model.load`).
        /// Megatron: `--tokenizer-model`.
        tokenizer_model: Option<PathBuf> = None,
        /// Mask the loss on EOD tokens. Default: false. Megatron: `--eod-mask-loss`.
        eod_mask_loss: bool = false,
        /// Restart position ids after each EOD. Default: false. Megatron: `--reset-position-ids`.
        reset_position_ids: bool = false,
        /// Block attention across EOD boundaries. Default: false.
        /// Megatron: `--reset-attention-mask`.
        reset_attention_mask: bool = false,
        /// Seed for dataset shuffling. Default: 1234. Megatron: `--seed` (dataset part).
        seed: u64 = 1234,
        /// Directory for cached sample/shuffle indices. Default: unset (next to the data).
        /// Megatron: `--data-cache-path`.
        data_cache_path: Option<PathBuf> = None,
        /// Background loader threads. Default: 1. Megatron: `--num-workers`.
        num_workers: usize = 1,
        /// Batches prefetched per worker. Default: 2.
        prefetch: usize = 2,
    }
}

section! {
    /// `[training]`: batch sizes, length of the run, eval/log cadence, recompute.
    TrainingSection, "training" {
        /// Samples per forward/backward pass. Default: 1. Megatron: `--micro-batch-size`.
        micro_batch_size: usize = 1,
        /// Samples per optimizer step (gradient accumulation fills the rest). Default: unset =
        /// micro_batch_size x data_parallel_size. Megatron: `--global-batch-size`.
        global_batch_size: Option<usize> = None,
        /// Optimizer steps to run. Exactly one of train_iters / train_tokens.
        /// Megatron: `--train-iters`.
        train_iters: Option<u64> = None,
        /// Tokens to train on; converted to iterations of global_batch_size x seq_length.
        train_tokens: Option<u64> = None,
        /// Iterations between validation runs. Default: 1000. Megatron: `--eval-interval`.
        eval_interval: u64 = 1000,
        /// Validation batches per evaluation (0 disables). Default: 100. Megatron: `--eval-iters`.
        eval_iters: u64 = 100,
        /// Iterations between log lines. Default: 100. Megatron: `--log-interval`.
        log_interval: u64 = 100,
        /// Save (when checkpoint.save is set) and stop after the first iteration divisible by
        /// this; resume later with checkpoint.load. Default: unset. Megatron: `--exit-interval`.
        exit_interval: Option<u64> = None,
        /// Seed for weight init, dropout and sampling. Default: 1234. Megatron: `--seed`.
        seed: u64 = 1234,
        /// Activation recompute: "selective", "full" or unset (none).
        /// Megatron: `--recompute-granularity`.
        recompute_granularity: Option<String> = None,
        /// With "full": "uniform" or "block". Megatron: `--recompute-method`.
        recompute_method: Option<String> = None,
        /// With "full": layers per recompute group (uniform) or layers recomputed (block).
        /// Default: 1. Megatron: `--recompute-num-layers`.
        recompute_num_layers: Option<usize> = None,
        /// Load weights only from `checkpoint.load` (fresh optimizer, iteration 0).
        /// Default: false. Megatron: `--finetune`.
        finetune: bool = false,
        /// Do not train: run one validation (eval_iters global batches of the validation
        /// split) on the loaded model, report it and exit. Default: false.
        /// Megatron: `--skip-train`.
        skip_train: bool = false,
        /// Average the loss over non-masked tokens of the global batch rather than per
        /// micro-batch. Default: false. Megatron: `--calculate-per-token-loss`.
        calculate_per_token_loss: bool = false,
    }
}

section! {
    /// `[optimizer]`: AdamW and the learning-rate schedule.
    OptimizerSection, "optimizer" {
        /// Peak learning rate. Required. Megatron: `--lr`.
        lr: Option<f64> = None,
        /// Floor of the decay. Default: 0.0. Megatron: `--min-lr`.
        min_lr: f64 = 0.0,
        /// "constant", "linear", "cosine", "inverse-square-root" or "WSD". Default: "linear".
        /// Megatron: `--lr-decay-style`.
        lr_decay_style: String = "linear".to_string(),
        /// Warmup length in iterations (at most one warmup unit). Default: 0.
        /// Megatron: `--lr-warmup-iters`.
        lr_warmup_iters: Option<u64> = None,
        /// Warmup length in samples. Megatron: `--lr-warmup-samples`.
        lr_warmup_samples: Option<u64> = None,
        /// Warmup length in tokens (converted with global_batch_size x seq_length).
        lr_warmup_tokens: Option<u64> = None,
        /// Iterations over which to decay. Default: train_iters. Megatron: `--lr-decay-iters`.
        lr_decay_iters: Option<u64> = None,
        /// Decoupled weight decay. Default: 0.01. Megatron: `--weight-decay`.
        weight_decay: f64 = 0.01,
        /// Adam beta1. Default: 0.9. Megatron: `--adam-beta1`.
        adam_beta1: f64 = 0.9,
        /// Adam beta2. Default: 0.999. Megatron: `--adam-beta2`.
        adam_beta2: f64 = 0.999,
        /// Adam epsilon. Default: 1e-8. Megatron: `--adam-eps`.
        adam_eps: f64 = 1e-8,
        /// Global gradient-norm clip (0 disables). Default: 1.0. Megatron: `--clip-grad`.
        clip_grad: f64 = 1.0,
        /// Where the optimizer state (Adam moments, fp32 master weights) lives, packed in
        /// chunks: "none" (RAM), "static" (optimizer_offload_fraction of the chunks in files
        /// under offload_path) or "auto" (as many chunks in RAM as
        /// offload_memory_budget_gib leaves beside the parameters, gradients and the
        /// measured activation peak). Training is bit-identical either way. Default: "none".
        /// Pai-Megatron-Patch: `--optimizer-offload-policy`.
        optimizer_offload_policy: String = "none".to_string(),
        /// With "static": the fraction of the chunks offloaded, in [0, 1]. Default: 1.0.
        /// Megatron: `--optimizer-offload-fraction`.
        optimizer_offload_fraction: f64 = 1.0,
        /// Directory of the offloaded chunks' file (removed when the run ends); required
        /// with an offload policy. Its free space is checked before training.
        offload_path: Option<PathBuf> = None,
        /// Elements per chunk and state array. Default: chosen in [2^23, 2^24] for the least
        /// wasted chunk space.
        offload_chunk_size: Option<usize> = None,
        /// With "auto": this rank's memory budget in GiB. Required with "auto".
        offload_memory_budget_gib: Option<f64> = None,
    }
}

section! {
    /// `[precision]`: compute dtype and the fp16 loss scaler.
    PrecisionSection, "precision" {
        /// bf16 weights and saved activations, bf16 x bf16 -> f32 matmuls, f32 gradients,
        /// master weights and Adam state; the master weights start from `model.load`'s
        /// values as loaded (f32), the model computes with their rounded copies. Default:
        /// false. Megatron: `--bf16`.
        bf16: bool = false,
        /// fp16 with dynamic loss scaling. Default: false. Megatron: `--fp16`.
        fp16: bool = false,
        /// Static loss scale (fp16); unset = dynamic. Megatron: `--loss-scale`.
        loss_scale: Option<f64> = None,
        /// Starting dynamic loss scale. Default: 4294967296 (2^32).
        /// Megatron: `--initial-loss-scale`.
        initial_loss_scale: f64 = 4294967296.0,
        /// Lowest dynamic loss scale. Default: 1.0. Megatron: `--min-loss-scale`.
        min_loss_scale: f64 = 1.0,
        /// Clean iterations before the scale grows. Default: 1000.
        /// Megatron: `--loss-scale-window`.
        loss_scale_window: u64 = 1000,
        /// Overflowing iterations tolerated before the scale shrinks. Default: 2.
        /// Megatron: `--hysteresis`.
        hysteresis: u64 = 2,
    }
}

section! {
    /// `[parallel]`: how the ranks of a run split the model and the data (Megatron's
    /// distributed arguments). The ranks are `tp x cp x pp x dp`: threads of this process by
    /// default, or the processes of `mpirun` with `ferrotron train --dist-backend mpi`.
    ParallelSection, "parallel" {
        /// Data-parallel replicas. Default: unset = 1 in-process, or what `mpirun -np` leaves
        /// after the model-parallel sizes. Megatron derives it from the world size.
        data_parallel_size: Option<usize> = None,
        /// Ranks splitting each layer (attention heads, MLP columns). Default: 1.
        /// Megatron: `--tensor-model-parallel-size`.
        tensor_model_parallel_size: usize = 1,
        /// Pipeline stages splitting the layers. Default: 1.
        /// Megatron: `--pipeline-model-parallel-size`.
        pipeline_model_parallel_size: usize = 1,
        /// Layers of the first pipeline stage when they do not split evenly (the other stages
        /// share the rest equally). Default: unset (even split).
        /// Megatron: `--decoder-first-pipeline-num-layers`.
        decoder_first_pipeline_num_layers: Option<usize> = None,
        /// Model chunks per pipeline stage (interleaved 1F1B). Default: unset (1).
        /// Megatron: `--virtual-pipeline-model-parallel-size`.
        virtual_pipeline_model_parallel_size: Option<usize> = None,
        /// Ranks splitting the sequence in attention. Default: 1.
        /// Megatron: `--context-parallel-size`. Each rank holds two of the sequence's 2 x cp
        /// chunks (load-balanced under the causal mask); seq_length must divide by 2 x cp.
        context_parallel_size: usize = 1,
        /// How attention reaches the other context-parallel ranks' keys and values: "p2p"
        /// (a ring, each transfer overlapped with a block's compute), "all_gather" (the whole
        /// sequence's keys and values gathered once) or "a2a" (all-to-all to a head split,
        /// DeepSpeed-Ulysses: the heads and query groups per tensor-parallel rank must divide
        /// by cp). Default: "p2p". Megatron: `--cp-comm-type`.
        cp_comm_type: String = "p2p".to_string(),
        /// Ranks splitting the experts of MoE layers. Default: 1.
        /// Megatron: `--expert-model-parallel-size`.
        expert_model_parallel_size: usize = 1,
        /// Tensor-parallel ranks splitting each expert's width: tensor_model_parallel_size
        /// (every expert split, every rank runs every routed row) or 1 (each rank holds its
        /// experts whole and runs them over its share of the rows, its sequence-parallel
        /// rows; the gradients summed over the tensor-parallel ranks). Default:
        /// tensor_model_parallel_size. Megatron: `--expert-tensor-parallel-size` (whose
        /// parallel folding may also place the expert-parallel ranks across the
        /// tensor-parallel ones; here they are always data-parallel ranks).
        expert_tensor_parallel_size: Option<usize> = None,
        /// Shard norms and dropout along the sequence over the tensor-parallel ranks.
        /// Default: false. Megatron: `--sequence-parallel`.
        sequence_parallel: bool = false,
        /// Shard the fp32 master weights and Adam moments over the data-parallel ranks
        /// (ZeRO-1). Default: false. Megatron: `--use-distributed-optimizer`.
        use_distributed_optimizer: bool = false,
        /// What the data-parallel ranks shard: "no_shard", "optim" (ZeRO-1: the optimizer
        /// state, as use_distributed_optimizer), "optim_grads" (ZeRO-2: also the gradients,
        /// reduce-scattered after every micro-batch's backward) or "optim_grads_params"
        /// (ZeRO-3: also the weights, all-gathered per transformer layer just before its
        /// forward and backward, the next layer's gather prefetched). Default: unset =
        /// "optim" with use_distributed_optimizer, else "no_shard". Megatron:
        /// `--data-parallel-sharding-strategy` (Megatron-FSDP).
        data_parallel_sharding_strategy: Option<String> = None,
        /// Gradient elements per DDP bucket. Default: unset = max(4e7, 1e6 x dp).
        /// Megatron: `--ddp-bucket-size`.
        ddp_bucket_size: Option<usize> = None,
        /// Reduce each gradient bucket while the backward still runs. Default: false.
        /// Megatron: `--overlap-grad-reduce`.
        overlap_grad_reduce: bool = false,
        /// Reduce gradients over data-parallel ranks in f32; false sends them as bf16 (half
        /// the traffic, each rank's part rounded once). Default: true.
        /// Megatron: `grad_reduce_in_fp32` (DDP config).
        grad_reduce_in_fp32: bool = true,
        /// All-gather updated parameters bucket by bucket during the next forward
        /// (distributed optimizer). Default: false. Megatron: `--overlap-param-gather`.
        overlap_param_gather: bool = false,
    }
}

section! {
    /// `[checkpoint]`: saving, resuming and exporting.
    CheckpointSection, "checkpoint" {
        /// Directory to save checkpoints into. Default: unset (no saving). Megatron: `--save`.
        save: Option<PathBuf> = None,
        /// Iterations between saves (a final save is always made). Megatron: `--save-interval`.
        save_interval: Option<u64> = None,
        /// Checkpoint directory to resume from (may be absent unless `training.finetune`).
        /// Megatron: `--load`.
        load: Option<PathBuf> = None,
        /// Keep only the newest K checkpoints. Default: unset (keep all).
        keep_last: Option<usize> = None,
        /// Export the final model as an HF directory here (a LoRA run's adapters merged into
        /// the base weights, NeMo's `LoRAMerge`). Default: unset.
        export_hf: Option<PathBuf> = None,
        /// A LoRA run: export the final adapters as a HuggingFace PEFT directory here
        /// (`adapter_config.json` + `adapter_model.safetensors`, which
        /// `peft.PeftModel.from_pretrained` loads onto the base). Default: unset.
        export_peft: Option<PathBuf> = None,
    }
}

section! {
    /// `[lora]`: LoRA fine-tuning (NeMo's `LoRA` transform,
    /// `nemo/collections/llm/peft/lora.py`): adapters on the targeted linear layers, every
    /// other parameter frozen (no gradient, no optimizer state; checkpoints hold the adapters).
    LoraSection, "lora" {
        /// Train LoRA adapters on the base of `model.load` instead of the whole model.
        /// Default: false.
        enabled: bool = false,
        /// The linear layers that get an adapter: `linear_qkv`, `linear_proj`, `linear_fc1`,
        /// `linear_fc2` (in every layer), or whole Megatron module names with `*` wildcards
        /// (e.g. "*.layers.0.*.linear_qkv"). Default: all four (NeMo's).
        target_modules: Vec<String> = ferrotron_model::lora::LORA_MODULES
            .iter()
            .map(|m| m.to_string())
            .collect(),
        /// Adapter rank (NeMo `dim`, PEFT `r`). Default: 32 (NeMo's).
        rank: usize = 32,
        /// Scale numerator: adapter outputs are multiplied by alpha / rank. Default: 32
        /// (NeMo's).
        alpha: f64 = 32.0,
        /// Dropout on the adapter input in training steps (PEFT's `lora_dropout`), in
        /// [0, 1); masks keyed by `training.seed`, the iteration and each sample, the same
        /// under every parallel layout. Default: 0.0 (NeMo's).
        dropout: f64 = 0.0,
        /// Start from this HuggingFace PEFT adapter directory (its targets, rank, alpha and
        /// values) instead of fresh adapters (`linear_in` Xavier-normal from
        /// `training.seed`, `linear_out` zeros). Default: unset.
        adapter: Option<PathBuf> = None,
    }
}

section! {
    /// `[logging]`: where metrics go.
    LoggingSection, "logging" {
        /// Run directory for metrics.jsonl, loss.png and TensorBoard. Default: "output".
        output_dir: PathBuf = PathBuf::from("output"),
        /// Write TensorBoard event files to OUTPUT/tensorboard. Default: true.
        /// Megatron: `--tensorboard-dir`.
        tensorboard: bool = true,
    }
}

section! {
    /// `[dpo]`: direct preference optimization (TRL's `DPOTrainer`, `loss_type = "sigmoid"`)
    /// when `data.dataset_type = "dpo"`. `training.micro_batch_size` and
    /// `global_batch_size` count pairs (two rows each, as TRL's batch sizes do).
    DpoSection, "dpo" {
        /// β, the strength of the implicit KL penalty. Default: 0.1 (TRL's).
        beta: f64 = 0.1,
        /// ε of the conservative DPO loss, in [0, 0.5). Default: 0.0 (TRL's).
        label_smoothing: f64 = 0.0,
        /// Where the reference log-probs come from: "base" (the LoRA policy with its adapters
        /// disabled, TRL with PEFT), "frozen_copy" (a copy of the starting model, TRL's
        /// `ref_model`) or "auto" (base for LoRA runs, else frozen_copy). Default: "auto".
        reference: String = "auto".to_string(),
    }
}

section! {
    /// `[reward]`: a reward model (TRL's `RewardTrainer`, Bradley-Terry) when
    /// `data.dataset_type = "reward"`: the loaded causal LM gets a one-label score head (HF
    /// `...ForSequenceClassification`) read at each sequence's last token; the data is DPO's
    /// (prompt / chosen / rejected), batch sizes in pairs.
    RewardSection, "reward" {
        /// TRL's `center_rewards_coefficient`: adds `c·mean((r_c + r_r)²)` to keep rewards
        /// centred. Default: 0.0 (off, TRL's `None`).
        center_rewards_coefficient: f64 = 0.0,
    }
}

/// The whole `run.toml` as written (before validation); every section defaults to its defaults.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawConfig {
    /// `[model]`.
    pub model: ModelSection,
    /// `[data]`.
    pub data: DataSection,
    /// `[training]`.
    pub training: TrainingSection,
    /// `[optimizer]`.
    pub optimizer: OptimizerSection,
    /// `[precision]`.
    pub precision: PrecisionSection,
    /// `[parallel]`.
    pub parallel: ParallelSection,
    /// `[checkpoint]`.
    pub checkpoint: CheckpointSection,
    /// `[logging]`.
    pub logging: LoggingSection,
    /// `[lora]`.
    pub lora: LoraSection,
    /// `[dpo]`.
    pub dpo: DpoSection,
    /// `[reward]`.
    pub reward: RewardSection,
    /// `[moe]`.
    pub moe: super::moe::MoeSection,
    /// `[mla]`.
    pub mla: super::mla::MlaSection,
}

/// `(section, keys)` for every section, in file order.
pub const SECTIONS: &[(&str, &[(&str, &str)])] = &[
    (ModelSection::SECTION, ModelSection::KEYS),
    (DataSection::SECTION, DataSection::KEYS),
    (TrainingSection::SECTION, TrainingSection::KEYS),
    (OptimizerSection::SECTION, OptimizerSection::KEYS),
    (PrecisionSection::SECTION, PrecisionSection::KEYS),
    (ParallelSection::SECTION, ParallelSection::KEYS),
    (CheckpointSection::SECTION, CheckpointSection::KEYS),
    (LoggingSection::SECTION, LoggingSection::KEYS),
    (LoraSection::SECTION, LoraSection::KEYS),
    (DpoSection::SECTION, DpoSection::KEYS),
    (RewardSection::SECTION, RewardSection::KEYS),
    (
        super::moe::MoeSection::SECTION,
        super::moe::MoeSection::KEYS,
    ),
    (
        super::mla::MlaSection::SECTION,
        super::mla::MlaSection::KEYS,
    ),
];
