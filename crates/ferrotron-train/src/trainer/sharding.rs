//! What the data-parallel ranks shard (Megatron-FSDP's `--data-parallel-sharding-strategy`,
//! `megatron/core/distributed/fsdp`; PyTorch FSDP's `ShardingStrategy`), and the FSDP units
//! of a model: the pieces whose gradients are reduce-scattered and whose parameters are
//! all-gathered together.

use ferrotron_model::GptModel;

/// What each of the `d` data-parallel ranks holds of the model state, per parameter (bf16
/// params, f32 grads, f32 master weights and Adam moments):
///
/// | strategy | sharded | bytes per parameter | gradients reduced |
/// |---|---|---|---|
/// | `no_shard` | nothing | 2 + 4 + 12 | all-reduce after the last micro-batch |
/// | `optim` (ZeRO-1) | optimizer state | 2 + 4 + 12/d | reduce-scatter after the last micro-batch |
/// | `optim_grads` (ZeRO-2) | + gradients | 2 + (4 + 12)/d | reduce-scatter after every micro-batch |
/// | `optim_grads_params` (ZeRO-3) | + parameters | (2 + 4 + 12)/d | as ZeRO-2; parameters all-gathered per unit |
///
/// The gradients of a micro-batch are reduce-scattered unit by unit as its backward
/// finishes them and summed into the rank's shard; the full-size buffer's pages are given
/// back to the system in between ([`ferrotron_tensor::pages`]). Under ZeRO-3 each unit's
/// parameters are all-gathered before its forward (the next unit's gather prefetched while
/// it computes), released after, and gathered again before its backward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ShardingStrategy {
    /// Every rank holds everything (DDP).
    #[default]
    NoShard,
    /// ZeRO-1: the optimizer state (Megatron's `--use-distributed-optimizer`).
    Optim,
    /// ZeRO-2: the optimizer state and the gradients.
    OptimGrads,
    /// ZeRO-3: the optimizer state, the gradients and the parameters.
    OptimGradsParams,
}

impl ShardingStrategy {
    /// Every strategy, weakest first.
    pub const ALL: [ShardingStrategy; 4] = [
        ShardingStrategy::NoShard,
        ShardingStrategy::Optim,
        ShardingStrategy::OptimGrads,
        ShardingStrategy::OptimGradsParams,
    ];

    /// Megatron's name: `no_shard`, `optim`, `optim_grads`, `optim_grads_params`.
    pub fn name(self) -> &'static str {
        match self {
            ShardingStrategy::NoShard => "no_shard",
            ShardingStrategy::Optim => "optim",
            ShardingStrategy::OptimGrads => "optim_grads",
            ShardingStrategy::OptimGradsParams => "optim_grads_params",
        }
    }

    /// The strategy of Megatron name `name`.
    pub fn parse(name: &str) -> Option<ShardingStrategy> {
        Self::ALL.into_iter().find(|s| s.name() == name)
    }

    /// The strategy of `use_distributed_optimizer`: `optim` or `no_shard`.
    pub fn from_distributed_optimizer(use_distributed_optimizer: bool) -> ShardingStrategy {
        if use_distributed_optimizer {
            ShardingStrategy::Optim
        } else {
            ShardingStrategy::NoShard
        }
    }

    /// The optimizer state is sharded (every strategy but `no_shard`).
    pub fn shards_optimizer(self) -> bool {
        self != ShardingStrategy::NoShard
    }

    /// The gradients are sharded: reduce-scattered after every micro-batch.
    pub fn shards_grads(self) -> bool {
        matches!(
            self,
            ShardingStrategy::OptimGrads | ShardingStrategy::OptimGradsParams
        )
    }

    /// The parameters are sharded: all-gathered per unit.
    pub fn shards_params(self) -> bool {
        self == ShardingStrategy::OptimGradsParams
    }
}

impl std::fmt::Display for ShardingStrategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The FSDP unit of every parameter (order of [`GptModel::parameters`]), numbered in model
/// order: Megatron-FSDP's units are the embedding and each transformer layer; the
/// parameters after the last layer (final norm, output layer) make the last unit. A
/// parameter before the first layer (embedding, embedding norm) is in unit 0, one of layer
/// `i` in unit `i + 1`.
pub(super) fn fsdp_units(model: &GptModel) -> Vec<u32> {
    let total = model.layout().decls().len();
    let layers = model.layers();
    let mut units = vec![layers.len() as u32 + 1; total];
    let first = layers.first().map_or(total, |l| l.params.start);
    units[..first].fill(0);
    for (i, layer) in layers.iter().enumerate() {
        units[layer.params.clone()].fill(i as u32 + 1);
    }
    units
}
