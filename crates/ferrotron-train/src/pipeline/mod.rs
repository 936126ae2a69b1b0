//! Pipeline parallelism: the schedules (pure functions, tested alone). The executor that runs
//! them over a communicator with model stages comes with the stage split of the model.

mod schedules;

pub use schedules::{
    Action, PipelineRank, Simulation, interleaved_one_f_one_b, no_pipelining, one_f_one_b, simulate,
};
