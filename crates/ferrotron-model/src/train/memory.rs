//! Saved-activation memory of [`GptModel::forward_backward`](crate::GptModel::forward_backward):
//! the ledger (`Ledger`) the training pass keeps of the bytes it holds for the backward, and
//! [`TransformerConfig::activation_memory`], which replays the same sequence of holds and
//! releases from the shapes alone (a test checks the two agree for every recompute mode).
//!
//! Counted: everything the forward keeps for the backward (per-layer activations or recompute
//! inputs, the rotary positions, the final norm's input/output/statistic, the logits) and what
//! the backward re-materializes (a recomputed group's activations, core attention's output
//! under selective recompute), each until it is freed. Not counted: parameters, gradients,
//! and transient work buffers (a layer's packed qkv, activation gradients, the activations of
//! a layer the forward runs only to pass its output on).

use super::core_attention::CoreAttnOut;
use super::layer_acts::LayerActs;
use super::mlp::MlpActs;
use super::norm::NormStats;
use super::recompute::{Keep, Run};
use crate::{ModelError, Result, TransformerConfig};

/// Bytes of saved activations currently held, and the most held at once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Ledger {
    held: u128,
    peak: u128,
}

impl Ledger {
    /// `bytes` more are held from now on.
    pub(crate) fn hold(&mut self, bytes: u128) {
        self.held += bytes;
        self.peak = self.peak.max(self.held);
    }

    /// `bytes` held so far are freed.
    pub(crate) fn release(&mut self, bytes: u128) {
        debug_assert!(bytes <= self.held, "releasing more than is held");
        self.held = self.held.saturating_sub(bytes);
    }

    /// The most bytes held at once.
    pub(crate) fn peak(&self) -> u128 {
        self.peak
    }

    /// Bytes held now.
    pub(crate) fn held(&self) -> u128 {
        self.held
    }
}

/// Saved-activation memory of one [`GptModel::forward_backward`](crate::GptModel::forward_backward)
/// call, in bytes (see the [module docs](self) for what is counted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActivationMemory {
    /// The most held at any moment of the forward and backward.
    pub peak_bytes: u64,
    /// Held when the forward ends (all saved layers, the final norm's tensors and the logits).
    pub forward_end_bytes: u64,
    /// Of that, the logits `[s·b, v]` (f32; freed after the output layer's backward).
    pub logits_bytes: u64,
}

/// Bytes of each kind of saved activation of one micro-batch of `rows` tokens.
struct PassSizes {
    /// Each layer's activations, core attention's output excluded (MoE layers keep more).
    layers: Vec<u128>,
    /// Core attention's output and log-sum-exp.
    core: u128,
    /// A `[rows, h]` f32 tensor (a layer input, the final norm's input or output).
    input: u128,
    /// The final norm's statistics.
    final_stats: u128,
    /// The embedding norm's input and statistics (0 without one).
    embedding: u128,
    /// The logits.
    logits: u128,
    /// The rows' positions.
    positions: u128,
}

impl PassSizes {
    fn new(
        c: &TransformerConfig,
        rows: u128,
        saved_dtype: ferrotron_tensor::DType,
    ) -> Result<PassSizes> {
        let f32_rows = |per_row: u128| rows * per_row * size_of::<f32>() as u128;
        let narrow = saved_dtype == ferrotron_tensor::DType::BF16;
        let input = f32_rows(c.hidden_size as u128);
        let final_stats = rows * NormStats::bytes_per_row(c.normalization);
        let common = rows * LayerActs::bytes_per_row(c, narrow);
        let layers = (0..c.num_layers)
            .map(|l| Ok(common + MlpActs::bytes_for(c, l, rows, narrow)?))
            .collect::<Result<_>>()?;
        Ok(PassSizes {
            layers,
            core: rows * CoreAttnOut::bytes_per_row(c, narrow),
            input,
            final_stats,
            embedding: if c.embedding_layernorm {
                input + final_stats
            } else {
                0
            },
            logits: f32_rows(c.vocab_size as u128),
            positions: rows * size_of::<usize>() as u128,
        })
    }

    /// What layer `l` keeps, with or without core attention's output.
    fn kept(&self, l: usize, core_attention: bool) -> u128 {
        self.layers[l] + if core_attention { self.core } else { 0 }
    }

