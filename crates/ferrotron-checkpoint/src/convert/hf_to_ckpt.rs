//! HF model directory -> a distributed checkpoint laid out for `t x p` ranks (Pai-Megatron-Patch
//! `hf2mcore`): q/k/v packed per query group into `linear_qkv`, gate/up into `linear_fc1`, each
//! tensor cut into the boxes tensor-parallel rank `r` of pipeline stage `s` holds and written
//! to `model_tp{r}_pp{s}.safetensors`, exactly as a training run under that layout saves them.
//! Streams one parameter at a time from the memory-mapped HF files.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ferrotron_model::families::{
    HfSafetensors, ParamDecl, WeightSource, param_mapping, parse_hf_config,
};
use ferrotron_model::module::{ExpertShard, ExpertTensorParallel, ModelLayout, ModelPart};
use ferrotron_model::{TpSplit, TransformerConfig, padded_vocab_size, stage_layers};
use ferrotron_tensor::DType;
use serde_json::{Value, json};

use super::assemble::{assemble, extract_box};
use super::{ConvertReport, MODEL_PREFIX, TOKENIZER_SUBDIR, expert_model_file};
use crate::dist::{
    CheckpointWriter, ParallelLayout, ShardSpec, StoredDtype, iteration_dir, write_tracker,
};
use crate::hf_export::read_json;
use crate::staging::StagingDir;
use crate::{CheckpointError, tokenizer_files};

/// Options of [`hf_to_ckpt`] (Megatron's names).
#[derive(Clone, Debug)]
pub struct HfToCkptOptions {
    /// `tensor_model_parallel_size` of the layout written.
    pub tensor_model_parallel_size: usize,
    /// `pipeline_model_parallel_size` of the layout written.
    pub pipeline_model_parallel_size: usize,
    /// Layers of the first pipeline stage (Megatron `decoder_first_pipeline_num_layers`);
    /// `None` splits evenly.
    pub decoder_first_pipeline_num_layers: Option<usize>,
    /// The vocabulary is padded (on load, by the training layout) to a multiple of this times
    /// `t`; recorded in the metadata. Megatron's default is 128.
    pub make_vocab_size_divisible_by: usize,
    /// Element type of the stored weights.
    pub dtype: StoredDtype,
    /// Replace a non-empty output directory.
    pub force: bool,
    /// `expert_model_parallel_size`: the routed experts of every MoE layer split over this
    /// many ranks, rank `e`'s in `model_tp{t}_pp{p}_ep{e}` files (rank 0's with the rest).
    pub expert_model_parallel_size: usize,
    /// How the tensor-parallel ranks hold the experts (`expert_tensor_parallel_size` = tp,
    /// or whole at 1).
    pub expert_tensor_parallel: ExpertTensorParallel,
}

impl Default for HfToCkptOptions {
    fn default() -> Self {
        HfToCkptOptions {
            tensor_model_parallel_size: 1,
            pipeline_model_parallel_size: 1,
            decoder_first_pipeline_num_layers: None,
            make_vocab_size_divisible_by: 128,
            dtype: StoredDtype::F32,
            force: false,
            expert_model_parallel_size: 1,
            expert_tensor_parallel: ExpertTensorParallel::Split,
        }
    }
}

/// One box of a parameter in the plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedShard {
    /// File it is written to (`model_tp00_pp000.safetensors`).
    pub file: String,
    /// Offset in the full tensor.
    pub global_offset: Vec<usize>,
    /// Shape of the box.
    pub shape: Vec<usize>,
}

/// One Megatron parameter of the plan: its HF sources and its shards.
#[derive(Clone, Debug)]
pub struct PlannedParam {
    /// Name, full shape, split and HF tensors.
    pub mapping: ParamDecl,
    /// The pipeline stage that stores it.
    pub stage: usize,
    /// Its boxes, one or more per tensor-parallel rank (replicated tensors: rank 0 only).
    pub shards: Vec<PlannedShard>,
}

