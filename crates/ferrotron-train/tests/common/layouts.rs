//! Parallel layouts of the tiny models for the layout tests: the Megatron sampler's share of
//! each rank, a [`Layout`] builder (tp x pp x dp ranks in-process), and run comparison.

use super::*;
use ferrotron_comm::{LocalComm, ParallelConfig, ParallelState, ProcessGroups, run_local};
use ferrotron_data::MicroBatch;
use ferrotron_train::trainer::{
    DataParallel, PipelineParallel, TrainError, Trainer, TrainerOptions,
};
use ferrotron_train::{ParallelizeOptions, parallelize};
use std::borrow::Cow;
use std::sync::Arc;

pub const MBS: usize = 2;
pub const GBS: usize = 8;
pub const ITERS: usize = 4;

/// Rank `r`'s micro-batches of global batch `it` (Megatron's sampler: micro-step `k` of the
/// step covers `mbs · dp` consecutive samples, rank `r` takes the `r`-th `mbs` of them).
pub fn rank_batches(it: usize, rank: usize, dp: usize) -> Vec<MicroBatch> {
    (0..GBS / (MBS * dp))
        .map(|k| {
            let first = it * GBS + k * MBS * dp + rank * MBS;
            micro_batches(first, MBS, MBS).remove(0)
        })
        .collect()
}

/// [`rank_batches`] with every row packed: documents cut at two row-dependent positions,
/// positions restarting at each (Megatron's `reset_position_ids` / `reset_attention_mask`).
pub fn packed_batches(it: usize, rank: usize, size: usize) -> Vec<MicroBatch> {
    let mut batches = rank_batches(it, rank, size);
    for mb in &mut batches {
        let s = mb.seq_length;
        for j in 0..mb.micro_batch_size {
            let idx = mb.sample_indices[j];
            let cuts = [1 + idx % 5, 8 + idx % 6];
            let (mut segment, mut start) = (0, 0);
            for t in 0..s {
                if cuts.contains(&t) {
                    (segment, start) = (segment + 1, t);
                }
                mb.segment_ids[j * s + t] = segment;
                mb.position_ids[j * s + t] = (t - start) as u32;
            }
        }
    }
    batches
}

pub fn dp_options(dp: usize, iters: usize) -> TrainerOptions {
    TrainerOptions {
        data_parallel_size: dp,
        // small buckets: several reductions per step, padded shards
        ddp_bucket_size: Some(3000),
        ..options(MBS, GBS, iters as u64)
    }
}

/// The full model's parameters (gathered over tensor parallelism).
/// The (named) parameters this rank's model holds, gathered over tensor parallelism: the
/// whole model, or one pipeline stage's part under their global names.
pub fn params(t: &Trainer) -> Vec<(String, Vec<f32>)> {
    let infos = t.model().parameters();
    let local = (0..infos.len()).map(|i| t.param(i)).collect();
    let full = t.model().gather_tensor_parallel(local).unwrap();
    let full = t.model().gather_expert_parallel(full).unwrap();
    infos.into_iter().map(|p| p.name).zip(full).collect()
}

/// Per-iteration losses and the final named parameters of a run.
pub type Run = (Vec<f64>, Vec<(String, Vec<f32>)>);

/// (losses, final params) of `iters` steps from iteration `from`.
pub fn train(t: &mut Trainer, from: usize, iters: usize) -> Run {
    train_on(t, from, iters, rank_batches)
}

/// [`train`] over the micro-batches `batches(iteration, data-parallel rank, size)` gives
/// (the context-parallel ranks of a data-parallel rank read the same ones).
pub fn train_on(
    t: &mut Trainer,
    from: usize,
    iters: usize,
    batches: impl Fn(usize, usize, usize) -> Vec<MicroBatch>,
) -> Run {
    let (rank, size) = t.data_shard();
    let losses = (from..from + iters)
        .map(|it| t.train_step(&batches(it, rank, size)).unwrap().loss)
        .collect();
    t.finish_param_gather().unwrap();
    (losses, params(t))
}

/// [`train_on`] of an MoE model, also returning every iteration's MoE metrics.
pub fn train_moe_on(
    t: &mut Trainer,
    batches: impl Fn(usize, usize, usize) -> Vec<MicroBatch>,
) -> (Run, Vec<ferrotron_train::trainer::MoeMetrics>) {
    let (rank, size) = t.data_shard();
    let (mut losses, mut moe) = (Vec::new(), Vec::new());
    for it in 0..ITERS {
        let stats = t.train_step(&batches(it, rank, size)).unwrap();
        losses.push(stats.loss);
        moe.push(stats.moe.expect("an MoE model reports its losses"));
    }
    t.finish_param_gather().unwrap();
    ((losses, params(t)), moe)
}

