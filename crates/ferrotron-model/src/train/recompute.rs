//! Activation recomputation (Megatron-Core `TransformerConfig.recompute_granularity`,
//! `recompute_method`, `recompute_num_layers`; `TransformerBlock._checkpointed_forward` and
//! `tensor_parallel.checkpoint`): which layers the training forward keeps whole and which it
//! keeps only the input of, and the backward of a recomputed group.
//!
//! - no recompute: every layer keeps all its activations (`LayerActs`);
//! - [`RecomputeGranularity::Selective`]: every layer drops core attention's output and
//!   log-sum-exp, recomputed from the saved q/k/v right before the attention backward;
//! - [`RecomputeGranularity::Full`] with [`RecomputeMethod::Uniform`]: groups of `N`
//!   consecutive layers (the last one clamped to the stack, as Megatron's `chunk_end`) keep only
//!   their input `[s·b, h]`;
//! - [`RecomputeGranularity::Full`] with [`RecomputeMethod::Block`]: layers `0..N` keep only
//!   their input, each its own group; the others keep everything.
//!
//! The backward re-runs a group's forward with the same kernels on the same input, saving its
//! activations, then backpropagates through it layer by layer, so gradients and loss are
//! bit-identical to keeping everything.

use super::backward::{Backprop, layer_backward};
use super::core_attention::KeysValues;
use super::forward::{Pass, layer_forward};
use crate::{GptModel, RecomputeGranularity, RecomputeMethod, TransformerConfig};
use ferrotron_tensor::Buffer;
use std::ops::Range;

/// What the forward keeps of each layer of a [`Run`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Keep {
    /// Each layer's activations; core attention's output only when `core_attention`.
    Each { core_attention: bool },
    /// Only the run's input; the backward recomputes the run.
    Input,
}

/// Consecutive layers kept the same way.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    pub layers: Range<usize>,
    pub keep: Keep,
}

impl TransformerConfig {
    /// The runs covering `layers` (a model chunk: every layer of a model without
    /// interleaving) in order, per [`TransformerConfig::recompute_granularity`] applied to
    /// the chunk alone, as each Megatron model chunk is its own `TransformerBlock` (assumed
    /// valid: `recompute_num_layers >= 1`).
    pub(crate) fn recompute_runs(&self, layers: Range<usize>) -> Vec<Run> {
        let (l, offset) = (layers.len(), layers.start);
        let shift = |r: Range<usize>| r.start + offset..r.end + offset;
        let each = |layers, core_attention| Run {
            layers: shift(layers),
            keep: Keep::Each { core_attention },
        };
        let input = |layers| Run {
            layers: shift(layers),
            keep: Keep::Input,
        };
        match self.recompute_granularity {
            None => vec![each(0..l, true)],
            Some(RecomputeGranularity::Selective) => vec![each(0..l, false)],
            Some(RecomputeGranularity::Full {
                method: RecomputeMethod::Uniform,
                num_layers,
            }) => {
                let n = num_layers.max(1);
                (0..l)
                    .step_by(n)
                    .map(|start| input(start..(start + n).min(l)))
                    .collect()
            }
            Some(RecomputeGranularity::Full {
                method: RecomputeMethod::Block,
                num_layers,
            }) => {
                let n = num_layers.min(l);
                (0..n)
                    .map(|i| input(i..i + 1))
                    .chain((n < l).then(|| each(n..l, true)))
                    .collect()
            }
        }
    }

    /// The runs of `chunk` ([`TransformerConfig::recompute_runs`]) inside `layers`, a
    /// range of the chunk made of whole recompute groups (see [`GptModel::layer_groups`]).
    pub(crate) fn recompute_runs_within(
        &self,
        chunk: Range<usize>,
        layers: &Range<usize>,
    ) -> Vec<Run> {
        self.recompute_runs(chunk)
            .into_iter()
            .filter_map(|run| {
                let start = run.layers.start.max(layers.start);
                let end = run.layers.end.min(layers.end);
                (start < end).then_some(Run {
                    layers: start..end,
                    keep: run.keep,
                })
            })
            .collect()
    }
}

impl GptModel {
    /// The finest split of the (single-chunk) model's layers into consecutive groups that
    /// keeps each full-recompute group whole: one group per layer, except that layers
    /// recomputed together from one saved input stay together. Running the groups one after
    /// the other ([`GptModel::part_forward`]) is the same computation as running the model.
    pub fn layer_groups(&self) -> Vec<Range<usize>> {
        self.local_config()
            .recompute_runs(0..self.layers().len())
            .into_iter()
            .flat_map(|run| match run.keep {
                Keep::Input => vec![run.layers],
                Keep::Each { .. } => run.layers.map(|i| i..i + 1).collect(),
            })
            .collect()
    }