/// What [`hf_to_ckpt`] would do: every parameter with its HF sources and shard boxes, and
/// every problem with the HF checkpoint (the `--dry-run` report).
#[derive(Clone, Debug)]
pub struct HfToCkptPlan {
    /// The model's config.
    pub config: TransformerConfig,
    /// The source `config.json`.
    pub hf_config: Value,
    /// Every parameter, in [`ferrotron_model::GptModel::parameters`] order.
    pub params: Vec<PlannedParam>,
    /// HF tensors the mapping needs that the checkpoint lacks.
    pub missing: Vec<String>,
    /// HF tensors of the checkpoint nothing maps (buffers such as `rotary_emb.inv_freq`
    /// excepted, listed in `ignored`).
    pub unused: Vec<String>,
    /// HF tensors present with another shape (`name: got [..], expected [..]`).
    pub shape_mismatches: Vec<String>,
    /// HF tensors that carry no parameters and are skipped.
    pub ignored: Vec<String>,
    /// The files each rank's shards go to.
    pub files: Vec<String>,
}

impl HfToCkptPlan {
    /// Every problem, one line each (empty when the conversion can run).
    pub fn problems(&self) -> Vec<String> {
        let missing = self
            .missing
            .iter()
            .map(|n| format!("missing HF tensor {n}"));
        let unused = self.unused.iter().map(|n| format!("unused HF tensor {n}"));
        let shapes = self
            .shape_mismatches
            .iter()
            .map(|m| format!("HF tensor {m}"));
        missing.chain(unused).chain(shapes).collect()
    }
}

/// A [`CheckpointError::Format`] naming `dir`.
pub(super) fn err(dir: &Path, detail: impl Into<String>) -> CheckpointError {
    CheckpointError::Format {
        file: dir.display().to_string(),
        detail: detail.into(),
    }
}

/// Plans the conversion of the HF directory `hf` under `opts` (reads `config.json` and the
/// safetensors headers only).
///
/// # Errors
/// An unreadable `config.json` or safetensors header, or a layout the model cannot take
/// (heads, query groups or FFN size not divisible by `t`, layers not splitting over `p`),
/// every problem named.
pub fn plan_hf_to_ckpt(hf: &Path, opts: &HfToCkptOptions) -> Result<HfToCkptPlan, CheckpointError> {
    open_and_plan(hf, opts).map(|(plan, _)| plan)
}

/// The plan for the HF directory `hf` and its opened (memory-mapped) weights.
fn open_and_plan(
    hf: &Path,
    opts: &HfToCkptOptions,
) -> Result<(HfToCkptPlan, HfSafetensors), CheckpointError> {
    let config_path = hf.join("config.json");
    let hf_config = read_json(&config_path)?;
    let config = parse_hf_config(&hf_config)
        .map_err(|e| err(&config_path, e.to_string()))?
        .config;
    let src = HfSafetensors::open(hf, DType::F32).map_err(|e| err(hf, e.to_string()))?;
    let available = src.tensor_shapes().into_iter().collect();
    Ok((plan_layout(hf, config, hf_config, available, opts)?, src))
}

