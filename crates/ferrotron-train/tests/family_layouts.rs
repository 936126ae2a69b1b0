//! The seven families added as config switches (OLMo, OLMo2, Gemma, Phi-3, StarCoder2,
//! Falcon, Bloom) train exactly under the parallel layouts: pp 2, dp 2 and, where the
//! key/value heads split (not the multi-query Gemma and Falcon fixtures), tp 2 with sequence
//! parallelism and tp 2 x pp 2 give the single rank's per-iteration losses and final
//! parameters (in-process ranks, the committed tiny fixtures).

mod common;

use common::layouts::*;
use common::*;
use ferrotron_comm::run_local;
use ferrotron_train::trainer::{TrainError, Trainer};

fn family_layouts_match_one_rank(name: &str, tensor_parallel: bool) {
    let mut one = Trainer::new(fixture(name), dp_options(1, ITERS)).unwrap();
    let reference = train(&mut one, 0, ITERS);
    let reference_cut = without_key_bias(&reference, name);
    assert!(
        reference.0[ITERS - 1] < reference.0[0],
        "{name}: the loss falls: {:?}",
        reference.0
    );
    let mut layouts = vec![(1, 2, 1, false), (1, 1, 2, false)];
    if tensor_parallel {
        layouts.extend([(2, 1, 1, true), (2, 2, 1, false)]);
    }
    for (tp, pp, dp, sp) in layouts {
        let layout = Layout {
            tp,
            pp,
            sp,
            ..Layout::default()
        };
        let label = format!("{name} tp{tp} pp{pp} dp{dp} sp={sp}");
        let runs = run_local(tp * pp * dp, |comm| {
            let mut t = layout.trainer(comm, ITERS, fixture(name))?;
            Ok::<_, TrainError>(train(&mut t, 0, ITERS))
        })
        .unwrap_or_else(|e| panic!("{label}: {e}"));
        for (r, run) in runs.iter().enumerate() {
            assert_same_run(
                &format!("{label} rank {r}"),
                &without_key_bias(run, name),
                &reference_cut,
            );
        }
    }
}

#[test]
fn olmo() {
    family_layouts_match_one_rank("tiny-olmo", true);
}

#[test]
fn olmo2_full_width_qk_norm() {
    family_layouts_match_one_rank("tiny-olmo2", true);
}

#[test]
fn gemma_multi_query() {
    family_layouts_match_one_rank("tiny-gemma", false);
}

#[test]
fn phi3() {
    family_layouts_match_one_rank("tiny-phi3", true);
}

#[test]
fn starcoder2() {
    family_layouts_match_one_rank("tiny-starcoder2", true);
}

#[test]
fn falcon_multi_query() {
    family_layouts_match_one_rank("tiny-falcon", false);
}

#[test]
fn bloom_alibi() {
    family_layouts_match_one_rank("tiny-bloom", true);
}
