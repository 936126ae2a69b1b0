//! `parallelize`: each rank's slice of the tiny fixture (2 layers, 4 heads / 2 query groups,
//! vocab 112) under tp x pp x vp layouts, and layouts the model does not split into, named
//! by their `[parallel]` key.

mod common;

use common::*;
use ferrotron_comm::{ParallelConfig, ParallelState, ProcessGroups, run_local};
use ferrotron_model::GptModel;
use ferrotron_train::{ParallelizeOptions, parallelize};
use std::borrow::Cow;
use std::sync::Arc;

/// What a rank holds: (global layer ids, pre_process, post_process, local heads, local
/// vocabulary rows).
type Slice = (Vec<usize>, bool, bool, usize, usize);

/// What each rank of `world` holds, or its error text.
fn slices(
    world: usize,
    config: ParallelConfig,
    options: ParallelizeOptions,
    full: &GptModel,
) -> Vec<Result<Slice, String>> {
    run_local(world, |comm| {
        let state = ParallelState::new(world, comm.world_rank(), config)?;
        let groups = ProcessGroups::new(state, Arc::new(comm))?;
        Ok::<_, ferrotron_comm::CommError>(
            parallelize(Cow::Borrowed(full), &groups, &options)
                .map(|m| {
                    let layers = m.layers().iter().map(|l| l.number).collect();
                    (
                        layers,
                        m.is_pre_process(),
                        m.is_post_process(),
                        m.local_config().num_attention_heads,
                        m.local_config().vocab_size,
                    )
                })
                .map_err(|e| e.to_string()),
        )
    })
    .unwrap_or_else(|e| panic!("{e}"))
}

fn layout(tp: usize, pp: usize, vp: Option<usize>) -> ParallelConfig {
    ParallelConfig {
        tensor_model_parallel_size: tp,
        pipeline_model_parallel_size: pp,
        virtual_pipeline_model_parallel_size: vp,
        ..ParallelConfig::default()
    }
}

fn four_layers() -> GptModel {
    let mut config = tiny_model().config().clone();
    config.num_layers = 4;
    GptModel::init_random(config, ferrotron_model::InitConfig::default()).unwrap()
}

#[test]
fn one_rank_keeps_the_whole_model() {
    let full = tiny_model();
    let got = slices(1, layout(1, 1, None), ParallelizeOptions::default(), &full);
    assert_eq!(got, vec![Ok((vec![0, 1], true, true, 4, 112))]);
}

/// tp 2 x pp 2 (rank order tp-cp-dp-pp: ranks 0, 1 are stage 0), the vocabulary padded to
/// 2 x 128 rows; pp 2 x vp 2 of four layers: stage 0 holds layers 0 and 2, stage 1 layers 1
/// and 3; an uneven first stage.
#[test]
fn stages_and_shards_follow_megatron() {
    let full = tiny_model();
    let got = slices(4, layout(2, 2, None), ParallelizeOptions::default(), &full);
    let stage0 = Ok((vec![0], true, false, 2, 128));
    let stage1 = Ok((vec![1], false, true, 2, 128));
    assert_eq!(got, vec![stage0.clone(), stage0, stage1.clone(), stage1]);

    let full = four_layers();
    let got = slices(
        2,
        layout(1, 2, Some(2)),
        ParallelizeOptions::default(),
        &full,
    );
    assert_eq!(
        got,
        vec![
            Ok((vec![0, 2], true, false, 4, 112)),
            Ok((vec![1, 3], false, true, 4, 112)),
        ]
    );

    let uneven = ParallelizeOptions {
        decoder_first_pipeline_num_layers: Some(1),
        ..ParallelizeOptions::default()
    };
    let got = slices(4, layout(1, 4, None), uneven, &full);
    let mut want = vec![Ok((vec![0], true, false, 4, 112))];
    want.push(Ok((vec![1], false, false, 4, 112)));
    want.push(Ok((vec![2], false, false, 4, 112)));
    want.push(Ok((vec![3], false, true, 4, 112)));
    assert_eq!(got, want);
}

#[test]
fn layouts_the_model_does_not_take_name_their_key() {
    let full = tiny_model();
    let err = |world, config, options| {
        slices(world, config, options, &full)
            .remove(0)
            .expect_err("the layout does not split the model")
    };
    let e = err(4, layout(4, 1, None), ParallelizeOptions::default());
    assert!(
        e.starts_with("[parallel] tensor_model_parallel_size:") && e.contains("num_query_groups"),
        "{e}"
    );
    let e = err(4, layout(1, 4, None), ParallelizeOptions::default());
    assert!(
        e.starts_with("[parallel] pipeline_model_parallel_size:"),
        "{e}"
    );
    let first = ParallelizeOptions {
        decoder_first_pipeline_num_layers: Some(2),
        ..ParallelizeOptions::default()
    };
    let e = err(2, layout(1, 2, None), first);
    assert!(e.contains("decoder_first_pipeline_num_layers (2)"), "{e}");
    let e = err(2, layout(1, 2, Some(2)), ParallelizeOptions::default());
    assert!(
        e.starts_with("[parallel] virtual_pipeline_model_parallel_size:"),
        "{e}"
    );
}