    /// Replays the training forward (`train_forward`) then backward (`train_backward`) over
    /// `runs`: the ledger after the backward (its peak) and the bytes held at the forward's end.
    fn replay(&self, runs: &[Run]) -> (Ledger, u128) {
        let mut m = Ledger::default();
        m.hold(self.embedding);
        m.hold(self.positions);
        for run in runs {
            match run.keep {
                Keep::Each { core_attention } => {
                    run.layers
                        .clone()
                        .for_each(|l| m.hold(self.kept(l, core_attention)));
                }
                Keep::Input => m.hold(self.input),
            }
        }
        for final_tensor in [self.input, self.input, self.logits, self.final_stats] {
            m.hold(final_tensor);
        }
        let forward_end = m.held();
        // Backward: output layer, final norm, then the runs in reverse.
        m.release(self.logits + self.input);
        m.release(self.input + self.final_stats);
        for run in runs.iter().rev() {
            match run.keep {
                Keep::Each { core_attention } => {
                    for l in run.layers.clone() {
                        if !core_attention {
                            m.hold(self.core);
                            m.release(self.core);
                        }
                        m.release(self.kept(l, core_attention));
                    }
                }
                Keep::Input => {
                    m.release(self.input);
                    run.layers.clone().for_each(|l| m.hold(self.kept(l, true)));
                    run.layers
                        .clone()
                        .for_each(|l| m.release(self.kept(l, true)));
                }
            }
        }
        m.release(self.positions);
        m.release(self.embedding);
        debug_assert_eq!(m.held(), 0);
        (m, forward_end)
    }
}

impl TransformerConfig {
    /// The saved-activation memory of a training micro-batch of `micro_batch` sequences of
    /// `seq` tokens under this config's [`recompute_granularity`](Self::recompute_granularity),
    /// replaying what the training forward keeps and the backward frees and recomputes:
    ///
    /// - a kept layer: for the LLaMA skeleton `s·b·(2h + 2)` f32 (residual stream, `1/rms`)
    ///   and `s·b·(2h + (a + 2g)·d + 3f)` elements of the saved dtype (norm outputs, q/k/v,
    ///   fc1 and SwiGLU outputs); the switches change it as the layer's saved activations
    ///   say (LayerNorm means, post-sublayer and q/k norm inputs, one shared norm under
    ///   parallel attention, an ungated `fc1`, multi-latent attention's latents); an MoE
    ///   layer keeps its routing, the `k` routed rows per token through its experts and its
    ///   shared expert instead of the dense MLP's (`train::moe::moe_acts_bytes`); plus
    ///   `s·b·a·dv` (saved dtype) and `s·b·a` f32 for core attention's output and
    ///   log-sum-exp unless selective recompute drops them;
    /// - a recomputed group: its input `s·b·h` until the backward re-runs it, then all of its
    ///   layers' activations, each freed after its backward;
    /// - the positions `s·b` usize, the final norm `s·b·2h` and its statistics, logits
    ///   `s·b·v` f32, and under `embedding_layernorm` the embedding norm's input and
    ///   statistics.
    ///
    /// Activations are saved in f32 here; [`TransformerConfig::activation_memory_in`] gives
    /// the bf16 training pass's ([`GptModel::activation_dtype`](crate::GptModel::activation_dtype)).
    /// A context-parallel rank saves the activations of its share: pass `seq / cp` (its
    /// attention's exchange buffers are transient and not counted).
    ///
    /// # Errors
    /// An invalid config ([`TransformerConfig::validate`]), a zero `micro_batch` or `seq`, MoE
    /// layers with token dropping (the rows they keep depend on the routing), or a total
    /// beyond `u64::MAX` bytes.
    pub fn activation_memory(&self, micro_batch: usize, seq: usize) -> Result<ActivationMemory> {
        self.activation_memory_in(micro_batch, seq, ferrotron_tensor::DType::F32)
    }

