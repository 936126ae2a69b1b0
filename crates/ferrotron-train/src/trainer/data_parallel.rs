//! Data parallelism of the [`Trainer`](super::Trainer): Megatron-Core's
//! `DistributedDataParallel` (`megatron/core/distributed/distributed_data_parallel.py`) and,
//! with `use_distributed_optimizer`, the ZeRO-1 `DistributedOptimizer`
//! (`megatron/core/optimizer/distrib_optimizer.py`).
//!
//! One step on data-parallel rank `r` of `d`:
//! 1. the loss-token count of the global batch is all-reduced first, so each rank's backward
//!    already carries the global per-token scale `1 / Σ tokens` (`--calculate-per-token-loss`:
//!    gradients are then SUMMED over ranks, not averaged);
//! 2. after the local micro-batches, each gradient bucket is all-reduced (DDP), or
//!    reduce-scattered so that rank `r` holds the reduced `r`-th shard of every bucket
//!    (distributed optimizer);
//! 3. the optimizer steps: all of the buffer (DDP: every rank computes the same update), or
//!    only its shards (fp32 master weights and Adam moments exist for `1/d` of the buffer),
//!    with the grad-norm partials and the fp16 inf flag reduced over the group;
//! 4. distributed optimizer: each bucket's parameters are all-gathered from their owners.
//!
//! ZeRO-2/3 ([`ShardingStrategy`]) move step 2 into every micro-batch's backward
//! (`grad_shards.rs`) and, for ZeRO-3, step 4 into the next passes, layer by layer
//! (`param_shards.rs`).

use std::sync::Arc;

use ferrotron_comm::{AsyncComm, Collectives, CommError, Communicator, ReduceOp, SingleRankComm};
use ferrotron_optim::ParamAndGradBuffer;
use half::bf16;

use super::sharding::ShardingStrategy;
use super::stats_reduce::StatsReduce;
use super::{Result, TrainError};

/// The data-parallel group of a trainer and how it shards the optimizer.
#[derive(Clone)]
pub struct DataParallel {
    comm: Arc<dyn Communicator>,
    /// What the ranks shard: `optim` is Megatron's `use_distributed_optimizer`.
    sharding: ShardingStrategy,
    /// The group's progress thread, with `overlap_grad_reduce`.
    overlap: Option<Arc<AsyncComm>>,
    /// The parameter gathers' progress thread (on a duplicate group), with
    /// `overlap_param_gather` or ZeRO-3.
    param_gather: Option<Arc<AsyncComm>>,
    /// Reduce gradients as bf16 (each rank's contribution rounded once, summed in f32)
    /// instead of f32: half the traffic (Megatron's `grad_reduce_in_fp32 = false`).
    grad_reduce_in_bf16: bool,
    /// Under expert parallelism: the expert-data-parallel group (the data-parallel ranks
    /// holding the same experts), over which the expert buckets are reduced, and the
    /// expert-parallel group (ranks holding other experts: the grad norm sums over it).
    experts: Option<ExpertGroups>,
}

/// The groups of an expert-parallel run besides the data-parallel one.
#[derive(Clone)]
struct ExpertGroups {
    expert_data: Arc<dyn Communicator>,
    expert: Arc<dyn Communicator>,
    /// `expert_data`'s progress thread, with `overlap_grad_reduce`.
    overlap: Option<Arc<AsyncComm>>,
    /// The expert buckets' parameter gathers' progress thread (on a duplicate of
    /// `expert_data`), with `overlap_param_gather`.
    param_gather: Option<Arc<AsyncComm>>,
}

/// The progress threads of a trainer's overlapped reductions or gathers: the data-parallel
/// group's, and the expert-data-parallel group's for the expert buckets.
#[derive(Clone, Copy)]
pub(super) struct BucketComms<'a> {
    data: &'a AsyncComm,
    expert: Option<&'a AsyncComm>,
}

impl<'a> BucketComms<'a> {
    /// The thread of the group that reduces (and shards) `bucket`.
    pub(super) fn of(&self, bucket: &ferrotron_optim::BucketInfo) -> &'a AsyncComm {
        match (bucket.expert_parallel, self.expert) {
            (true, Some(expert)) => expert,
            _ => self.data,
        }
    }
}

