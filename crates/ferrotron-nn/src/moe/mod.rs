//! Mixture-of-experts layers (Megatron-Core `megatron/core/transformer/moe/`): the router
//! ([`router`]: top-k routing with every score function and group limit Megatron and HF's MoE
//! families use; [`losses`]: the load-balancing and z losses), the experts ([`experts`]: permuted rows,
//! grouped GEMMs, the weighted unpermute) and expert parallelism ([`dispatch`]: the `alltoall`
//! token dispatcher; [`allgather`]: the `allgather` one), each with its backward.

pub mod allgather;
pub mod dispatch;
pub mod experts;
pub mod losses;
pub mod router;

pub use allgather::{AgActs, ag_experts_backward, ag_experts_forward};
pub use dispatch::{
    EpActs, EpGrads, ep_experts_backward, ep_experts_backward_into, ep_experts_forward,
};
pub use experts::{
    ExpertActs, ExpertGrads, ExpertWeights, Permutation, experts_backward, experts_backward_into,
    experts_forward,
};
pub use router::{DropPolicy, ExpertGroups, GroupScore, RouterConfig, Routing, ScoreFunction};
