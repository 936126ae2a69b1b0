//! `convert ... --check`: runs one prompt through the HF directory's model (one rank) and
//! through the checkpoint's model at the layout it was written for (its tensor x pipeline
//! ranks in-process, each loading only its own boxes), and reports per decoder layer the
//! max |diff| of the hidden states and how many elements differ by more than 1e-5, then the
//! same for the logits (Pai-Megatron-Patch's `check_hf_mg_forward`).

use anyhow::{Context, Result, bail};
use ferrotron_checkpoint::convert::{MODEL_PREFIX, stored_hf_config};
use ferrotron_checkpoint::dist::CheckpointReader;
use ferrotron_comm::{
    Collectives, LocalComm, ParallelConfig, ParallelState, ProcessGroups, run_local,
    threads_per_rank,
};
use ferrotron_data::Tokenizer;
use ferrotron_model::families::{load_hf_model, parse_hf_config};
use ferrotron_model::module::ExpertTensorParallel;
use ferrotron_model::{ForwardTrace, GptModel, InitConfig, TpSplit, TrainBatch};
use ferrotron_tensor::DType;
use ferrotron_train::{ParallelizeOptions, parallelize};
use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;

/// The check's prompt when none is given.
pub const DEFAULT_PROMPT: &str = "In the beginning God created the heaven and the earth.";

/// Elements differing by more than this are counted (Pai's report).
const COUNT_ABOVE: f32 = 1e-5;

/// One compared tensor.
struct Diff {
    name: String,
    max_abs: f32,
    /// Largest |value| of the reference (the scale the difference is judged against).
    scale: f32,
    above: usize,
    numel: usize,
}

impl Diff {
    /// `max |diff| / max |reference|`: hidden states of real models carry outliers of 1e4
    /// and more, where one f32 rounding step is already above 1e-3.
    fn relative(&self) -> f32 {
        if self.scale > 0.0 {
            self.max_abs / self.scale
        } else {
            self.max_abs
        }
    }
}

fn diff(name: String, reference: &[f32], b: &[f32]) -> Diff {
    let (mut max_abs, mut scale, mut above) = (0f32, 0f32, 0);
    for (x, y) in reference.iter().zip(b) {
        let d = (x - y).abs();
        // NaN on either side counts as the worst difference.
        let d = if d.is_nan() { f32::INFINITY } else { d };
        max_abs = max_abs.max(d);
        scale = scale.max(x.abs());
        above += usize::from(d > COUNT_ABOVE);
    }
    Diff {
        name,
        max_abs,
        scale,
        above,
        numel: reference.len(),
    }
}

/// Token ids of `prompt` with the tokenizer of `tokenizer_dir`, or, without one, a fixed
/// sequence of ids below `vocab`.
fn prompt_tokens(prompt: &str, tokenizer_dir: Option<&Path>, vocab: usize) -> Result<Vec<u32>> {
    if let Some(dir) = tokenizer_dir.filter(|d| d.join("tokenizer.json").is_file()) {
        let tok =
            Tokenizer::from_dir(dir).with_context(|| format!("tokenizer {}", dir.display()))?;
        let ids = tok.encode(prompt, true)?;
        if ids.is_empty() {
            bail!("--prompt encodes to no tokens");
        }
        return Ok(ids);
    }
    eprintln!("note: no tokenizer.json: checking with 16 fixed token ids instead of --prompt");
    Ok((0..16u32).map(|i| (i * 7 + 3) % vocab as u32).collect())
}

