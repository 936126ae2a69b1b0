//! [`ParallelState`]: where a rank sits in Megatron's process grid and which ranks share
//! each of its groups. Pure arithmetic, no communication; [`ProcessGroups`] turns it into
//! communicators.
//!
//! Mirrors Megatron-Core's `parallel_state.initialize_model_parallel` with
//! `order = "tp-cp-ep-dp-pp"`: the dense layers use the generator `tp-cp-dp-pp`,
//! `rank = tp + T·(cp + C·(dp + D·pp))` (tensor-parallel ranks adjacent, pipeline stages
//! farthest apart); expert layers use `tp-ep-dp-pp` over the same world,
//! `rank = tp + T·(ep + E·(edp + ED·pp))` with the expert tensor-parallel size equal to `T`.

use std::sync::Arc;

use crate::communicator::Communicator;
use crate::error::{CommError, Result};

/// The parallel sizes of a run (Megatron names). The data-parallel size is what is left:
/// `world / (tp · cp · pp)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParallelConfig {
    /// `tensor_model_parallel_size` (T).
    pub tensor_model_parallel_size: usize,
    /// `pipeline_model_parallel_size` (P).
    pub pipeline_model_parallel_size: usize,
    /// `virtual_pipeline_model_parallel_size`: model chunks per pipeline stage (interleaved
    /// 1F1B); `None` = 1.
    pub virtual_pipeline_model_parallel_size: Option<usize>,
    /// `context_parallel_size` (C).
    pub context_parallel_size: usize,
    /// `expert_model_parallel_size` (E).
    pub expert_model_parallel_size: usize,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        ParallelConfig {
            tensor_model_parallel_size: 1,
            pipeline_model_parallel_size: 1,
            virtual_pipeline_model_parallel_size: None,
            context_parallel_size: 1,
            expert_model_parallel_size: 1,
        }
    }
}

/// The kinds of process group a rank belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GroupKind {
    /// Same cp, dp, pp: the tensor-parallel ranks.
    Tensor,
    /// Same tp, dp, pp.
    Context,
    /// Same tp, cp, pp: gradients are reduced here.
    Data,
    /// Same tp, pp: data and context parallel together (the distributed optimizer's group
    /// when cp > 1).
    DataContext,
    /// Same tp, cp, dp: the stages of one pipeline.
    Pipeline,
    /// Same cp, dp: tensor x pipeline (the model-parallel group).
    ModelParallel,
    /// Expert grid: same tp, expert-dp, pp.
    Expert,
    /// Expert grid: same tp, ep, pp.
    ExpertData,
    /// First and last pipeline stage of one pipeline (tied embedding gradients); only ranks
    /// of those stages are members. With one stage, the rank alone.
    Embedding,
}

impl GroupKind {
    /// Every kind, in the order [`ProcessGroups::new`] creates them.
    pub const ALL: [GroupKind; 9] = [
        GroupKind::Tensor,
        GroupKind::Context,
        GroupKind::Data,
        GroupKind::DataContext,
        GroupKind::Pipeline,
        GroupKind::ModelParallel,
        GroupKind::Expert,
        GroupKind::ExpertData,
        GroupKind::Embedding,
    ];
}

/// A rank's coordinates in the dense and the expert grids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankCoords {
    /// Tensor-parallel rank.
    pub tp: usize,
    /// Context-parallel rank.
    pub cp: usize,
    /// Data-parallel rank.
    pub dp: usize,
    /// Pipeline stage.
    pub pp: usize,
    /// Expert-parallel rank.
    pub ep: usize,
    /// Expert-data-parallel rank.
    pub expert_dp: usize,
}

/// One rank's place in the grid of a `world_size` job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParallelState {
    config: ParallelConfig,
    world_size: usize,
    rank: usize,
    data_parallel_size: usize,
    expert_data_parallel_size: usize,
    coords: RankCoords,
}