/// The plan for a model of `config` whose HF tensors (name -> shape) are `available`, read
/// from `origin` (named in errors).
pub(super) fn plan_layout(
    origin: &Path,
    config: TransformerConfig,
    hf_config: Value,
    mut available: BTreeMap<String, Vec<usize>>,
    opts: &HfToCkptOptions,
) -> Result<HfToCkptPlan, CheckpointError> {
    let (t, p) = (
        opts.tensor_model_parallel_size,
        opts.pipeline_model_parallel_size,
    );
    let stages = layout_stages(origin, &config, opts)?;
    let padded = padded_vocab_size(
        config.vocab_size,
        opts.make_vocab_size_divisible_by.max(1),
        t,
    );
    let mapping = param_mapping(&config, padded).map_err(|e| err(origin, e.to_string()))?;
    // Each expert-parallel rank's layout: its experts' rows, split or whole over tp.
    let ep = opts.expert_model_parallel_size;
    let ep_layouts: Vec<ModelLayout> = (0..ep)
        .map(|rank| {
            let mut part = ModelPart::whole(config.num_layers);
            part.experts = (ep > 1).then_some(ExpertShard { rank, size: ep });
            part.expert_tp = opts.expert_tensor_parallel;
            ModelLayout::new(&config, padded, &part)
        })
        .collect();
    let experts: Vec<usize> = ep_layouts[0].expert_stacks().collect();
    let (mut missing, mut shape_mismatches) = (Vec::new(), Vec::new());
    let mut params = Vec::with_capacity(mapping.len());
    let mut files = Vec::new();
    for (i, m) in mapping.into_iter().enumerate() {
        check_hf_sources(&m, &mut available, &mut missing, &mut shape_mismatches);
        let stage = (0..p)
            .find(|&s| m.on_stage(s, p, &stages[s]))
            .expect("every parameter has a stage");
        // An expert stack: each expert-parallel rank's rows; anything else: rank 0's.
        let ranks = if experts.contains(&i) { 0..ep } else { 0..1 };
        let shards = ranks
            .flat_map(|e| plan_shards(&ep_layouts[e].decls()[i], t, stage, e, &mut files))
            .collect();
        params.push(PlannedParam {
            mapping: m,
            stage,
            shards,
        });
    }
    let (ignored, unused): (Vec<String>, Vec<String>) = available
        .into_keys()
        .partition(|n| n.ends_with("rotary_emb.inv_freq"));
    files.sort();
    Ok(HfToCkptPlan {
        config,
        hf_config,
        params,
        missing,
        unused,
        shape_mismatches,
        ignored,
        files,
    })
}

/// Checks that `config` fits `opts`' layout and returns each pipeline stage's layers; every
/// problem is named in the error.
fn layout_stages(
    origin: &Path,
    config: &TransformerConfig,
    opts: &HfToCkptOptions,
) -> Result<Vec<std::ops::Range<usize>>, CheckpointError> {
    let (t, p) = (
        opts.tensor_model_parallel_size,
        opts.pipeline_model_parallel_size,
    );
    let mut problems = Vec::new();
    if t == 0 || p == 0 {
        problems.push(
            "tensor_model_parallel_size and pipeline_model_parallel_size must be >= 1".into(),
        );
    }
    for (name, n) in [
        ("num_attention_heads", config.num_attention_heads),
        ("num_query_groups", config.num_query_groups),
        ("ffn_hidden_size", config.ffn_hidden_size),
    ] {
        if t > 0 && !n.is_multiple_of(t) {
            problems.push(format!(
                "{name} ({n}) is not divisible by tensor_model_parallel_size ({t})"
            ));
        }
    }
    problems.extend(expert_problems(config, opts));
    let stages: Vec<std::ops::Range<usize>> = (0..p)
        .map(|s| {
            stage_layers(
                config.num_layers,
                p,
                s,
                opts.decoder_first_pipeline_num_layers,
            )
        })
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| {
            problems.push(e.to_string());
            Vec::new()
        });
    if !problems.is_empty() {
        return Err(err(origin, problems.join("; ")));
    }
    Ok(stages)
}

/// What the expert layout asks of the model: MoE layers, experts splitting evenly over the
/// expert-parallel ranks, expert widths dividing by tp when split.
fn expert_problems(config: &TransformerConfig, opts: &HfToCkptOptions) -> Vec<String> {
    let (t, ep) = (
        opts.tensor_model_parallel_size,
        opts.expert_model_parallel_size,
    );
    let whole = opts.expert_tensor_parallel == ExpertTensorParallel::Whole;
    let Some(moe) = &config.moe else {
        return match (ep, whole) {
            (1, false) => Vec::new(),
            _ => vec![
                "expert_model_parallel_size / expert_tensor_parallel_size: the model has \
                       no MoE layers"
                    .into(),
            ],
        };
    };
    let mut problems = Vec::new();
    if ep == 0 || !moe.num_experts().is_multiple_of(ep) {
        problems.push(format!(
            "num_experts ({}) is not divisible by expert_model_parallel_size ({ep})",
            moe.num_experts()
        ));
    }
    let widths = [
        Some(("moe_ffn_hidden_size", moe.moe_ffn_hidden_size)).filter(|_| !whole),
        moe.shared_expert_intermediate_size
            .map(|f| ("moe_shared_expert_intermediate_size", f)),
    ];
    for (name, n) in widths.into_iter().flatten() {
        if t > 0 && !n.is_multiple_of(t) {
            problems.push(format!(
                "{name} ({n}) is not divisible by tensor_model_parallel_size ({t})"
            ));
        }
    }
    problems
}

