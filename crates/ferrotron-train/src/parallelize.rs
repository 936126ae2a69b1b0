//! [`parallelize`]: this rank's slice of the full model for any tensor x pipeline x virtual
//! pipeline layout (Megatron-LM's `model_provider` + `get_model` in
//! `megatron/training/training.py`, which build a `GPTModel` with `pre_process` /
//! `post_process` per pipeline rank, one model chunk per virtual stage, and tensor-parallel
//! layers of the local sizes).
//!
//! The order is Megatron's and the model's: pipeline stage first (the layers of this rank's
//! stage, or of its model chunks under the interleaved schedule), then the tensor-parallel
//! shard of that stage, then its experts' share. The data-parallel and context-parallel
//! ranks of a slice hold the same weights; a context-parallel rank's slice also carries its
//! group, over which core attention runs.

use ferrotron_comm::ProcessGroups;
use ferrotron_model::module::ExpertTensorParallel;
use ferrotron_model::{ExpertParallel, GptModel, ModelError, stage_layers, virtual_stage_layers};
use ferrotron_nn::{ContextParallel, CpCommType, TensorParallel};
use std::borrow::Cow;
use std::ops::Range;

/// The model-layout settings of a run beyond the sizes of its process grid (Megatron's
/// `--sequence-parallel`, `--make-vocab-size-divisible-by`,
/// `--decoder-first-pipeline-num-layers`, `--cp-comm-type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParallelizeOptions {
    /// Split norms and residuals along the sequence over the tensor-parallel ranks
    /// (`parallel.sequence_parallel`); only with `tensor_model_parallel_size > 1`.
    pub sequence_parallel: bool,
    /// Pad the vocabulary to a multiple of this times `tensor_model_parallel_size` rows
    /// when the embedding is split (`model.make_vocab_size_divisible_by`, Megatron's
    /// default 128); >= 1.
    pub make_vocab_size_divisible_by: usize,
    /// Decoder layers of the first pipeline stage, the rest split evenly over the others
    /// (`parallel.decoder_first_pipeline_num_layers`); `None` = an even split. Not with a
    /// virtual pipeline size > 1 (the interleaved split is even).
    pub decoder_first_pipeline_num_layers: Option<usize>,
    /// How tensor parallelism holds the routed experts
    /// (`parallel.expert_tensor_parallel_size`: tp splits them, 1 keeps them whole).
    pub expert_tensor_parallel: ExpertTensorParallel,
    /// How core attention exchanges keys and values over the context-parallel group
    /// (`parallel.cp_comm_type`); used when `context_parallel_size > 1`.
    pub cp_comm_type: CpCommType,
}

impl Default for ParallelizeOptions {
    /// No sequence parallelism, Megatron's 128, an even pipeline split.
    fn default() -> Self {
        ParallelizeOptions {
            sequence_parallel: false,
            make_vocab_size_divisible_by: 128,
            decoder_first_pipeline_num_layers: None,
            expert_tensor_parallel: ExpertTensorParallel::Split,
            cp_comm_type: CpCommType::P2p,
        }
    }
}

/// A layout the model does not split into, naming the `[parallel]` key it concerns.
#[derive(Debug, thiserror::Error)]
#[error("[parallel] {key}: {error}")]
pub struct ParallelizeError {
    /// The `[parallel]` key whose size the model does not divide by, e.g.
    /// `"tensor_model_parallel_size"`.
    pub key: &'static str,
    /// The model's reason.
    pub error: ModelError,
}

