//! The pipeline schedules alone: Megatron's warmup counts and orders, and every program set
//! runs to completion against itself (no deadlock, sends match receives, each forward has
//! its backward) with activations bounded as the schedule says.

use ferrotron_train::pipeline::{
    Action, interleaved_one_f_one_b, no_pipelining, one_f_one_b, simulate,
};

fn computes(program: &[Action]) -> Vec<String> {
    program
        .iter()
        .filter_map(|a| match a {
            Action::Forward { mb, chunk } => Some(format!("F{mb}.{chunk}")),
            Action::Backward { mb, chunk } => Some(format!("B{mb}.{chunk}")),
            _ => None,
        })
        .collect()
}

#[test]
fn no_pipelining_is_gradient_accumulation() {
    let p = no_pipelining(3);
    assert_eq!(
        computes(&p),
        ["F0.0", "B0.0", "F1.0", "B1.0", "F2.0", "B2.0"]
    );
    assert_eq!(p.len(), 6, "one stage sends nothing: {p:?}");
}

#[test]
fn one_f_one_b_follows_megatron() {
    // 4 stages, 6 micro-batches: stage 0 warms up with 3 forwards, the last with none.
    let s0 = computes(&one_f_one_b(4, 0, 6));
    assert_eq!(s0[..5], ["F0.0", "F1.0", "F2.0", "F3.0", "B0.0"]);
    assert_eq!(
        s0[5..],
        ["F4.0", "B1.0", "F5.0", "B2.0", "B3.0", "B4.0", "B5.0"]
    );
    let s3 = computes(&one_f_one_b(4, 3, 6));
    assert_eq!(s3[..4], ["F0.0", "B0.0", "F1.0", "B1.0"]);
    // the first stage receives no activations, the last sends none
    let first = one_f_one_b(4, 0, 6);
    assert!(
        !first
            .iter()
            .any(|a| matches!(a, Action::RecvForward { .. } | Action::SendBackward { .. }))
    );
    let last = one_f_one_b(4, 3, 6);
    assert!(
        !last
            .iter()
            .any(|a| matches!(a, Action::SendForward { .. } | Action::RecvBackward { .. }))
    );
    // a middle stage: receive, forward, send
    let mid = one_f_one_b(4, 1, 6);
    assert_eq!(
        mid[..3],
        [
            Action::RecvForward { mb: 0, chunk: 0 },
            Action::Forward { mb: 0, chunk: 0 },
            Action::SendForward { mb: 0, chunk: 0 }
        ]
    );
}

#[test]
fn one_f_one_b_runs_and_bounds_activations() {
    for pp in 1..=5 {
        for m in 1..=9 {
            let programs: Vec<_> = (0..pp).map(|r| one_f_one_b(pp, r, m)).collect();
            let sim = simulate(&programs, 1, m).unwrap_or_else(|e| panic!("pp {pp} M {m}: {e}"));
            for (r, &peak) in sim.peak_in_flight.iter().enumerate() {
                // warmup forwards plus the steady state's one
                assert_eq!(peak, (pp - r).min(m), "pp {pp} rank {r} M {m}");
            }
        }
    }
}

#[test]
fn interleaved_follows_megatron_and_runs() {
    // pp 2, vp 2, M 4: chunk order of the forwards on rank 0 is 0,0,1,1,0,0,1,1
    let r0 = computes(&interleaved_one_f_one_b(2, 0, 4, 2).unwrap());
    let forwards: Vec<&String> = r0.iter().filter(|s| s.starts_with('F')).collect();
    assert_eq!(
        forwards,
        [
            "F0.0", "F1.0", "F0.1", "F1.1", "F2.0", "F3.0", "F2.1", "F3.1"
        ]
    );
    // warmup = (pp - rank - 1)·2 + (vp - 1)·pp = 4 on rank 0: then the first backward,
    // which runs the last chunk first
    assert_eq!(r0[4], "F2.0");
    assert_eq!(r0[5], "B0.1");
    for pp in 2..=4 {
        for vp in 2..=3 {
            for m in [pp, 2 * pp, 3 * pp] {
                let programs: Vec<_> = (0..pp)
                    .map(|r| interleaved_one_f_one_b(pp, r, m, vp).unwrap())
                    .collect();
                let sim = simulate(&programs, vp, m)
                    .unwrap_or_else(|e| panic!("pp {pp} vp {vp} M {m}: {e}"));
                for (r, &peak) in sim.peak_in_flight.iter().enumerate() {
                    let warmup = if m == pp {
                        m * vp
                    } else {
                        ((pp - r - 1) * 2 + (vp - 1) * pp).min(m * vp)
                    };
                    assert!(
                        peak <= warmup + 1,
                        "pp {pp} vp {vp} M {m} rank {r}: {peak} in flight"
                    );
                }
            }
        }
    }
}

#[test]
fn interleaved_needs_whole_groups_of_microbatches() {
    let err = interleaved_one_f_one_b(4, 0, 6, 2).unwrap_err();
    assert!(err.contains("number of micro-batches (6) to be a positive multiple of pipeline_model_parallel_size (4)"), "{err}");
    assert!(interleaved_one_f_one_b(1, 0, 4, 2).is_err());
}

#[test]
fn the_simulator_finds_broken_programs() {
    // stage 1 never sends its gradients: stage 0 waits for them forever
    let mut programs: Vec<_> = (0..2).map(|r| one_f_one_b(2, r, 2)).collect();
    programs[1].retain(|a| !matches!(a, Action::SendBackward { .. }));
    let err = simulate(&programs, 1, 2).unwrap_err();
    assert!(err.contains("deadlock") && err.contains("rank 0"), "{err}");
    // stage 1 skips micro-batch 0's gradient: the link delivers micro-batch 1's in its place
    let mut programs: Vec<_> = (0..2).map(|r| one_f_one_b(2, r, 2)).collect();
    programs[1].retain(|a| !matches!(a, Action::SendBackward { mb: 0, .. }));
    let err = simulate(&programs, 1, 2).unwrap_err();
    assert!(
        err.contains("RecvBackward { mb: 0, chunk: 0 } finds (kind, mb, chunk) (1, 1, 0) first"),
        "{err}"
    );
    let mut programs: Vec<_> = (0..2).map(|r| one_f_one_b(2, r, 2)).collect();
    programs[0].retain(|a| !matches!(a, Action::Backward { mb: 1, .. }));
    let err = simulate(&programs, 1, 2).unwrap_err();
    assert!(err.contains("no single backward"), "{err}");
}
