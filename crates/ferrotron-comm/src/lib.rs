//! Ferrotron's communication layer: Megatron's process grid and the collectives that ranks
//! use to train one model together.
//!
//! | here | mirrors |
//! |---|---|
//! | [`ParallelState`], [`ParallelConfig`], [`GroupKind`] | `megatron/core/parallel_state.py` (rank order `tp-cp-ep-dp-pp`) |
//! | [`ProcessGroups`] | the `get_*_group()` accessors of the same file |
//! | [`Communicator`], [`Collectives`], [`ReduceOp`] | `torch.distributed` (all_reduce, reduce_scatter_tensor, all_gather_into_tensor, broadcast, send/recv, all_to_all_single with and without split sizes, barrier) |
//! | [`AsyncComm`], [`CommHandle`] | `async_op=True` collectives and their `Work` handles |
//! | [`run_local`], [`LocalComm`] | ranks as threads over shared memory (a gloo-like in-process backend) |
//! | `MpiComm` (feature `mpi`) | the MPI backend, one process per rank |
//!
//! Nothing here is global: a rank gets its communicators from [`run_local`] or
//! `MpiComm::world` and passes them (or a [`ProcessGroups`]) down explicitly.
//!
//! ```
//! use ferrotron_comm::*;
//! let sums = run_local(4, |world| {
//!     let state = ParallelState::new(4, world.world_rank(), ParallelConfig {
//!         tensor_model_parallel_size: 2,
//!         ..ParallelConfig::default()
//!     })?;
//!     let groups = ProcessGroups::new(state, std::sync::Arc::new(world))?;
//!     // ranks {0, 2} and {1, 3} are the data-parallel groups
//!     let mut g = [groups.state.rank() as f32];
//!     groups.data.all_reduce(&mut g, ReduceOp::Sum)?;
//!     Ok::<_, CommError>(g[0])
//! })
//! .unwrap();
//! assert_eq!(sums, vec![2.0, 4.0, 2.0, 4.0]);
//! ```

mod async_comm;
mod communicator;
mod error;
mod local;
#[cfg(feature = "mpi")]
mod mpi_comm;
mod parallel_state;
mod single;

pub use async_comm::{AsyncComm, CommHandle};
pub use communicator::{Collectives, Communicator, ElemType, Element, ReduceOp};
pub use error::{CommError, Result};
pub use local::{FailureCause, LocalComm, RankFailure, run_local, threads_per_rank};
#[cfg(feature = "mpi")]
pub use mpi_comm::MpiComm;
pub use parallel_state::{GroupKind, ParallelConfig, ParallelState, ProcessGroups, RankCoords};
pub use single::SingleRankComm;
