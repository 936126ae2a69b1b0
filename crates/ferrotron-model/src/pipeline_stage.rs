//! Pipeline stages of a [`GptModel`] (Megatron-Core `GPTModel(pre_process, post_process)`
//! built for one pipeline rank): a stage holds a contiguous run of decoder layers, the
//! embedding when it is the first stage (`pre_process`), the final norm and output layer
//! when it is the last (`post_process`). With tied embeddings the last stage keeps its own
//! copy of the word embedding as the output weight (Megatron's `shared_embedding`); the
//! trainer all-reduces its gradient with the first stage's so the copies stay equal.
//!
//! A stage's parameters keep their global names (`decoder.layers.<global index>...`), so
//! checkpoints written by any split read back under any other.

use std::ops::Range;

use ferrotron_nn::{Embedding, Linear};
use ferrotron_tensor::Tensor;

use crate::{GptModel, ModelError, Result};

/// Where a stage sits in the pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageInfo {
    /// Holds the embedding and takes token ids (Megatron's `pre_process`).
    pub pre_process: bool,
    /// Holds the final norm, the output layer and the loss (`post_process`).
    pub post_process: bool,
    /// Global index of the stage's first decoder layer.
    pub first_layer: usize,
    /// Decoder layers of the whole model.
    pub total_layers: usize,
}

/// The layers of stage `stage` of `pp` over `num_layers`: even split, or
/// `first_stage_layers` on stage 0 and the rest split evenly (Megatron's
/// `decoder_first_pipeline_num_layers`).
///
/// # Errors
/// The layers do not split as asked (named with the sizes).
pub fn stage_layers(
    num_layers: usize,
    pp: usize,
    stage: usize,
    first_stage_layers: Option<usize>,
) -> Result<Range<usize>> {
    let bad = |msg: String| Err(ModelError::Input(msg));
    match first_stage_layers {
        None if !num_layers.is_multiple_of(pp) => bad(format!(
            "num_layers ({num_layers}) is not divisible by pipeline_model_parallel_size ({pp}) \
             (set decoder_first_pipeline_num_layers for an uneven first stage)"
        )),
        None => {
            let n = num_layers / pp;
            Ok(stage * n..(stage + 1) * n)
        }
        Some(first)
            if pp == 1 || first >= num_layers || !(num_layers - first).is_multiple_of(pp - 1) =>
        {
            bad(format!(
                "decoder_first_pipeline_num_layers ({first}) must leave the other {} stages an equal \
             share of the {num_layers} layers",
                pp.saturating_sub(1)
            ))
        }
        Some(first) => {
            let n = (num_layers - first) / (pp - 1);
            Ok(if stage == 0 {
                0..first
            } else {
                first + (stage - 1) * n..first + stage * n
            })
        }
    }
}

impl GptModel {
    /// The stage holding `layers` of the full model `self` (see the module docs).
    ///
    /// # Errors
    /// `layers` empty or outside the model, or `self` already a stage or a tensor-parallel
    /// shard (split pipeline stages first, then shard each stage).
    pub fn pipeline_stage(
        &self,
        layers: Range<usize>,
        pre_process: bool,
        post_process: bool,
    ) -> Result<GptModel> {
        if self.stage.is_some() || self.tp.is_some() {
            return Err(ModelError::Input(
                "split pipeline stages from the full model, before tensor parallelism".into(),
            ));
        }
        if layers.is_empty() || layers.end > self.layers.len() {
            return Err(ModelError::Input(format!(
                "stage layers {layers:?} are not inside the model's {} layers",
                self.layers.len()
            )));
        }
        let c = &self.config;
        let h = c.hidden_size;
        let tied = !c.untie_embeddings_and_output_weights;
        // Tables a stage does not hold are empty `[0, h]` placeholders.
        let empty = || Tensor::zeros(&[0, h], self.embedding.weight().dtype());
        let embedding = if pre_process || (post_process && tied) {
            self.embedding.clone()
        } else {
            Embedding::new("embedding", empty()?)?
        };
        let output_layer = match &self.output_layer {
            Some(l) if post_process => Some(l.clone()),
            Some(_) => Some(Linear::new("output_layer", empty()?, None)?),
            None => None,
        };
        let mut config = c.clone();
        config.num_layers = layers.len();
        let mut stage = GptModel::new(
            config,
            embedding,
            self.layers[layers.clone()].to_vec(),
            self.final_layernorm.clone(),
            output_layer,
        )?;
        stage.stage = Some(StageInfo {
            pre_process,
            post_process,
            first_layer: layers.start,
            total_layers: self.layers.len(),
        });
        Ok(stage)
    }

    /// The pipeline stage info, `None` for a whole model.
    pub fn stage_info(&self) -> Option<&StageInfo> {
        self.stage.as_ref()
    }

    /// Takes token ids and holds the embedding (true for a whole model).
    pub fn is_pre_process(&self) -> bool {
        self.stage.is_none_or(|s| s.pre_process)
    }

    /// Holds the final norm, output layer and loss (true for a whole model).
    pub fn is_post_process(&self) -> bool {
        self.stage.is_none_or(|s| s.post_process)
    }

    /// Global index of the first decoder layer held.
    pub fn first_layer(&self) -> usize {
        self.stage.map_or(0, |s| s.first_layer)
    }

    /// Whether the word embedding is one of this model's parameters: on the first stage,
    /// and on the last stage of a tied model (its output weight).
    pub(crate) fn has_embedding_param(&self) -> bool {
        self.is_pre_process() || (self.is_post_process() && self.output_layer.is_none())
    }

    /// A last stage of a tied model that is not also the first: its embedding parameter is
    /// the shared copy of the output weight (Megatron's `shared_embedding`).
    pub fn holds_shared_embedding_copy(&self) -> bool {
        !self.is_pre_process() && self.is_post_process() && self.output_layer.is_none()
    }
}