impl std::fmt::Debug for DataParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataParallel")
            .field("rank", &self.comm.rank())
            .field("size", &self.comm.size())
            .field("sharding", &self.sharding)
            .field("overlap_grad_reduce", &self.overlap.is_some())
            .field("overlap_param_gather", &self.param_gather.is_some())
            .finish()
    }
}

pub(super) fn comm_err(e: CommError) -> TrainError {
    TrainError::Comm(e.to_string())
}

impl DataParallel {
    /// Ranks in `comm` train replicas of one model on disjoint parts of each global batch.
    /// With `use_distributed_optimizer` the optimizer state is sharded over them.
    pub fn new(comm: Arc<dyn Communicator>, use_distributed_optimizer: bool) -> Self {
        DataParallel {
            comm,
            sharding: ShardingStrategy::from_distributed_optimizer(use_distributed_optimizer),
            overlap: None,
            param_gather: None,
            grad_reduce_in_bf16: false,
            experts: None,
        }
    }

    /// Expert parallelism (Megatron's `expert_model_parallel_size`): the expert buckets
    /// ([`ferrotron_optim::BucketInfo::expert_parallel`]) are reduced over `expert_data`
    /// (the data-parallel ranks holding the same experts) instead of this group, and the
    /// grad norm also sums over `expert` (the ranks holding the other experts; the trainer
    /// leaves their copies of the other parameters out of it).
    ///
    /// Expert buckets are reduced in f32 whatever `grad_reduce_in_fp32` says; with the
    /// distributed optimizer they are sharded over the expert-data-parallel group.
    ///
    /// With `overlap_grad_reduce` / `overlap_param_gather` (set before or after) the expert
    /// buckets get progress threads of their own on the expert-data-parallel group.
    ///
    /// # Errors
    /// A progress thread or the duplicate group for the gathers could not be made.
    pub fn with_expert_parallel(
        mut self,
        expert_data: Arc<dyn Communicator>,
        expert: Arc<dyn Communicator>,
    ) -> Result<Self> {
        if expert.size() == 1 {
            return Ok(self);
        }
        if self.sharding.shards_grads() {
            return Err(TrainError::Config(format!(
                "not supported yet: data_parallel_sharding_strategy = {} under expert \
                 parallelism",
                self.sharding
            )));
        }
        self.experts = Some(ExpertGroups {
            expert_data,
            expert,
            overlap: None,
            param_gather: None,
        });
        self.start_expert_threads()?;
        Ok(self)
    }

    /// The expert-data-parallel progress threads the overlap options ask for and the
    /// expert groups do not have yet. Collective over the expert-data-parallel group.
    fn start_expert_threads(&mut self) -> Result<()> {
        let (overlap, gather) = (self.overlap.is_some(), self.param_gather.is_some());
        let Some(g) = self.experts.as_mut() else {
            return Ok(());
        };
        if overlap && g.overlap.is_none() {
            let thread = AsyncComm::new(g.expert_data.clone()).map_err(comm_err)?;
            g.overlap = Some(Arc::new(thread));
        }
        if gather && g.param_gather.is_none() {
            let rank = g.expert_data.rank();
            let dup = g
                .expert_data
                .split(Some(0), rank)
                .map_err(comm_err)?
                .ok_or_else(|| {
                    TrainError::Comm("duplicating the expert-data-parallel group".into())
                })?;
            g.param_gather = Some(Arc::new(AsyncComm::new(dup).map_err(comm_err)?));
        }
        Ok(())
    }

    /// Megatron's `grad_reduce_in_fp32 = false`: gradient buckets travel as bf16 (rounded
    /// once per rank; the sum is taken in f32 and rounded once), halving the bytes moved.
    /// Not combined with `overlap_grad_reduce` (its buckets stay f32).
    pub fn with_bf16_grad_reduce(mut self) -> Self {
        self.grad_reduce_in_bf16 = true;
        self
    }