/// This rank's slice of `full` under the layout of `groups` (its `ParallelState`: the
/// tensor, pipeline and virtual pipeline sizes and this rank's coordinates) and `options`.
///
/// - Pipeline parallelism (`p > 1`): the layers of stage `s` = this rank's pipeline
///   coordinate — an even split of `num_layers / p` layers, or
///   `decoder_first_pipeline_num_layers` on stage 0 and the rest split evenly
///   ([`stage_layers`]); with a virtual pipeline size `vp > 1` the `vp` model chunks of
///   `num_layers / (p·vp)` layers each, chunk `c` being virtual stage `c·p + s`
///   ([`virtual_stage_layers`]). Stage 0 holds the embedding (`pre_process`), stage `p - 1`
///   the final norm and output layer (`post_process`, and its own copy of a tied embedding);
///   parameters keep their global names ([`GptModel::pipeline_chunks`]).
/// - Tensor parallelism (`t > 1`): the stage's shard over `groups.tensor`
///   ([`GptModel::tensor_parallel_shard_with`]): `a/t` heads, `g/t` query groups, `f/t` FFN
///   columns and `v'/t` vocabulary rows, `v'` = `v` padded to a multiple of
///   `make_vocab_size_divisible_by · t`, the routed experts' widths split or whole as
///   `expert_tensor_parallel` says; with `sequence_parallel` the activations between
///   the tensor-parallel regions are split along `s`.
/// - Context parallelism (`context_parallel_size > 1`): the slice runs its training passes
///   over `groups.context` ([`GptModel::set_context_parallel`], keys and values exchanged
///   as `cp_comm_type` says).
/// - None of these: `full` itself (no copy when it is owned).
///
/// A borrowed `full` is never copied whole when it is split (a stage copies its layers,
/// a shard its part of every parameter), so many in-process ranks can slice one model.
///
/// # Errors
/// [`ParallelizeError`] naming the key: `pipeline_model_parallel_size` (the message names
/// `decoder_first_pipeline_num_layers` when that is set) or
/// `virtual_pipeline_model_parallel_size` when the layers do not split as asked, `tensor_model_parallel_size` when the heads, query groups
/// or FFN size do not divide by `t`, or `full` is already a stage or a shard.
pub fn parallelize(
    full: Cow<'_, GptModel>,
    groups: &ProcessGroups,
    options: &ParallelizeOptions,
) -> Result<GptModel, ParallelizeError> {
    let state = &groups.state;
    let (t, p) = (
        state.tensor_model_parallel_size(),
        state.pipeline_model_parallel_size(),
    );
    let staged = if p > 1 {
        let stage = state.coords().pp;
        let (key, chunks) = stage_chunks(
            full.config().num_layers,
            p,
            state.virtual_pipeline_model_parallel_size(),
            stage,
            options.decoder_first_pipeline_num_layers,
        );
        let chunks = chunks.map_err(|error| ParallelizeError { key, error })?;
        let stage_model = full
            .pipeline_chunks(&chunks, stage == 0, stage + 1 == p)
            .map_err(|error| ParallelizeError { key, error })?;
        Cow::Owned(stage_model)
    } else {
        full
    };
    let sharded = if t > 1 {
        let group = TensorParallel::new(groups.tensor.clone(), options.sequence_parallel);
        let (divisible_by, experts) = (
            options.make_vocab_size_divisible_by,
            options.expert_tensor_parallel,
        );
        let key = match experts {
            ExpertTensorParallel::Split => "tensor_model_parallel_size",
            ExpertTensorParallel::Whole => "expert_tensor_parallel_size",
        };
        let shard = staged
            .tensor_parallel_shard_with(group, divisible_by, experts)
            .map_err(|error| ParallelizeError { key, error })?;
        Cow::Owned(shard)
    } else {
        staged
    };
    let mut model = if state.expert_model_parallel_size() == 1 {
        sharded.into_owned()
    } else {
        sharded
            .expert_parallel_shard(ExpertParallel::new(groups.expert.clone()))
            .map_err(|error| ParallelizeError {
                key: "expert_model_parallel_size",
                error,
            })?
    };
    if state.config().context_parallel_size > 1 {
        let cp = ContextParallel::new(groups.context.clone(), options.cp_comm_type);
        model
            .set_context_parallel(cp)
            .map_err(|error| ParallelizeError {
                key: "context_parallel_size",
                error,
            })?;
    }
    Ok(model)
}

/// The global layer ranges of stage `stage`'s model chunks (one without interleaving) and
/// the `[parallel]` key an error concerns.
fn stage_chunks(
    num_layers: usize,
    pp: usize,
    vp: usize,
    stage: usize,
    first_stage_layers: Option<usize>,
) -> (&'static str, Result<Vec<Range<usize>>, ModelError>) {
    if vp > 1 {
        return (
            "virtual_pipeline_model_parallel_size",
            virtual_stage_layers(num_layers, pp, vp, stage),
        );
    }
    (
        "pipeline_model_parallel_size",
        stage_layers(num_layers, pp, stage, first_stage_layers).map(|l| vec![l]),
    )
}