/// Takes `m`'s HF tensors out of `available`, recording the missing and misshapen ones.
fn check_hf_sources(
    m: &ParamDecl,
    available: &mut BTreeMap<String, Vec<usize>>,
    missing: &mut Vec<String>,
    shape_mismatches: &mut Vec<String>,
) {
    for part in &m.hf {
        match available.remove(&part.name) {
            None => missing.push(part.name.clone()),
            Some(shape) if shape != part.shape => shape_mismatches.push(format!(
                "{}: got {shape:?}, expected {:?}",
                part.name, part.shape
            )),
            Some(_) => {}
        }
    }
}

/// The boxes of `m` (expert-parallel rank `ep`'s declaration: an expert stack's rows are
/// that rank's, at row `ep·rows` of the whole stack) on pipeline stage `stage` for each
/// tensor-parallel rank of `t` (rank 0 only when replicated), adding each rank's file to
/// `files` on first use.
fn plan_shards(
    m: &ParamDecl,
    t: usize,
    stage: usize,
    ep: usize,
    files: &mut Vec<String>,
) -> Vec<PlannedShard> {
    let ranks = if m.split == TpSplit::Replicated { 1 } else { t };
    let local = m.split.local_shape(&m.shape, t).iter().product::<usize>();
    let mut shards = Vec::new();
    for r in 0..ranks {
        let file = expert_model_file(r, stage, ep);
        if !files.contains(&file) {
            files.push(file.clone());
        }
        for mut b in m.split.boxes(&m.shape, t, r, 0..local) {
            b.global_offset[0] += ep * m.shape[0];
            shards.push(PlannedShard {
                file: file.clone(),
                global_offset: b.global_offset,
                shape: b.shape,
            });
        }
    }
    shards
}

/// Converts the HF directory `hf` into the checkpoint directory `output`
/// (`output/iter_0000000/` + `latest_checkpointed_iteration.txt`, loadable by `ferrotron
/// train` as `checkpoint.load` or `model.load`), laid out for `opts`' tensor- and
/// pipeline-parallel sizes; the tokenizer files are copied into `iter_0000000/tokenizer/`.
/// Everything is staged and renamed at the end. Memory: one parameter (f32) plus one box.
///
/// # Errors
/// Every problem of [`plan_hf_to_ckpt`] (missing, unused or misshapen HF tensors, listed);
/// an existing non-empty `output` without `opts.force`; I/O failures (nothing then appears
/// under `output`).
pub fn hf_to_ckpt(
    hf: &Path,
    output: &Path,
    opts: &HfToCkptOptions,
) -> Result<ConvertReport, CheckpointError> {
    let start = std::time::Instant::now();
    let (plan, mut src) = open_and_plan(hf, opts)?;
    let generation_path = hf.join("generation_config.json");
    let extras = LayoutExtras {
        origin: hf,
        generation_config: generation_path
            .is_file()
            .then(|| read_json(&generation_path))
            .transpose()?,
        tokenizer_dir: Some(hf.to_path_buf()),
    };
    write_layout(&plan, &mut src, &extras, output, opts, start)
}

/// What a written checkpoint carries besides the weights.
pub(super) struct LayoutExtras<'a> {
    /// Where the weights come from (named in errors, recorded as `converted_from`).
    pub origin: &'a Path,
    /// Stored as `content.generation_config`.
    pub generation_config: Option<Value>,
    /// The tokenizer files found here are copied into `tokenizer/`.
    pub tokenizer_dir: Option<PathBuf>,
}

