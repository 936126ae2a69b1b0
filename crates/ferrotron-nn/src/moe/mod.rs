//! Mixture-of-experts layers (Megatron-Core `megatron/core/transformer/moe/`), so far on one
//! rank: the router ([`router`]: top-k routing with every score function and group limit
//! Megatron and HF's MoE families use, the load-balancing and z losses) and the experts
//! ([`experts`]: permuted rows, grouped GEMMs, the weighted unpermute), each with its backward.

pub mod experts;
pub mod router;

pub use experts::{
    ExpertActs, ExpertGrads, ExpertWeights, Permutation, experts_backward, experts_forward,
};
pub use router::{ExpertGroups, GroupScore, RouterConfig, Routing, ScoreFunction};
