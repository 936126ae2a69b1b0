//! Checks across sections, what this build does not support, and the `mpirun` sizing.

use super::*;

/// Keys this build cannot run yet are problems of the configuration itself (a library user
/// of `RunConfig` gets them as the CLI does), each naming its key; so are the EOD flags of
/// a model with no end-of-document id and `skip_train` without a validation split.
#[test]
fn unsupported_and_unrunnable_settings_name_their_key() {
    let dir = data_dir();
    let base = minimal(dir.path());
    let p = problems(
        &base,
        &[
            "data.num_workers=2",
            "optimizer.lr_decay_style=WSD",
            "parallel.expert_model_parallel_size=2",
            "parallel.pipeline_model_parallel_size=2",
            "parallel.overlap_grad_reduce=true",
        ],
    );
    for key in [
        "data.num_workers (the loader uses one worker thread)",
        "optimizer.lr_decay_style = \"WSD\" (no WSD schedule)",
        "parallel.overlap_grad_reduce with pipeline_model_parallel_size > 1 (",
    ] {
        assert!(
            has(&p, &format!("not supported yet: {key}")),
            "{key}: {p:#?}"
        );
    }
    assert_eq!(p.len(), 3, "{p:#?}");

    let p = problems(&base, &["data.eod_mask_loss=true"]);
    assert_eq!(p.len(), 1, "{p:#?}");
    assert!(
        p[0].starts_with("data.eod_mask_loss / reset_position_ids"),
        "{p:#?}"
    );
    let tok = format!(
        "data.tokenizer_model={}",
        dir.path().join("tokenizer.json").display()
    );
    RunConfig::from_toml_str(&base, &["data.eod_mask_loss=true".into(), tok]).unwrap();

    for ov in ["training.eval_iters=0", "data.split=100,0,0"] {
        let p = problems(&base, &["training.skip_train=true", ov]);
        assert_eq!(p.len(), 1, "{ov}: {p:#?}");
        assert!(
            p[0].starts_with("training.skip_train needs validation data"),
            "{p:#?}"
        );
    }
}

/// `mpirun -np N`: the data-parallel size is what the model-parallel sizes leave.
#[test]
fn data_parallel_size_follows_the_mpi_world() {
    let dir = data_dir();
    let base = minimal(dir.path());
    let tp2 = |sets: &[&str]| {
        let mut ov = vec!["parallel.tensor_model_parallel_size=2".to_string()];
        ov.extend(sets.iter().map(|s| s.to_string()));
        RunConfig::from_toml_str(&base, &ov).unwrap()
    };
    assert_eq!(tp2(&[]).data_parallel_size_for_world(6), Ok(3));
    let e = tp2(&[]).data_parallel_size_for_world(5).unwrap_err();
    assert!(
        has(
            &e.problems,
            "mpirun started 5 processes, not a multiple of tensor x context x pipeline parallel sizes (2)"
        ),
        "{e}"
    );
    let e = tp2(&["parallel.data_parallel_size=2"])
        .data_parallel_size_for_world(6)
        .unwrap_err();
    assert!(
        has(
            &e.problems,
            "parallel.data_parallel_size is 2, but 6 processes with model-parallel size 2 give 3"
        ),
        "{e}"
    );
}

/// Context parallelism: the comm type by Megatron's names, `seq_length` in `2·cp` chunks, and
/// what it does not run yet (MoE layers, pairwise datasets), each naming its key.
#[test]
fn context_parallel_settings_name_their_key() {
    let dir = data_dir();
    let base = minimal(dir.path());
    let cfg = RunConfig::from_toml_str(
        &base,
        &[
            "parallel.context_parallel_size=2".into(),
            "parallel.cp_comm_type=a2a".into(),
        ],
    )
    .unwrap();
    assert_eq!(cfg.cp_comm_type, ferrotron_nn::CpCommType::A2a);
    let p = problems(
        &base,
        &[
            "parallel.context_parallel_size=3",
            "parallel.cp_comm_type=ring",
            "model.seq_length=100",
        ],
    );
    assert!(
        has(
            &p,
            "parallel.cp_comm_type: `ring` is not one of p2p, all_gather, a2a"
        ),
        "{p:#?}"
    );
    let p = problems(
        &base,
        &["parallel.context_parallel_size=3", "model.seq_length=100"],
    );
    assert!(
        has(
            &p,
            "model.seq_length (100) must divide by 2 x parallel.context_parallel_size = 6"
        ),
        "{p:#?}"
    );
    // MoE layers train under context parallelism.
    let cfg = RunConfig::from_toml_str(
        &base,
        &[
            "parallel.context_parallel_size=2".into(),
            "moe.num_experts=4".into(),
            "moe.moe_router_topk=2".into(),
        ],
    );
    assert!(cfg.is_ok(), "{:?}", cfg.err());
}

