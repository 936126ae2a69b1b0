use super::*;
use ferrotron_model::{DropPolicy, LoadBalancing, ScoreFunction, TokenDispatcher};

#[test]
fn moe_section_builds_an_moe_model_with_megatron_defaults() {
    let dir = data_dir();
    let text = format!(
        "{}\n[moe]\nnum_experts = 8\nmoe_layer_freq = [0, 1, 1, 1]\n\
         moe_aux_loss_coeff = 0.01\nmoe_expert_capacity_factor = 1.5\n\
         moe_token_dispatcher_type = \"allgather\"\n",
        minimal(dir.path())
    );
    let rc = RunConfig::from_toml_str(&text, &[]).unwrap();
    let moe = rc.moe.build.unwrap();
    assert_eq!(moe.num_experts(), 8);
    assert_eq!(moe.router.topk, 2);
    assert_eq!(moe.router.score_function, ScoreFunction::Softmax);
    assert_eq!(moe.moe_ffn_hidden_size, 1024, "model.ffn_hidden_size (4h)");
    assert_eq!(moe.layer_pattern, vec![false, true, true, true]);
    assert_eq!(moe.load_balancing_type, LoadBalancing::AuxLoss);
    assert_eq!(moe.aux_loss_coeff, 0.01);
    assert_eq!(moe.token_dispatcher, TokenDispatcher::AllGather);
    let capacity = moe.capacity.unwrap();
    assert_eq!(
        (capacity.factor, capacity.drop_policy),
        (1.5, DropPolicy::Probs)
    );
    let every_other = format!(
        "{}\n[moe]\nnum_experts = 4\nmoe_layer_freq = 2\n",
        minimal(dir.path())
    );
    let rc = RunConfig::from_toml_str(&every_other, &[]).unwrap();
    assert_eq!(
        rc.moe.build.unwrap().layer_pattern,
        vec![true, false, true, false]
    );
}

#[test]
fn bad_moe_settings_name_their_key() {
    let dir = data_dir();
    let with = |moe: &str| format!("{}\n[moe]\n{moe}\n", minimal(dir.path()));
    let p = problems(&with("moe_router_topk = 4"), &[]);
    assert!(has(&p, "moe.num_experts"), "{p:?}");
    let p = problems(&with("num_experts = 4\nmoe_router_topk = 5"), &[]);
    assert!(has(&p, "moe_router_topk"), "{p:?}");
    let p = problems(
        &with("num_experts = 4\nmoe_router_load_balancing_type = \"sinkhorn\""),
        &[],
    );
    assert!(has(&p, "moe.moe_router_load_balancing_type"), "{p:?}");
    let p = problems(
        &with("num_experts = 4\nmoe_token_dispatcher_type = \"flex\""),
        &[],
    );
    assert!(has(&p, "moe.moe_token_dispatcher_type"), "{p:?}");
    let p = problems(&with("num_experts = 4\nmoe_layer_freq = [1, 1]"), &[]);
    assert!(has(&p, "moe_layer_freq"), "{p:?}");
    let p = problems(&with("num_experts = 4\nmoe_router_num_groups = 2"), &[]);
    assert!(has(&p, "moe_router_group_topk"), "{p:?}");
    let p = problems(
        &with("num_experts = 4\nmoe_token_drop_policy = \"position\""),
        &[],
    );
    assert!(has(&p, "moe_expert_capacity_factor"), "{p:?}");
    let p = problems(
        &with(
            "num_experts = 4
moe_pad_expert_input_to_capacity = true",
        ),
        &[],
    );
    assert!(
        has(
            &p,
            "moe.moe_pad_expert_input_to_capacity needs moe.moe_expert_capacity_factor"
        ),
        "{p:?}"
    );
    let padded = "num_experts = 4
moe_expert_capacity_factor = 1.0
                  moe_pad_expert_input_to_capacity = true";
    let ok = RunConfig::from_toml_str(&with(padded), &[]);
    assert!(ok.is_ok(), "{:?}", ok.err());
    let p = problems(
        &with(&format!(
            "{padded}
moe_token_dispatcher_type = \"allgather\""
        )),
        &[],
    );
    assert!(has(&p, "moe_pad_expert_input_to_capacity"), "{p:?}");
    let p = problems(
        &format!(
            "{}
[parallel]
tensor_model_parallel_size = 2
expert_tensor_parallel_size = 1
",
            with(padded)
        ),
        &[],
    );
    assert!(
        has(
            &p,
            "not supported yet: moe.moe_pad_expert_input_to_capacity"
        ),
        "{p:?}"
    );
    // With model.load the checkpoint decides the experts.
    let loaded = format!(
        "[model]\nload = \"{}\"\nseq_length = 16\n[data]\ndata_path = \"{}\"\n\
         [training]\ntrain_iters = 1\n[optimizer]\nlr = 1e-4\n[moe]\nnum_experts = 4\n\
         moe_aux_loss_coeff = 0.02\n",
        dir.path().display(),
        dir.path().join("corpus_a").display()
    );
    let p = problems(&loaded, &[]);
    assert!(
        has(&p, "moe.num_experts must be unset with model.load"),
        "{p:?}"
    );
    assert!(!has(&p, "moe_aux_loss_coeff"), "{p:?}");
}