/// Runs the check and prints the report; returns whether every tensor's max |diff|, relative
/// to its largest reference value, is within `tolerance` and every position's argmax agrees.
///
/// # Errors
/// Unreadable inputs, a checkpoint whose layout the model cannot take, a failed rank.
pub fn check_forward(hf_dir: &Path, ckpt_dir: &Path, prompt: &str, tolerance: f32) -> Result<bool> {
    let (reference, _) = load_hf_model(hf_dir, DType::F32)
        .with_context(|| format!("--check: loading {}", hf_dir.display()))?;
    let tokens = prompt_tokens(prompt, Some(hf_dir), reference.config().vocab_size)?;
    let seq = tokens.len();
    let labels = vec![0i64; seq];
    let batch = TrainBatch::from_batch_major(&tokens, &labels, None, 1, seq);
    let want = reference.forward_trace(&batch, None)?;
    drop(reference);
    let (layers, logits) = sharded_forward(ckpt_dir, &batch)?;

    let h = want.layer_outputs.first().map_or(0, |x| x.len() / seq);
    println!(
        "check: {seq} prompt tokens through {} (1 rank) and {} (its layout); hidden {h}",
        hf_dir.display(),
        ckpt_dir.display()
    );
    let mut diffs: Vec<Diff> = want
        .layer_outputs
        .iter()
        .zip(&layers)
        .enumerate()
        .map(|(i, (a, b))| diff(format!("layer {i:>3} output"), a, b))
        .collect();
    let v = logits.len() / seq;
    let reference_logits = want.logits.as_deref().unwrap_or_default();
    diffs.push(diff("logits".into(), &reference_logits[..seq * v], &logits));
    println!(
        "{:<18} {:>11} {:>11} {:>10} {:>20}",
        "tensor",
        "max |diff|",
        "max |ref|",
        "relative",
        format!("|diff| > {COUNT_ABOVE:e}")
    );
    let mut ok = layers.len() == want.layer_outputs.len();
    for d in &diffs {
        let pass = d.relative() <= tolerance;
        println!(
            "{:<18} {:>11.3e} {:>11.3e} {:>10.2e} {:>9} of {:<9}{}",
            d.name,
            d.max_abs,
            d.scale,
            d.relative(),
            d.above,
            d.numel,
            if pass { "" } else { "  <-- above tolerance" }
        );
        ok &= pass;
    }
    let argmax = |x: &[f32]| {
        x.chunks(v)
            .map(|row| {
                row.iter()
                    .enumerate()
                    .fold((0, f32::MIN), |b, (i, &y)| if y > b.1 { (i, y) } else { b })
                    .0
            })
            .collect::<Vec<_>>()
    };
    let same_argmax = argmax(&reference_logits[..seq * v]) == argmax(&logits);
    println!(
        "argmax of every position {}; tolerance {tolerance:e}: {}",
        if same_argmax { "agrees" } else { "DIFFERS" },
        if ok && same_argmax { "PASS" } else { "FAIL" }
    );
    Ok(ok && same_argmax)
}

/// The layer outputs (`[s, h]` each) and logits (`[s, v]`, padding stripped) of the
/// checkpoint's model run at its saved layout.
fn sharded_forward(ckpt_dir: &Path, batch: &TrainBatch) -> Result<(Vec<Vec<f32>>, Vec<f32>)> {
    let reader = CheckpointReader::open(ckpt_dir)?;
    let meta = reader.metadata();
    let hf_config = stored_hf_config(&meta.content)
        .context("--check: the checkpoint's metadata holds no hf_config")?;
    let config = parse_hf_config(hf_config)?.config;
    let (t, p, ep) = (
        meta.parallel.tensor_model_parallel_size,
        meta.parallel.pipeline_model_parallel_size,
        meta.parallel.expert_model_parallel_size,
    );
    let experts = match meta.parallel.expert_tensor_parallel_size {
        Some(1) if t > 1 => ExpertTensorParallel::Whole,
        _ => ExpertTensorParallel::Split,
    };
    let divisible_by = meta
        .content
        .get("make_vocab_size_divisible_by")
        .and_then(|v| v.as_u64())
        .unwrap_or(128) as usize;
    let vocab = config.vocab_size;
    let skeleton = GptModel::init_random(config, InitConfig::default())?;
    // Expert parallelism runs over data-parallel ranks: `ep` copies of the tp x pp grid.
    let world = t * p * ep;
    eprintln!(
        "check: running the checkpoint at tp {t} x pp {p} x ep {ep} ({world} in-process ranks, \
         {} threads each)",
        threads_per_rank(world)
    );
    let layout = CheckLayout {
        t,
        p,
        ep,
        experts,
        divisible_by,
        vocab,
        skeleton: &skeleton,
    };
    let traces = run_local(world, |comm| rank_trace(comm, &layout, &reader, batch))
        .map_err(|e| anyhow::anyhow!("--check: {e}"))?;
    let mut layers = Vec::new();
    let mut logits = Vec::new();
    for trace in traces.into_iter().flatten() {
        layers.extend(trace.layer_outputs);
        if let Some(l) = trace.logits {
            logits = l;
        }
    }
    Ok((layers, logits))
}