pub fn single_rank(iters: usize) -> Run {
    let mut t = Trainer::new(tiny_model(), dp_options(1, iters)).unwrap();
    train(&mut t, 0, iters)
}

pub fn data_parallel(dp: usize, distributed: bool) -> Vec<Run> {
    run_local(dp, |comm| {
        let group = DataParallel::new(Arc::new(comm), distributed);
        let mut t = Trainer::new_data_parallel(tiny_model(), dp_options(dp, ITERS), group)?;
        Ok::<_, ferrotron_train::trainer::TrainError>(train(&mut t, 0, ITERS))
    })
    .unwrap_or_else(|e| panic!("{e}"))
}

pub fn assert_close(what: &str, a: f64, b: f64, tol: f64) {
    let rel = (a - b).abs() / b.abs().max(1e-6);
    assert!(rel <= tol, "{what}: {a} vs {b} (rel {rel:.2e})");
}

pub fn assert_same_run(label: &str, got: &Run, want: &Run) {
    for (i, (a, b)) in got.0.iter().zip(&want.0).enumerate() {
        assert_close(
            &format!("{label} loss of iteration {}", i + 1),
            *a,
            *b,
            1e-5,
        );
    }
    assert!(!got.1.is_empty(), "{label}: no parameters");
    for (name, a) in &got.1 {
        let b = &want
            .1
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("{label}: {name}"))
            .1;
        assert_eq!(a.len(), b.len(), "{label} {name}");
        let max_diff = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        let at = a.iter().zip(b).position(|(x, y)| (x - y).abs() == max_diff);
        assert!(
            max_diff <= 1e-5,
            "{label} {name}: max |diff| {max_diff:.2e} at {at:?} of {}",
            a.len()
        );
    }
}

/// The reward-model options of the layout tests (their rows are not padded).
pub const REWARD: ferrotron_train::trainer::RewardOptions =
    ferrotron_train::trainer::RewardOptions {
        center_rewards_coefficient: 0.01,
        pad_token_id: None,
    };

/// A parallel layout of the tests: the data-parallel size is what the world leaves.
#[derive(Clone, Copy, Default)]
pub struct Layout {
    pub tp: usize,
    pub pp: usize,
    /// Model chunks per pipeline stage (`virtual_pipeline_model_parallel_size`; 0 or 1:
    /// no interleaving).
    pub vp: usize,
    pub sp: bool,
    pub distributed: bool,
    pub overlap: bool,
    /// `overlap_param_gather` (needs `distributed`).
    pub overlap_params: bool,
    /// Train with bf16 weights and fp32 master weights (the model must be bf16).
    pub bf16: bool,
    /// Train DPO (β 0.1) on pairs of rows with this reference.
    pub dpo: Option<ferrotron_train::trainer::DpoReference>,
    /// Train a reward model (TRL's loss, center coefficient 0.01) on pairs of rows.
    pub reward: bool,
    /// `expert_model_parallel_size` (0 or 1: none).
    pub ep: usize,
    /// `expert_tensor_parallel_size` 1: the experts whole on every tensor-parallel rank.
    pub whole_experts: bool,
    /// `context_parallel_size` (0 or 1: none).
    pub cp: usize,
    /// `cp_comm_type` when `cp > 1`.
    pub cp_comm_type: ferrotron_nn::CpCommType,
    /// `data_parallel_sharding_strategy` when not `no_shard` (then it decides over
    /// `distributed`).
    pub sharding: ferrotron_train::trainer::ShardingStrategy,
}

impl Layout {
    /// The trainer of rank `comm` over `full`: its pipeline stage, sharded over tensor
    /// parallelism (Megatron order: tp ranks adjacent), in its data-parallel group.
    pub fn trainer(
        self,
        comm: LocalComm,
        iters: usize,
        full: ferrotron_model::GptModel,
    ) -> Result<Trainer, TrainError> {
        self.trainer_with(comm, iters, full, |_| {})
    }