impl ParallelState {
    /// Validates the layout and places `rank`.
    ///
    /// # Errors
    /// [`CommError::Layout`] naming every problem: a zero size, `world_size` not divisible
    /// by `tp · cp · pp` or by `tp · ep · pp`, a virtual pipeline size without pipeline
    /// parallelism, `rank >= world_size`.
    pub fn new(world_size: usize, rank: usize, config: ParallelConfig) -> Result<Self> {
        let c = &config;
        let (t, p, cp, e) = (
            c.tensor_model_parallel_size,
            c.pipeline_model_parallel_size,
            c.context_parallel_size,
            c.expert_model_parallel_size,
        );
        let mut problems = Vec::new();
        for (name, v) in [
            ("world size", world_size),
            ("tensor_model_parallel_size", t),
            ("pipeline_model_parallel_size", p),
            ("context_parallel_size", cp),
            ("expert_model_parallel_size", e),
        ] {
            if v == 0 {
                problems.push(format!("{name} must be >= 1"));
            }
        }
        if problems.is_empty() {
            if !world_size.is_multiple_of(t * cp * p) {
                problems.push(format!(
                    "world size {world_size} is not divisible by tensor_model_parallel_size ({t}) \
                     x context_parallel_size ({cp}) x pipeline_model_parallel_size ({p}) = {}",
                    t * cp * p
                ));
            }
            if !world_size.is_multiple_of(t * e * p) {
                problems.push(format!(
                    "world size {world_size} is not divisible by tensor_model_parallel_size ({t}) \
                     x expert_model_parallel_size ({e}) x pipeline_model_parallel_size ({p}) = {}",
                    t * e * p
                ));
            }
            if rank >= world_size {
                problems.push(format!(
                    "rank {rank} is not below the world size {world_size}"
                ));
            }
        }
        match c.virtual_pipeline_model_parallel_size {
            Some(0) => problems.push("virtual_pipeline_model_parallel_size must be >= 1".into()),
            Some(v) if v > 1 && p == 1 => problems.push(format!(
                "virtual_pipeline_model_parallel_size ({v}) needs pipeline_model_parallel_size > 1"
            )),
            _ => {}
        }
        if !problems.is_empty() {
            return Err(CommError::Layout(problems.join("; ")));
        }
        let dp = world_size / (t * cp * p);
        let edp = world_size / (t * e * p);
        Ok(ParallelState {
            config,
            world_size,
            rank,
            data_parallel_size: dp,
            expert_data_parallel_size: edp,
            coords: coords_of(rank, t, cp, dp, e, edp),
        })
    }

    /// A single-rank state (every size 1).
    pub fn single() -> Self {
        ParallelState::new(1, 0, ParallelConfig::default()).expect("1 rank is always valid")
    }

    /// The sizes.
    pub fn config(&self) -> &ParallelConfig {
        &self.config
    }
    /// Ranks in the job.
    pub fn world_size(&self) -> usize {
        self.world_size
    }
    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Data-parallel size `world / (tp · cp · pp)`.
    pub fn data_parallel_size(&self) -> usize {
        self.data_parallel_size
    }
    /// Expert-data-parallel size `world / (tp · ep · pp)`.
    pub fn expert_data_parallel_size(&self) -> usize {
        self.expert_data_parallel_size
    }
    /// `tensor_model_parallel_size`.
    pub fn tensor_model_parallel_size(&self) -> usize {
        self.config.tensor_model_parallel_size
    }
    /// `expert_model_parallel_size`.
    pub fn expert_model_parallel_size(&self) -> usize {
        self.config.expert_model_parallel_size
    }
    /// `pipeline_model_parallel_size`.
    pub fn pipeline_model_parallel_size(&self) -> usize {
        self.config.pipeline_model_parallel_size
    }
    /// Model chunks per stage (1 without interleaving).
    pub fn virtual_pipeline_model_parallel_size(&self) -> usize {
        self.config
            .virtual_pipeline_model_parallel_size
            .unwrap_or(1)
    }
    /// This rank's coordinates.
    pub fn coords(&self) -> RankCoords {
        self.coords
    }
    /// First pipeline stage (holds the embedding).
    pub fn is_pipeline_first_stage(&self) -> bool {
        self.coords.pp == 0
    }
    /// Last pipeline stage (holds the output layer and the loss).
    pub fn is_pipeline_last_stage(&self) -> bool {
        self.coords.pp + 1 == self.config.pipeline_model_parallel_size
    }

    /// Coordinates of any `rank` of this job.
    pub fn coords_of(&self, rank: usize) -> RankCoords {
        let c = &self.config;
        coords_of(
            rank,
            c.tensor_model_parallel_size,
            c.context_parallel_size,
            self.data_parallel_size,
            c.expert_model_parallel_size,
            self.expert_data_parallel_size,
        )
    }

    /// World ranks of `rank`'s group of `kind`, in group-rank order; `None` when `rank` is in
    /// no such group (only [`GroupKind::Embedding`], for middle stages).
    pub fn group_of(&self, kind: GroupKind, rank: usize) -> Option<Vec<usize>> {
        let me = self.coords_of(rank);
        let p = self.config.pipeline_model_parallel_size;
        if kind == GroupKind::Embedding && p > 1 && me.pp != 0 && me.pp + 1 != p {
            return None;
        }
        Some(
            (0..self.world_size)
                .filter(|&r| same_group(kind, &me, &self.coords_of(r), p))
                .collect(),
        )
    }

    /// This rank's group of `kind` ([`group_of`](Self::group_of) for [`rank`](Self::rank)).
    pub fn group(&self, kind: GroupKind) -> Option<Vec<usize>> {
        self.group_of(kind, self.rank)
    }

    /// Every group of `kind` in the job, each in group-rank order, ordered by first rank.
    pub fn all_groups(&self, kind: GroupKind) -> Vec<Vec<usize>> {
        let mut groups: Vec<Vec<usize>> = Vec::new();
        for r in 0..self.world_size {
            if let Some(g) = self.group_of(kind, r)
                && g[0] == r
            {
                groups.push(g);
            }
        }
        groups
    }
}