/// The layout the checkpoint's model runs at, and what every rank builds its part from.
struct CheckLayout<'a> {
    /// Tensor-parallel size.
    t: usize,
    /// Pipeline-parallel size.
    p: usize,
    /// Expert-parallel size (over as many data-parallel ranks, each running the prompt).
    ep: usize,
    /// How the tensor-parallel ranks hold the experts.
    experts: ExpertTensorParallel,
    /// Megatron's `make_vocab_size_divisible_by` the checkpoint was written with.
    divisible_by: usize,
    /// The unpadded vocabulary.
    vocab: usize,
    /// The full model's structure (its values are replaced by the checkpoint's).
    skeleton: &'a GptModel,
}

/// One rank's part of the check: its shard of the checkpoint's model, loaded from its own
/// boxes, runs the prompt (receiving from / sending to the neighbouring pipeline stages);
/// returns the trace on tensor-parallel rank 0 of data-parallel rank 0, logits gathered over
/// the vocabulary.
fn rank_trace(
    comm: LocalComm,
    layout: &CheckLayout<'_>,
    reader: &CheckpointReader,
    batch: &TrainBatch,
) -> Result<Option<ForwardTrace>> {
    let (t, p) = (layout.t, layout.p);
    let parallel = ParallelConfig {
        tensor_model_parallel_size: t,
        pipeline_model_parallel_size: p,
        expert_model_parallel_size: layout.ep,
        ..ParallelConfig::default()
    };
    let state = ParallelState::new(t * p * layout.ep, comm.world_rank(), parallel)?;
    let (stage, dp) = (state.coords().pp, state.coords().dp);
    let groups = ProcessGroups::new(state, Arc::new(comm))?;
    let options = ParallelizeOptions {
        make_vocab_size_divisible_by: layout.divisible_by,
        expert_tensor_parallel: layout.experts,
        ..ParallelizeOptions::default()
    };
    let mut shard = parallelize(Cow::Borrowed(layout.skeleton), &groups, &options)?;
    let values = shard
        .parameters()
        .iter()
        .enumerate()
        .map(|(i, info)| {
            let boxes = shard.param_boxes(i, 0..info.numel());
            let name = format!("{MODEL_PREFIX}{}", info.name);
            reader.read_local(&name, &boxes, info.numel())
        })
        .collect::<Result<Vec<_>, _>>()?;
    let views: Vec<&[f32]> = values.iter().map(Vec::as_slice).collect();
    shard.load_parameters_from(&views)?;
    let pipe = &groups.pipeline;
    let input = if stage > 0 {
        let mut x = vec![0f32; shard.activation_len(batch)?];
        pipe.recv(&mut x, stage - 1)?;
        Some(x)
    } else {
        None
    };
    let mut trace = shard.forward_trace(batch, input)?;
    if stage + 1 < p {
        let out = trace.layer_outputs.last().cloned().unwrap_or_default();
        pipe.send(&out, stage + 1)?;
    }
    if let Some(local) = trace.logits.take() {
        let mut all = vec![0f32; local.len() * t];
        groups.tensor.all_gather(&local, &mut all)?;
        trace.logits = Some(gather_vocab(&all, t, batch.tokens.len(), layout.vocab));
    }
    Ok((groups.tensor.rank() == 0 && dp == 0).then_some(trace))
}

/// Full `[rows, v]` logits from the tensor-parallel ranks' `[rows, v'/t]` shards laid end
/// to end (rank order): the column-parallel inverse, then the padding columns dropped.
fn gather_vocab(all: &[f32], t: usize, rows: usize, v: usize) -> Vec<f32> {
    let padded = all.len() / rows;
    let parts: Vec<&[f32]> = all.chunks_exact(all.len() / t).collect();
    TpSplit::Columns
        .unshard(&parts, &[rows, padded])
        .chunks_exact(padded)
        .flat_map(|row| row[..v].iter().copied())
        .collect()
}