/// Writes the checkpoint of `plan` at `output` (staged; `iter_0000000` + tracker) from the
/// HF-named tensors of `src`, one parameter at a time.
pub(super) fn write_layout(
    plan: &HfToCkptPlan,
    src: &mut dyn WeightSource,
    extras: &LayoutExtras<'_>,
    output: &Path,
    opts: &HfToCkptOptions,
    start: std::time::Instant,
) -> Result<ConvertReport, CheckpointError> {
    let problems = plan.problems();
    if !problems.is_empty() {
        return Err(err(extras.origin, problems.join("; ")));
    }
    let root = StagingDir::create(output, opts.force)?;
    let iter_dir = iteration_dir(root.path(), 0);
    let mut writer = CheckpointWriter::create(&iter_dir, false)?;
    let mut bytes = 0u64;
    for stage in 0..opts.pipeline_model_parallel_size {
        bytes += write_stage(plan, src, extras.origin, &mut writer, stage, opts)?;
    }
    for path in extras.tokenizer_dir.iter().flat_map(|d| tokenizer_files(d)) {
        let name = crate::error::display_name(&path);
        bytes += writer.copy_file(&path, &format!("{TOKENIZER_SUBDIR}/{name}"))?;
    }
    let content = json!({
        "hf_config": plan.hf_config,
        "generation_config": extras.generation_config,
        "converted_from": absolute(extras.origin).display().to_string(),
        "make_vocab_size_divisible_by": opts.make_vocab_size_divisible_by,
    });
    let layout = ParallelLayout {
        tensor_model_parallel_size: opts.tensor_model_parallel_size,
        pipeline_model_parallel_size: opts.pipeline_model_parallel_size,
        data_parallel_size: 1,
        expert_model_parallel_size: opts.expert_model_parallel_size,
        expert_tensor_parallel_size: match opts.expert_tensor_parallel {
            ExpertTensorParallel::Split => None,
            ExpertTensorParallel::Whole => Some(1),
        },
        context_parallel_size: 1,
    };
    writer.commit(0, layout, content)?;
    write_tracker(root.path(), 0)?;
    root.commit()?;
    Ok(ConvertReport {
        output: output.to_path_buf(),
        tensors: plan.params.len(),
        files: plan.files.clone(),
        bytes_written: bytes,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Writes every rank's file of pipeline stage `stage`, one parameter at a time; returns the
/// bytes written.
fn write_stage(
    plan: &HfToCkptPlan,
    src: &mut dyn WeightSource,
    origin: &Path,
    writer: &mut CheckpointWriter,
    stage: usize,
    opts: &HfToCkptOptions,
) -> Result<u64, CheckpointError> {
    let on_stage: Vec<&PlannedParam> = plan.params.iter().filter(|p| p.stage == stage).collect();
    let mut names: Vec<&String> = on_stage
        .iter()
        .flat_map(|p| p.shards.iter().map(|s| &s.file))
        .collect();
    names.sort();
    names.dedup();
    let mut files = Vec::new();
    for name in names {
        let specs = shard_specs(&on_stage, name);
        files.push((name.clone(), writer.open_file(name, opts.dtype, &specs)?));
    }
    for p in &on_stage {
        let full = assemble(src, &p.mapping, origin)?;
        for s in &p.shards {
            let (_, file) = files
                .iter_mut()
                .find(|(n, _)| *n == s.file)
                .expect("a file per rank holding shards");
            file.push(&extract_box(
                &full,
                &p.mapping.shape,
                &s.global_offset,
                &s.shape,
            ))?;
        }
    }
    let mut bytes = 0u64;
    for (_, file) in files {
        bytes += file.finish()?;
    }
    Ok(bytes)
}

/// The shard specs of the `on_stage` parameters' boxes that go to the file `name`.
fn shard_specs(on_stage: &[&PlannedParam], name: &str) -> Vec<ShardSpec> {
    on_stage
        .iter()
        .flat_map(|p| {
            p.shards
                .iter()
                .filter(|s| s.file == name)
                .map(|s| ShardSpec {
                    key: format!("{MODEL_PREFIX}{}", p.mapping.name),
                    global_shape: p.mapping.shape.clone(),
                    global_offset: s.global_offset.clone(),
                    local_shape: s.shape.clone(),
                })
        })
        .collect()
}

/// `path` made absolute (as given when that fails).
fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}