    /// Megatron's `overlap_grad_reduce`: each gradient bucket is reduced on a progress thread
    /// as soon as the last micro-batch's backward has finished it (see `overlap.rs`). A group
    /// of one has nothing to overlap.
    ///
    /// # Errors
    /// The progress thread could not start.
    pub fn with_overlap_grad_reduce(mut self) -> Result<Self> {
        if self.size() > 1 {
            self.overlap = Some(Arc::new(
                AsyncComm::new(self.comm.clone()).map_err(comm_err)?,
            ));
        }
        self.start_expert_threads()?;
        Ok(self)
    }

    /// Whether gradients are reduced as bf16 (`grad_reduce_in_fp32 = false`).
    pub(super) fn grad_reduce_in_bf16(&self) -> bool {
        self.grad_reduce_in_bf16
    }

    /// The progress threads of `overlap_grad_reduce`, if on.
    pub(super) fn overlap_comms(&self) -> Option<BucketComms<'_>> {
        self.bucket_comms(self.overlap.as_deref(), |g| g.overlap.as_deref())
    }

    /// `data` with the expert groups' thread `expert` picks, when `data` is on.
    fn bucket_comms<'a>(
        &'a self,
        data: Option<&'a AsyncComm>,
        expert: impl Fn(&'a ExpertGroups) -> Option<&'a AsyncComm>,
    ) -> Option<BucketComms<'a>> {
        Some(BucketComms {
            data: data?,
            expert: self.experts.as_ref().and_then(expert),
        })
    }

    /// Megatron's `overlap_param_gather` (with the distributed optimizer): after each step
    /// the buckets' parameter all-gathers run on a progress thread of their own (over a
    /// duplicate of the group, so they never interleave with this thread's collectives)
    /// while the next step's forward starts (see `param_gather.rs`). A group of one has
    /// nothing to gather.
    ///
    /// # Errors
    /// Without the distributed optimizer, or the duplicate group or its thread could not be
    /// made.
    pub fn with_overlap_param_gather(mut self) -> Result<Self> {
        if !self.sharding.shards_optimizer() {
            return Err(TrainError::Config(
                "overlap_param_gather needs use_distributed_optimizer".into(),
            ));
        }
        if self.sharding.shards_params() {
            return Err(zero3_with_overlap_param_gather());
        }
        self.start_param_gather_thread()?;
        self.start_expert_threads()?;
        Ok(self)
    }

    /// The parameter gathers' progress thread on a duplicate of the group, unless there is
    /// one already or the group has one rank. Collective over the group.
    fn start_param_gather_thread(&mut self) -> Result<()> {
        if self.size() > 1 && self.param_gather.is_none() {
            let dup = self
                .comm
                .split(Some(0), self.rank())
                .map_err(comm_err)?
                .ok_or_else(|| TrainError::Comm("duplicating the data-parallel group".into()))?;
            self.param_gather = Some(Arc::new(AsyncComm::new(dup).map_err(comm_err)?));
        }
        Ok(())
    }

    /// Megatron-FSDP's `data_parallel_sharding_strategy` (see [`ShardingStrategy`]; `optim`
    /// is `use_distributed_optimizer`). ZeRO-3 gathers parameters on a progress thread of
    /// its own (over a duplicate of the group), prefetching the next unit. Collective over
    /// the group.
    ///
    /// # Errors
    /// ZeRO-2/3 under expert parallelism or with `overlap_param_gather` (not supported:
    /// Megatron-FSDP shards expert parameters over their own group), or the thread could
    /// not start.
    pub fn with_sharding_strategy(mut self, sharding: ShardingStrategy) -> Result<Self> {
        if sharding.shards_grads() && self.experts.is_some() {
            return Err(TrainError::Config(format!(
                "not supported yet: data_parallel_sharding_strategy = {sharding} under expert \
                 parallelism"
            )));
        }
        if sharding.shards_params() && self.param_gather.is_some() {
            return Err(zero3_with_overlap_param_gather());
        }
        self.sharding = sharding;
        if sharding.shards_params() {
            self.start_param_gather_thread()?;
        }
        Ok(self)
    }

    /// The parameter gathers' progress thread of ZeRO-3 (`None` on a group of one).
    pub(super) fn unit_gather_comm(&self) -> Option<Arc<AsyncComm>> {
        (self.param_gather.clone()).filter(|_| self.sharding.shards_params())
    }

    /// The progress threads of `overlap_param_gather`, if on.
    pub(super) fn param_gather_comms(&self) -> Option<BucketComms<'_>> {
        if self.sharding.shards_params() {
            return None;
        }
        self.bucket_comms(self.param_gather.as_deref(), |g| g.param_gather.as_deref())
    }

    /// A group of one: the single-rank trainer.
    pub fn single() -> Self {
        DataParallel::new(Arc::new(SingleRankComm), false)
    }

    /// Data-parallel rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Data-parallel size.
    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// Whether the optimizer state is sharded (ZeRO-1 and up).
    pub fn use_distributed_optimizer(&self) -> bool {
        self.sharding.shards_optimizer()
    }

    /// What the ranks shard.
    pub fn sharding_strategy(&self) -> ShardingStrategy {
        self.sharding
    }

    /// The group.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// Element-wise SUM of `values` over the group.
    pub(super) fn sum(&self, values: &mut [f64]) -> Result<()> {
        if self.size() > 1 {
            self.comm
                .all_reduce(values, ReduceOp::Sum)
                .map_err(comm_err)?;
        }
        Ok(())
    }

    /// Waits for every rank of the group.
    pub(super) fn barrier(&self) -> Result<()> {
        self.comm.barrier().map_err(comm_err)
    }

    /// Makes every rank's parameters those of rank 0 (Megatron's `broadcast_params` at DDP
    /// construction), so replicas start identical however their weights were made.
    /// Under expert parallelism the expert buckets come from the first rank holding the
    /// same experts (of the expert-data-parallel group) instead.
    pub(super) fn broadcast_params(&self, buffer: &mut ParamAndGradBuffer) -> Result<()> {
        if self.size() == 1 {
            return Ok(());
        }
        if self.experts.is_none() {
            // The whole storage at once (frozen parameters, outside every bucket, too).
            let (params, _) = buffer.data_mut();
            return self
                .comm
                .broadcast_bytes(params.as_bytes_mut(), 0)
                .map_err(comm_err);
        }
        let buckets: Vec<_> = buffer
            .buckets()
            .iter()
            .map(|b| (b.start..b.end, self.bucket_group(b)))
            .collect();
        let (params, _) = buffer.data_mut();
        let elem = params.dtype().size_in_bytes();
        let bytes = params.as_bytes_mut();
        for (r, comm) in buckets {
            comm.broadcast_bytes(&mut bytes[r.start * elem..r.end * elem], 0)
                .map_err(comm_err)?;
        }
        Ok(())
    }

    /// Step 2: reduces every bucket's gradients (SUM) over the group: all-reduce, or
    /// reduce-scatter into this rank's shard with the distributed optimizer.
    pub(super) fn reduce_grads(&self, buffer: &mut ParamAndGradBuffer) -> Result<()> {
        if self.size() == 1 {
            return Ok(());
        }
        for b in 0..buffer.buckets().len() {
            let bucket = &buffer.buckets()[b];
            let comm = self.bucket_group(bucket).clone();
            if comm.size() == 1 {
                continue;
            }
            // Expert buckets are reduced in f32 whatever `grad_reduce_in_fp32` says.
            let narrow = self.grad_reduce_in_bf16 && !bucket.expert_parallel;
            let grads = buffer.bucket_grads_mut(b);
            if narrow {
                through_bf16(grads, |narrow| self.reduce_bucket(&*comm, narrow))?;
            } else {
                self.reduce_bucket(&*comm, grads)?;
            }
        }
        Ok(())
    }

    /// All-reduce, or reduce-scatter into this rank's shard, of one bucket over `comm` (SUM).
    fn reduce_bucket<T: ferrotron_comm::Element>(
        &self,
        comm: &dyn Communicator,
        grads: &mut [T],
    ) -> Result<()> {
        if self.use_distributed_optimizer() {
            comm.reduce_scatter_in_place(grads, ReduceOp::Sum)
        } else {
            comm.all_reduce(grads, ReduceOp::Sum)
        }
        .map_err(comm_err)
    }

    /// Step 4 (distributed optimizer): every bucket's parameters gathered from the ranks
    /// that own its shards.
    pub(super) fn gather_params(&self, buffer: &mut ParamAndGradBuffer) -> Result<()> {
        if self.size() == 1 || !self.use_distributed_optimizer() {
            return Ok(());
        }
        let ranges: Vec<_> = buffer
            .buckets()
            .iter()
            .map(|b| (b.start..b.end, self.bucket_group(b)))
            .collect();
        let (params, _) = buffer.data_mut();
        let elem = params.dtype().size_in_bytes();
        let bytes = params.as_bytes_mut();
        for (r, comm) in ranges {
            if comm.size() > 1 {
                comm.all_gather_bytes(&mut bytes[r.start * elem..r.end * elem])
                    .map_err(comm_err)?;
            }
        }
        Ok(())
    }

    /// The group that reduces (and, with the distributed optimizer, shards) bucket `b`: the
    /// expert-data-parallel group for an expert bucket, this group otherwise.
    pub(super) fn bucket_group(&self, b: &ferrotron_optim::BucketInfo) -> &Arc<dyn Communicator> {
        match (&self.experts, b.expert_parallel) {
            (Some(groups), true) => &groups.expert_data,
            _ => &self.comm,
        }
    }

    /// Whether this rank leaves its copies of the non-expert parameters out of the grad
    /// norm: an expert-parallel rank > 0 without the distributed optimizer (the first
    /// expert-parallel rank counts them; with the distributed optimizer every rank counts
    /// its own shard of them).
    pub(super) fn skips_expert_replicas(&self, ep_rank: usize) -> bool {
        self.experts.is_some() && !self.use_distributed_optimizer() && ep_rank > 0
    }

    /// The optimizer's cross-rank reductions (grad-norm partials, fp16 inf flag): over
    /// `tensor` (a model shard's tensor-parallel group), `pipeline` (each stage holds
    /// other parameters) and the expert-parallel group (each rank holds other experts),
    /// where ranks hold different gradients, and over this group when each rank holds an
    /// optimizer shard; none when every rank holds the whole (identical) reduced gradient.
    pub(super) fn stats_reduce<'a>(
        &'a self,
        tensor: Option<&'a dyn Communicator>,
        pipeline: Option<&'a dyn Communicator>,
    ) -> StatsReduce<'a> {
        let mut comms = Vec::with_capacity(4);
        comms.extend(tensor.filter(|c| c.size() > 1));
        comms.extend(pipeline.filter(|c| c.size() > 1));
        // Without the distributed optimizer the ranks of an expert-parallel group hold other
        // experts' gradients; with it the data-parallel sum below covers them.
        if !self.use_distributed_optimizer() {
            comms.extend(self.experts.as_ref().map(|g| &*g.expert));
        }
        if self.use_distributed_optimizer() && self.size() > 1 {
            comms.push(&*self.comm);
        }
        StatsReduce::new(comms)
    }
}

/// ZeRO-3 with `overlap_param_gather`: the error.
fn zero3_with_overlap_param_gather() -> TrainError {
    TrainError::Config(
        "overlap_param_gather does not apply to data_parallel_sharding_strategy = \
         optim_grads_params, which gathers parameters unit by unit (prefetching)"
            .into(),
    )
}

/// Megatron's `grad_reduce_in_fp32 = false`: `grads` rounded to bf16 once, `reduce` run on
/// the narrow copy (the collective sums in f32 and rounds once), the result widened back.
///
/// # Errors
/// What `reduce` returns.
pub(super) fn through_bf16<E>(
    grads: &mut [f32],
    reduce: impl FnOnce(&mut [bf16]) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    let mut narrow: Vec<bf16> = grads.iter().map(|&g| bf16::from_f32(g)).collect();
    reduce(&mut narrow)?;
    for (g, n) in grads.iter_mut().zip(&narrow) {
        *g = n.to_f32();
    }
    Ok(())
}
