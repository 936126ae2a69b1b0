//! Mixture-of-experts layers (Megatron-Core `megatron/core/transformer/moe/`): so far the
//! router ([`router`]): top-k routing with every score function and group limit Megatron and
//! HF's MoE families use, and the load-balancing and z losses.

pub mod router;

pub use router::{ExpertGroups, GroupScore, RouterConfig, Routing, ScoreFunction};