#[test]
fn mla_section_builds_multi_latent_attention_with_megatron_defaults() {
    let dir = data_dir();
    let text = format!(
        "{}\n[mla]\nmulti_latent_attention = true\nq_lora_rank = 32\nkv_lora_rank = 16\n\
         qk_head_dim = 12\nqk_pos_emb_head_dim = 8\nv_head_dim = 10\n\
         mscale_all_dim = 0.707\n",
        minimal(dir.path()).replace("[model]\n", "[model]\nfamily = \"deepseek_v2\"\n")
    );
    let rc = RunConfig::from_toml_str(&text, &[]).unwrap();
    let mla = rc.mla.unwrap();
    assert_eq!(mla.config.q_lora_rank, Some(32));
    assert_eq!(mla.config.attention_head_dim(), 20);
    let ferrotron_tensor::ops::RopeScaling::Yarn(y) = mla.rope_scaling else {
        panic!("Megatron's MLA rope is YaRN by default");
    };
    assert_eq!((y.factor, y.original_max_position_embeddings), (40.0, 4096));
    assert_eq!(y.mscale_all_dim, Some(0.707));
}

#[test]
fn bad_mla_settings_name_their_key() {
    let dir = data_dir();
    let with = |mla: &str| format!("{}\n[mla]\n{mla}\n", minimal(dir.path()));
    let p = problems(&with("kv_lora_rank = 8"), &[]);
    assert!(has(&p, "mla.multi_latent_attention = true"), "{p:?}");
    let p = problems(&with("multi_latent_attention = true"), &[]);
    assert!(has(&p, "model.family = \"deepseek_v2\""), "{p:?}");
    let p = problems(
        &with("multi_latent_attention = true\nrope_type = \"ntk\""),
        &[],
    );
    assert!(has(&p, "mla.rope_type"), "{p:?}");
    let p = problems(
        &with("multi_latent_attention = true\nrotary_scaling_factor = 0.0"),
        &[],
    );
    assert!(has(&p, "mla.rotary_scaling_factor"), "{p:?}");
}

#[test]
fn expert_tensor_parallel_size_is_1_or_tp() {
    let dir = data_dir();
    let text = format!(
        "{}\n[parallel]\ntensor_model_parallel_size = 2\nexpert_tensor_parallel_size = 3\n",
        minimal(dir.path())
    );
    let p = problems(&text, &[]);
    assert!(has(&p, "parallel.expert_tensor_parallel_size (3)"), "{p:?}");
    let ok = text.replace(
        "expert_tensor_parallel_size = 3",
        "expert_tensor_parallel_size = 1",
    );
    assert!(RunConfig::from_toml_str(&ok, &[]).is_ok());
}

#[test]
fn expert_bias_needs_sigmoid_routing() {
    let dir = data_dir();
    let with = |moe: &str| format!("{}\n[moe]\nnum_experts = 4\n{moe}\n", minimal(dir.path()));
    let rc = RunConfig::from_toml_str(
        &with("moe_router_score_function = \"sigmoid\"\nmoe_router_enable_expert_bias = true"),
        &[],
    )
    .unwrap();
    assert_eq!(rc.moe.build.unwrap().expert_bias_update_rate, Some(1e-3));
    let p = problems(&with("moe_router_enable_expert_bias = true"), &[]);
    assert!(has(&p, "moe_router_enable_expert_bias"), "{p:?}");
    let p = problems(&with("moe_router_bias_update_rate = 0.01"), &[]);
    assert!(has(&p, "needs moe.moe_router_enable_expert_bias"), "{p:?}");
}
