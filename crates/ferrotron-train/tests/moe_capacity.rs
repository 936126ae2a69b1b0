//! Token dropping over an expert's capacity (Megatron's `moe_expert_capacity_factor`) and
//! padding every expert's input to it (`moe_pad_expert_input_to_capacity`): dropping changes
//! the run, padding does not — the padded run gives the unpadded run's losses and parameters
//! (within 1e-5) on one rank, and under expert parallelism 2 with the `alltoall` dispatcher
//! (whose exchange then carries fixed row counts) every rank gives the one-rank run.

mod common;

use common::layouts::*;
use common::*;
use ferrotron_comm::run_local;
use ferrotron_model::{DropPolicy, ExpertCapacity, GptModel, LoadBalancing};
use ferrotron_train::trainer::{TrainError, Trainer};

/// The tiny Mixtral with an aux loss, dropping over capacity `factor` (none: dropless),
/// padded to it when `pad`.
fn mixtral(capacity: Option<(f32, bool)>) -> GptModel {
    let mut model = fixture("tiny-mixtral");
    model
        .update_moe(|m| {
            m.load_balancing_type = LoadBalancing::AuxLoss;
            m.capacity = capacity.map(|(factor, pad_to_capacity)| ExpertCapacity {
                factor,
                drop_policy: DropPolicy::Probs,
                pad_to_capacity,
            });
        })
        .unwrap();
    model
}

/// The one-rank run and its largest activation peak (padding adds expert rows).
fn one_rank(model: GptModel) -> (Run, u64) {
    let mut t = Trainer::new(model, dp_options(1, ITERS)).unwrap();
    (train(&mut t, 0, ITERS), t.activation_peak_bytes())
}

#[test]
fn padding_to_capacity_trains_as_dropping_does() {
    let (dropless, _) = one_rank(mixtral(None));
    let (dropping, dropping_peak) = one_rank(mixtral(Some((1.0, false))));
    assert!(
        dropless.0[0] != dropping.0[0],
        "capacity 1.0 drops tokens: {:?} vs {:?}",
        dropless.0,
        dropping.0
    );
    let (padded, padded_peak) = one_rank(mixtral(Some((1.0, true))));
    assert_same_run("padded to capacity, one rank", &padded, &dropping);
    assert!(
        padded_peak > dropping_peak,
        "{padded_peak} vs {dropping_peak}"
    );
    let layout = Layout {
        ep: 2,
        ..Layout::default()
    };
    let runs = run_local(2, |comm| {
        let mut t = layout.trainer(comm, ITERS, mixtral(Some((1.0, true))))?;
        Ok::<_, TrainError>(train(&mut t, 0, ITERS))
    })
    .unwrap_or_else(|e| panic!("{e}"));
    for (r, run) in runs.iter().enumerate() {
        assert_same_run(
            &format!("padded to capacity, ep 2 rank {r}"),
            run,
            &dropping,
        );
    }
}