fn coords_of(rank: usize, t: usize, cp: usize, dp: usize, e: usize, edp: usize) -> RankCoords {
    let tp = rank % t;
    let rest = rank / t;
    let (c, rest_dense) = (rest % cp, rest / cp);
    let (d, pp) = (rest_dense % dp, rest_dense / dp);
    let (ep, rest_expert) = (rest % e, rest / e);
    RankCoords {
        tp,
        cp: c,
        dp: d,
        pp,
        ep,
        expert_dp: rest_expert % edp,
    }
}

fn same_group(kind: GroupKind, a: &RankCoords, b: &RankCoords, p: usize) -> bool {
    match kind {
        GroupKind::Tensor => (a.cp, a.dp, a.pp) == (b.cp, b.dp, b.pp),
        GroupKind::Context => (a.tp, a.dp, a.pp) == (b.tp, b.dp, b.pp),
        GroupKind::Data => (a.tp, a.cp, a.pp) == (b.tp, b.cp, b.pp),
        GroupKind::DataContext => (a.tp, a.pp) == (b.tp, b.pp),
        GroupKind::Pipeline => (a.tp, a.cp, a.dp) == (b.tp, b.cp, b.dp),
        GroupKind::ModelParallel => (a.cp, a.dp) == (b.cp, b.dp),
        GroupKind::Expert => (a.tp, a.expert_dp, a.pp) == (b.tp, b.expert_dp, b.pp),
        GroupKind::ExpertData => (a.tp, a.ep, a.pp) == (b.tp, b.ep, b.pp),
        GroupKind::Embedding => {
            (a.tp, a.cp, a.dp) == (b.tp, b.cp, b.dp) && (b.pp == 0 || b.pp + 1 == p)
        }
    }
}

/// This rank's communicators, one per [`GroupKind`] (Megatron's `get_*_group()`), created
/// collectively from the world communicator by [`ProcessGroups::new`].
#[derive(Clone)]
pub struct ProcessGroups {
    /// The grid they were built from.
    pub state: ParallelState,
    /// All ranks.
    pub world: Arc<dyn Communicator>,
    /// Tensor-parallel group.
    pub tensor: Arc<dyn Communicator>,
    /// Context-parallel group.
    pub context: Arc<dyn Communicator>,
    /// Data-parallel group.
    pub data: Arc<dyn Communicator>,
    /// Data x context group.
    pub data_context: Arc<dyn Communicator>,
    /// Pipeline group (stage `r` = rank `r`).
    pub pipeline: Arc<dyn Communicator>,
    /// Tensor x pipeline group.
    pub model_parallel: Arc<dyn Communicator>,
    /// Expert-parallel group.
    pub expert: Arc<dyn Communicator>,
    /// Expert-data-parallel group.
    pub expert_data: Arc<dyn Communicator>,
    /// First + last stage group; `None` on middle stages.
    pub embedding: Option<Arc<dyn Communicator>>,
}

impl ProcessGroups {
    /// Splits `world` into this rank's groups. Collective: every rank of `world` calls it
    /// with the same layout.
    ///
    /// # Errors
    /// `world`'s size or rank disagree with `state`, or a split failed.
    pub fn new(state: ParallelState, world: Arc<dyn Communicator>) -> Result<Self> {
        if world.size() != state.world_size() || world.rank() != state.rank() {
            return Err(CommError::Layout(format!(
                "the communicator is rank {} of {}, the layout rank {} of {}",
                world.rank(),
                world.size(),
                state.rank(),
                state.world_size()
            )));
        }
        let mut made = Vec::with_capacity(GroupKind::ALL.len());
        for kind in GroupKind::ALL {
            let members = state.group(kind);
            let color = members.as_ref().map(|m| m[0]);
            let key = members
                .as_ref()
                .and_then(|m| m.iter().position(|&r| r == state.rank()))
                .unwrap_or(0);
            made.push(world.split(color, key)?);
        }
        let mut take = |kind: GroupKind| {
            let i = GroupKind::ALL.iter().position(|&k| k == kind).unwrap_or(0);
            made[i].take().ok_or_else(|| {
                CommError::Layout(format!(
                    "the {kind:?} split gave rank {} no group",
                    state.rank()
                ))
            })
        };
        Ok(ProcessGroups {
            tensor: take(GroupKind::Tensor)?,
            context: take(GroupKind::Context)?,
            data: take(GroupKind::Data)?,
            data_context: take(GroupKind::DataContext)?,
            pipeline: take(GroupKind::Pipeline)?,
            model_parallel: take(GroupKind::ModelParallel)?,
            expert: take(GroupKind::Expert)?,
            expert_data: take(GroupKind::ExpertData)?,
            embedding: take(GroupKind::Embedding).ok(),
            state,
            world,
        })
    }
}