    /// [`TransformerConfig::activation_memory`] with activations saved in `saved_dtype`
    /// (bf16 or f32; any other is counted as f32, as the training pass keeps it).
    ///
    /// # Errors
    /// As [`TransformerConfig::activation_memory`].
    pub fn activation_memory_in(
        &self,
        micro_batch: usize,
        seq: usize,
        saved_dtype: ferrotron_tensor::DType,
    ) -> Result<ActivationMemory> {
        self.validate()?;
        for (what, n) in [("micro_batch", micro_batch), ("seq", seq)] {
            if n == 0 {
                return Err(ModelError::Input(format!(
                    "activation memory: {what} must be > 0"
                )));
            }
        }
        let sizes = PassSizes::new(self, micro_batch as u128 * seq as u128, saved_dtype)?;
        let (m, forward_end) = sizes.replay(&self.recompute_runs(0..self.num_layers));
        let logits = sizes.logits;
        let to_u64 = |b: u128| {
            u64::try_from(b).map_err(|_| {
                ModelError::Input(format!(
                    "activation memory: {b} bytes for micro_batch {micro_batch}, seq {seq} \
                     exceed u64"
                ))
            })
        };
        Ok(ActivationMemory {
            peak_bytes: to_u64(m.peak())?,
            forward_end_bytes: to_u64(forward_end)?,
            logits_bytes: to_u64(logits)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::families::load_hf_model;
    use crate::train::memory::Ledger;
    use crate::{RecomputeGranularity, RecomputeMethod, TrainBatch};
    use ferrotron_tensor::DType;
    use std::path::PathBuf;

    /// The ledger of a real pass (what the forward kept, measured from the buffers' lengths)
    /// agrees with the replay from shapes alone, for every mode, at the end of the forward, at
    /// the peak, and back at zero; in f32 and in bf16 training (bf16 activations).
    #[test]
    fn replay_matches_the_real_pass() {
        // Qwen2 (biases), and the switches that change what a layer keeps: LayerNorm with a
        // non-gated MLP (StarCoder2), post-sublayer and q/k norms (OLMo2), parallel
        // attention (Falcon), the embedding norm (Bloom), multi-latent attention's latents
        // and padded heads (DeepSeek-V2, with shared experts), MoE layers (Mixtral; Qwen2-MoE
        // with its gated shared expert, dense layers between).
        for name in [
            "tiny-qwen2",
            "tiny-starcoder2",
            "tiny-olmo2",
            "tiny-falcon",
            "tiny-bloom",
            "tiny-deepseek-v2",
            "tiny-mixtral",
            "tiny-qwen2-moe",
        ] {
            for dtype in [DType::F32, DType::BF16] {
                replay_matches_the_real_pass_in(name, dtype);
            }
        }
    }

    /// Token dropping keeps a data-dependent number of rows: no formula, a clear error.
    #[test]
    fn token_dropping_is_not_modelled() {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-mixtral");
        let (model, _) = load_hf_model(&dir, DType::F32).unwrap();
        let mut c = model.config().clone();
        assert!(c.activation_memory(2, 8).is_ok());
        c.moe.as_mut().unwrap().capacity = Some(crate::ExpertCapacity {
            factor: 1.0,
            drop_policy: crate::DropPolicy::Probs,
            pad_to_capacity: false,
        });
        let err = c.activation_memory(2, 8).unwrap_err().to_string();
        assert!(err.contains("moe_expert_capacity_factor"), "{err}");
    }

    fn replay_matches_the_real_pass_in(name: &str, dtype: DType) {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures")
            .join(name);
        let (loaded, _) = load_hf_model(&dir, dtype).unwrap();
        // Four layers, so uniform 3 leaves a short last group.
        let mut config = loaded.config().clone();
        config.num_layers = 4;
        // The MoE layers (their pattern over the four layers).
        if let Some(moe) = config.moe.as_mut() {
            moe.layer_pattern = (0..4)
                .map(|l| l % 2 == 1 || name == "tiny-mixtral")
                .collect();
        }
        let init = crate::InitConfig {
            params_dtype: dtype,
            ..Default::default()
        };
        let mut model = crate::GptModel::init_random(config, init).unwrap();
        assert_eq!(model.activation_dtype(), dtype);
        let (b, s) = (2, 9);
        let tokens: Vec<u32> = (0..b * s).map(|i| (i * 13 % 100) as u32).collect();
        let labels: Vec<i64> = tokens.iter().map(|&t| (t as i64 + 1) % 100).collect();
        let batch = TrainBatch::from_batch_major(&tokens, &labels, None, b, s);
        let mut modes = vec![None, Some(RecomputeGranularity::Selective)];
        for n in 1..=4 {
            for method in [RecomputeMethod::Uniform, RecomputeMethod::Block] {
                modes.push(Some(RecomputeGranularity::Full {
                    method,
                    num_layers: n,
                }));
            }
        }
        for mode in modes {
            model.set_recompute_granularity(mode).unwrap();
            let want = model.config().activation_memory_in(b, s, dtype).unwrap();
            let mut grads: Vec<Vec<f32>> = model.zero_grads();
            let mut views: Vec<&mut [f32]> = grads.iter_mut().map(|g| g.as_mut_slice()).collect();
            let mut ledger = Ledger::default();
            let mut acts = model
                .train_forward(
                    &batch,
                    model.chunk_part(0).unwrap(),
                    None,
                    Some(1.0),
                    &mut ledger,
                )
                .unwrap();
            assert_eq!(
                ledger.held(),
                want.forward_end_bytes as u128,
                "{name} {mode:?}"
            );
            model.loss_and_logit_grad(&batch, &mut acts, 1.0).unwrap();
            model
                .train_backward(
                    &batch,
                    acts,
                    &mut views,
                    &mut ledger,
                    &mut crate::NoGradHook,
                    None,
                )
                .unwrap();
            assert_eq!(ledger.peak(), want.peak_bytes as u128, "{name} {mode:?}");
            assert_eq!(ledger.held(), 0, "{name} {mode:?}");
        }
    }
}