    /// Backward of the group `layers` saved as its input `x: [local rows, h]`: re-runs their forward
    /// from `x` keeping every activation, then backpropagates through them in reverse, freeing
    /// each layer's activations after its backward.
    pub(crate) fn recompute_backward(
        &self,
        layers: Range<usize>,
        x: Buffer<f32>,
        pass: &Pass<'_>,
        st: &mut Backprop<'_, '_>,
    ) -> crate::Result<()> {
        // The input moves into the first layer's activations.
        st.ledger.release(x.bytes());
        let mut acts = Vec::with_capacity(layers.len());
        let mut x = x;
        for index in layers.clone() {
            let (la, y) = layer_forward(&self.layers()[index], pass, x, true, KeysValues::Fresh)?;
            st.ledger.hold(la.bytes());
            acts.push(la);
            x = y;
        }
        // `x` is the group's output; the gradient with respect to it is already in `st.dres`.
        drop(x);
        for (index, la) in layers.zip(acts).rev() {
            let layer = &self.layers()[index];
            layer_backward(layer, &la, pass, st)?;
            st.ledger.release(la.bytes());
            st.ready.ready(&layer.param_indices(), st.grads);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(num_layers: usize, recompute: Option<RecomputeGranularity>) -> TransformerConfig {
        // Built valid, then given `num_layers` as is (the tests also need an invalid 0).
        let mut c = TransformerConfig::llama(1, 8, 16, 2, 1, 10, 16).unwrap();
        c.num_layers = num_layers;
        c.recompute_granularity = recompute;
        c
    }

    fn full(method: RecomputeMethod, num_layers: usize) -> Option<RecomputeGranularity> {
        Some(RecomputeGranularity::Full { method, num_layers })
    }

    fn runs(c: &TransformerConfig) -> Vec<(Range<usize>, Keep)> {
        c.recompute_runs(0..c.num_layers)
            .into_iter()
            .map(|r| (r.layers, r.keep))
            .collect()
    }

    const ALL: Keep = Keep::Each {
        core_attention: true,
    };

    #[test]
    fn runs_follow_megatron_grouping() {
        assert_eq!(runs(&config(3, None)), [(0..3, ALL)]);
        let selective = Keep::Each {
            core_attention: false,
        };
        let sel = Some(RecomputeGranularity::Selective);
        assert_eq!(runs(&config(3, sel)), [(0..3, selective)]);
        // Uniform: chunks of N, the last clamped to the stack.
        let uniform = |n| runs(&config(5, full(RecomputeMethod::Uniform, n)));
        assert_eq!(
            uniform(2),
            [
                (0..2, Keep::Input),
                (2..4, Keep::Input),
                (4..5, Keep::Input)
            ]
        );
        assert_eq!(uniform(5), [(0..5, Keep::Input)]);
        assert_eq!(uniform(1).len(), 5);
        // Block: the first N layers one by one, the rest kept.
        let block = |n| runs(&config(5, full(RecomputeMethod::Block, n)));
        assert_eq!(
            block(2),
            [(0..1, Keep::Input), (1..2, Keep::Input), (2..5, ALL)]
        );
        assert_eq!(block(5).len(), 5);
        assert!(
            block(5)
                .iter()
                .all(|(r, k)| r.len() == 1 && *k == Keep::Input)
        );
    }

    #[test]
    fn recompute_num_layers_must_lie_in_one_to_num_layers() {
        for method in [RecomputeMethod::Uniform, RecomputeMethod::Block] {
            for n in [0, 4] {
                let err = config(3, full(method, n))
                    .validate()
                    .unwrap_err()
                    .to_string();
                assert!(
                    err.contains("recompute_num_layers") && err.contains("between 1 and"),
                    "{method:?} {n}: {err}"
                );
            }
            for n in 1..=3 {
                config(3, full(method, n)).validate().unwrap();
            }
        }
        config(3, Some(RecomputeGranularity::Selective))
            .validate()
            .unwrap();
        // num_layers 0 is rejected before the recompute rules.
        let err = config(0, full(RecomputeMethod::Block, 1)).validate();
        assert!(err.unwrap_err().to_string().contains("`num_layers`"));
    }
}