/// The offload keys: the policy by Pai-Megatron-Patch's names, the fraction's range, the
/// directory and the auto policy's budget, each problem naming its key.
#[test]
fn offload_settings_name_their_key() {
    let dir = data_dir();
    let base = minimal(dir.path());
    let path = format!("optimizer.offload_path={:?}", dir.path().to_str().unwrap());
    let cfg = RunConfig::from_toml_str(
        &base,
        &[
            "optimizer.optimizer_offload_policy=static".into(),
            "optimizer.optimizer_offload_fraction=0.25".into(),
            path.clone(),
        ],
    )
    .unwrap();
    assert_eq!(
        cfg.offload.policy,
        ferrotron_optim::offload::OffloadPolicy::Static { fraction: 0.25 }
    );
    let p = problems(
        &base,
        &[
            "optimizer.optimizer_offload_policy=static",
            "optimizer.optimizer_offload_fraction=1.5",
        ],
    );
    assert!(
        has(
            &p,
            "optimizer.optimizer_offload_fraction (1.5) must be in [0, 1]"
        ),
        "{p:#?}"
    );
    assert!(has(&p, "optimizer.offload_path is required"), "{p:#?}");
    let p = problems(&base, &["optimizer.optimizer_offload_policy=auto", &path]);
    assert!(
        has(&p, "optimizer.offload_memory_budget_gib is required"),
        "{p:#?}"
    );
    let p = problems(
        &base,
        &[
            "optimizer.optimizer_offload_policy=disk",
            "optimizer.offload_path=\"/nonexistent\"",
        ],
    );
    assert!(has(&p, "`disk` is not one of none, static, auto"), "{p:#?}");
    assert!(
        has(&p, "optimizer.offload_path /nonexistent is not a directory"),
        "{p:#?}"
    );
}

/// The sharding strategy by Megatron-FSDP's names (unset: what use_distributed_optimizer
/// says), and the options it contradicts, each naming its keys.
#[test]
fn sharding_strategy_names_its_key() {
    use crate::trainer::ShardingStrategy;
    let dir = data_dir();
    let base = minimal(dir.path());
    let strategy = |sets: &[&str]| {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        RunConfig::from_toml_str(&base, &sets).unwrap().sharding
    };
    assert_eq!(strategy(&[]), ShardingStrategy::NoShard);
    let zero1 = ["parallel.use_distributed_optimizer=true"];
    assert_eq!(strategy(&zero1), ShardingStrategy::Optim);
    let zero3 = ["parallel.data_parallel_sharding_strategy=optim_grads_params"];
    assert_eq!(strategy(&zero3), ShardingStrategy::OptimGradsParams);
    let p = problems(&base, &["parallel.data_parallel_sharding_strategy=zero3"]);
    let want = "parallel.data_parallel_sharding_strategy: `zero3` is not one of no_shard, \
                optim, optim_grads, optim_grads_params";
    assert!(has(&p, want), "{p:#?}");
    let p = problems(
        &base,
        &[
            "parallel.data_parallel_sharding_strategy=no_shard",
            "parallel.use_distributed_optimizer=true",
        ],
    );
    assert!(
        has(&p, "contradicts parallel.use_distributed_optimizer"),
        "{p:#?}"
    );
    let p = problems(
        &base,
        &[
            "parallel.data_parallel_sharding_strategy=optim_grads_params",
            "parallel.overlap_param_gather=true",
        ],
    );
    let want = "parallel.data_parallel_sharding_strategy = \"optim_grads_params\" cannot be \
                combined with parallel.overlap_param_gather";
    assert!(has(&p, want), "{p:#?}");
    // ZeRO-2 gathers the updated weights after the step as ZeRO-1 does: overlap allowed.
    let zero2 = [
        "parallel.data_parallel_sharding_strategy=optim_grads",
        "parallel.overlap_param_gather=true",
    ];
    assert_eq!(strategy(&zero2), ShardingStrategy::OptimGrads);
}