    /// [`Layout::trainer`] with its options changed by `edit`.
    pub fn trainer_with(
        self,
        comm: LocalComm,
        iters: usize,
        full: ferrotron_model::GptModel,
        edit: impl FnOnce(&mut ferrotron_train::trainer::TrainerOptions),
    ) -> Result<Trainer, TrainError> {
        let (tp, pp, vp) = (self.tp.max(1), self.pp.max(1), self.vp.max(1));
        let world = comm.world_ranks().len();
        let config = ParallelConfig {
            tensor_model_parallel_size: tp,
            pipeline_model_parallel_size: pp,
            virtual_pipeline_model_parallel_size: (vp > 1).then_some(vp),
            expert_model_parallel_size: self.ep.max(1),
            context_parallel_size: self.cp.max(1),
        };
        let state = ParallelState::new(world, comm.world_rank(), config).unwrap();
        let dp = state.data_parallel_size();
        let groups = ProcessGroups::new(state, Arc::new(comm)).unwrap();
        let layout = ParallelizeOptions {
            sequence_parallel: self.sp,
            expert_tensor_parallel: if self.whole_experts {
                ferrotron_model::module::ExpertTensorParallel::Whole
            } else {
                ferrotron_model::module::ExpertTensorParallel::Split
            },
            cp_comm_type: self.cp_comm_type,
            ..ParallelizeOptions::default()
        };
        let shard = parallelize(Cow::Owned(full), &groups, &layout)
            .map_err(|e| TrainError::Config(e.to_string()))?;
        // Gradients over data x context parallelism, as `ferrotron train` reduces them.
        let mut group = DataParallel::new(groups.data_context.clone(), self.distributed)
            .with_expert_parallel(groups.expert_data.clone(), groups.expert.clone())?;
        if self.sharding != ferrotron_train::trainer::ShardingStrategy::NoShard {
            group = group.with_sharding_strategy(self.sharding)?;
        }
        if self.overlap {
            group = group.with_overlap_grad_reduce()?;
        }
        if self.overlap_params {
            group = group.with_overlap_param_gather()?;
        }
        let mut options = dp_options(dp, iters);
        if self.bf16 {
            options.precision = ferrotron_optim::Precision::Bf16;
        }
        options.dpo = self
            .dpo
            .map(|reference| ferrotron_train::trainer::DpoOptions {
                beta: 0.1,
                label_smoothing: 0.0,
                reference,
            });
        options.reward = self.reward.then_some(REWARD);
        edit(&mut options);
        let mut t = Trainer::new_data_parallel(shard, options, group)?;
        if pp > 1 {
            let pipeline = PipelineParallel::new(groups.pipeline.clone(), groups.embedding.clone());
            t.set_pipeline(pipeline)?;
        }
        Ok(t)
    }
}

/// Trains `layout` on `world` in-process ranks over `model()` for two iterations and saves a
/// checkpoint into `save`; returns its iteration directory.
pub fn save_after_two(
    world: usize,
    layout: Layout,
    model: impl Fn() -> ferrotron_model::GptModel + Sync,
    save: &std::path::Path,
) -> std::path::PathBuf {
    run_local(world, |comm| {
        let mut t = layout.trainer(comm, ITERS, model())?;
        train(&mut t, 0, 2);
        t.save_checkpoint(save, 0, serde_json::Value::Null)
            .map(|_| ())
    })
    .unwrap_or_else(|e| panic!("saving under {world} ranks: {e}"));
    ferrotron_checkpoint::dist::iteration_dir(save, 2)
}

/// Loads `ckpt` under `layout` on `world` in-process ranks, trains iterations 2 and 3 and
/// checks every rank against `tail` (the uninterrupted run's last two iterations).
pub fn assert_resumes(
    label: &str,
    world: usize,
    layout: Layout,
    model: impl Fn() -> ferrotron_model::GptModel + Sync,
    ckpt: &std::path::Path,
    tail: &Run,
) {
    let runs = run_local(world, |comm| {
        let mut t = layout.trainer(comm, ITERS, model())?;
        t.load_checkpoint(ckpt, ferrotron_train::trainer::LoadMode::Resume)?;
        Ok::<_, TrainError>(train(&mut t, 2, 2))
    })
    .unwrap_or_else(|e| panic!("{label}: {e}"));
    for (r, run) in runs.iter().enumerate() {
        assert_same_run(&format!("{label} rank {r}"), run, tail);
    }
}

/// The last two iterations of a four-iteration run: what a run resumed at iteration 2 gives.
pub fn tail_of(run: &Run) -> Run {
    (run.0[2..].to_vec(), run.1.clone())
}

/// `run` with the key rows of every `linear_qkv.bias` zeroed. A key bias adds the same
/// `q·b_k` to every score of a query, which the softmax cancels: its true gradient is 0, so
/// what the backward computes is rounding noise, which Adam scales up to updates of
/// `lr`-size that differ with any change of summation order. Every other value is compared.
pub fn without_key_bias(run: &Run, name: &str) -> Run {
    let config = super::fixture(name).config().clone();
    let (g, d) = (config.num_query_groups, config.kv_channels);
    let stride = (config.heads_per_group() + 2) * d;
    let q_rows = config.heads_per_group() * d;
    let params = run
        .1
        .iter()
        .map(|(n, v)| {
            let mut v = v.clone();
            if n.ends_with("linear_qkv.bias") {
                for gi in 0..g {
                    v[gi * stride + q_rows..][..d].fill(0.0);
                }
            }
            (n.clone(), v)
        })
        .collect();
    (run.0.clone(), params)
}
