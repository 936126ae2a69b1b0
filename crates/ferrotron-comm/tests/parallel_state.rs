//! The process grid against Megatron-Core's documented example and its rules.

use ferrotron_comm::{CommError, GroupKind, ParallelConfig, ParallelState};

fn grid(world: usize, tp: usize, pp: usize, cp: usize, ep: usize) -> ParallelState {
    ParallelState::new(
        world,
        0,
        ParallelConfig {
            tensor_model_parallel_size: tp,
            pipeline_model_parallel_size: pp,
            context_parallel_size: cp,
            expert_model_parallel_size: ep,
            virtual_pipeline_model_parallel_size: None,
        },
    )
    .unwrap()
}

/// The example in the docstring of `initialize_model_parallel` (16 GPUs, tp 2, pp 4).
#[test]
fn megatron_docstring_example() {
    let s = grid(16, 2, 4, 1, 1);
    assert_eq!(s.data_parallel_size(), 2);
    let tp: Vec<Vec<usize>> = (0..8).map(|i| vec![2 * i, 2 * i + 1]).collect();
    assert_eq!(s.all_groups(GroupKind::Tensor), tp);
    assert_eq!(
        s.all_groups(GroupKind::Pipeline),
        vec![
            vec![0, 4, 8, 12],
            vec![1, 5, 9, 13],
            vec![2, 6, 10, 14],
            vec![3, 7, 11, 15]
        ]
    );
    assert_eq!(
        s.all_groups(GroupKind::Data),
        vec![
            vec![0, 2],
            vec![1, 3],
            vec![4, 6],
            vec![5, 7],
            vec![8, 10],
            vec![9, 11],
            vec![12, 14],
            vec![13, 15]
        ]
    );
    assert_eq!(
        s.all_groups(GroupKind::Embedding),
        vec![vec![0, 12], vec![1, 13], vec![2, 14], vec![3, 15]]
    );
    assert_eq!(s.group_of(GroupKind::Embedding, 5), None);
    assert_eq!(
        s.group_of(GroupKind::ModelParallel, 0),
        Some(vec![0, 1, 4, 5, 8, 9, 12, 13])
    );
    let c = s.coords_of(13);
    assert_eq!((c.tp, c.dp, c.pp), (1, 0, 3));
}

/// Every kind partitions the world (embedding: the first and last stages), and each rank's
/// coordinates round-trip through the rank formula.
#[test]
fn groups_partition_the_world() {
    for (world, tp, pp, cp, ep) in [
        (8, 2, 2, 1, 1),
        (8, 1, 2, 2, 2),
        (16, 2, 2, 2, 2),
        (6, 1, 3, 1, 1),
        (4, 1, 1, 1, 4),
    ] {
        let s = grid(world, tp, pp, cp, ep);
        for kind in GroupKind::ALL {
            let mut seen: Vec<usize> = s.all_groups(kind).concat();
            seen.sort_unstable();
            let expected: Vec<usize> = (0..world)
                .filter(|&r| s.group_of(kind, r).is_some())
                .collect();
            assert_eq!(seen, expected, "{kind:?} of {world} {tp} {pp} {cp} {ep}");
        }
        let dp = s.data_parallel_size();
        for r in 0..world {
            let c = s.coords_of(r);
            assert_eq!(c.tp + tp * (c.cp + cp * (c.dp + dp * c.pp)), r);
            let edp = s.expert_data_parallel_size();
            assert_eq!(c.tp + tp * (c.ep + ep * (c.expert_dp + edp * c.pp)), r);
        }
        assert_eq!(s.all_groups(GroupKind::Data).len(), world / dp);
    }
}

#[test]
fn invalid_layouts_name_every_problem() {
    let err = ParallelState::new(
        6,
        7,
        ParallelConfig {
            tensor_model_parallel_size: 4,
            virtual_pipeline_model_parallel_size: Some(2),
            ..ParallelConfig::default()
        },
    )
    .unwrap_err();
    let CommError::Layout(msg) = err else {
        panic!("{err:?}")
    };
    assert!(
        msg.contains("world size 6 is not divisible by tensor_model_parallel_size (4)"),
        "{msg}"
    );
    assert!(
        msg.contains("rank 7 is not below the world size 6"),
        "{msg}"
    );
    assert!(
        msg.contains(
            "virtual_pipeline_model_parallel_size (2) needs pipeline_model_parallel_size > 1"
        ),
        "{msg}"
    );
    let zero = ParallelState::new(
        4,
        0,
        ParallelConfig {
            pipeline_model_parallel_size: 0,
            ..ParallelConfig::default()
        },
    );
    assert!(
        zero.unwrap_err()
            .to_string()
            .contains("pipeline_model_parallel_size must be >= 1")
    );
}
