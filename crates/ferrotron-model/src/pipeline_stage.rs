//! Pipeline stages of a [`GptModel`] (Megatron-Core `GPTModel(pre_process, post_process)`
//! built for one pipeline rank): a stage holds a contiguous run of decoder layers, the
//! embedding when it is the first stage (`pre_process`), the final norm and output layer
//! when it is the last (`post_process`). With tied embeddings the last stage keeps its own
//! copy of the word embedding as the output weight (Megatron's `shared_embedding`); the
//! trainer all-reduces its gradient with the first stage's so the copies stay equal.
//!
//! With the interleaved schedule (`virtual_pipeline_model_parallel_size = vp`) a rank holds
//! `vp` model chunks, chunk `c` being virtual stage `c·pp + rank` of `pp·vp`
//! ([`virtual_stage_layers`], Megatron's `get_transformer_layer_offset` with a virtual rank):
//! one model with the chunks' layers one after the other, run a chunk at a time
//! ([`GptModel::stage_forward`]).
//!
//! A stage's parameters keep their global names (`decoder.layers.<global index>...`), so
//! checkpoints written by any split read back under any other.

use std::ops::Range;

use crate::module::{ModelLayout, ModelPart};
use crate::param_table::dense;
use crate::{GptModel, ModelError, Result};

/// Where a stage sits in the pipeline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageInfo {
    /// Holds the embedding and takes token ids in its first chunk (Megatron's `pre_process`).
    pub pre_process: bool,
    /// Holds the final norm, the output layer and the loss after its last chunk
    /// (`post_process`).
    pub post_process: bool,
    /// Global index of each decoder layer held, in the order of [`GptModel::layers`].
    pub layer_ids: Vec<usize>,
    /// The model chunks: ranges of [`GptModel::layers`], in chunk order (one range without
    /// interleaving).
    pub chunks: Vec<Range<usize>>,
}

/// The part of a model one [`GptModel::stage_forward`] runs: a model chunk's layers, with
/// the embedding before them (`pre_process`) and the head after them (`post_process`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ChunkPart {
    /// Range of `GptModel::layers` to run.
    pub layers: Range<usize>,
    /// The model chunk holding `layers` (its recompute groups apply).
    pub chunk: Range<usize>,
    pub pre_process: bool,
    pub post_process: bool,
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

/// The layers of each model chunk of stage `stage` of `pp` with `vp` chunks per stage:
/// chunk `c` is virtual stage `v = c·pp + stage` and holds layers `v·n..(v + 1)·n`,
/// `n = num_layers / (pp·vp)` (Megatron-Core `get_transformer_layer_offset`).
///
/// # Errors
/// `num_layers` not divisible by `pp·vp` (named with the sizes).
pub fn virtual_stage_layers(
    num_layers: usize,
    pp: usize,
    vp: usize,
    stage: usize,
) -> Result<Vec<Range<usize>>> {
    let stages = pp * vp;
    if stages == 0 || !num_layers.is_multiple_of(stages) {
        return Err(ModelError::Input(format!(
            "num_layers ({num_layers}) is not divisible by pipeline_model_parallel_size ({pp}) x \
             virtual_pipeline_model_parallel_size ({vp})"
        )));
    }
    let n = num_layers / stages;
    Ok((0..vp)
        .map(|c| {
            let v = c * pp + stage;
            v * n..(v + 1) * n
        })
        .collect())
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
        self.pipeline_chunks(&[layers], pre_process, post_process)
    }

    /// The stage of an interleaved pipeline holding the model chunks `chunks` (global layer
    /// ranges, in chunk order; see [`virtual_stage_layers`]): `pre_process` when its first
    /// chunk is the first virtual stage, `post_process` when its last chunk is the last.
    ///
    /// # Errors
    /// No chunks, a chunk empty or outside the model, chunks that overlap, or `self` already
    /// a stage or a tensor-parallel shard.
    pub fn pipeline_chunks(
        &self,
        chunks: &[Range<usize>],
        pre_process: bool,
        post_process: bool,
    ) -> Result<GptModel> {
        if self.stage.is_some() || self.tp.is_some() {
            return Err(ModelError::Input(
                "split pipeline stages from the full model, before tensor parallelism".into(),
            ));
        }
        if chunks.is_empty() {
            return Err(ModelError::Input(
                "a pipeline stage needs a model chunk".into(),
            ));
        }
        let total = self.config().num_layers;
        for layers in chunks {
            if layers.is_empty() || layers.end > total {
                return Err(ModelError::Input(format!(
                    "stage layers {layers:?} are not inside the model's {total} layers"
                )));
            }
        }
        let layer_ids: Vec<usize> = chunks.iter().flat_map(Clone::clone).collect();
        let mut seen = vec![false; total];
        if let Some(&twice) = layer_ids
            .iter()
            .find(|&&i| std::mem::replace(&mut seen[i], true))
        {
            return Err(ModelError::Input(format!(
                "model chunks {chunks:?} hold layer {twice} twice"
            )));
        }
        let c = self.config();
        let part = ModelPart {
            layer_ids: layer_ids.clone(),
            pre_process,
            post_process,
            experts: None,
            expert_tp: Default::default(),
        };
        let layout = ModelLayout::new(c, c.vocab_size, &part);
        // Every parameter of the stage is the full model's of the same name.
        let index: std::collections::HashMap<&str, usize> = self
            .layout()
            .decls()
            .iter()
            .enumerate()
            .map(|(i, d)| (d.name.as_str(), i))
            .collect();
        let params = layout
            .decls()
            .iter()
            .map(|d| self.param_table().view(index[d.name.as_str()]).to_tensor())
            .collect();
        let mut start = 0;
        let local_chunks = chunks
            .iter()
            .map(|l| {
                start += l.len();
                start - l.len()..start
            })
            .collect();
        let stage = StageInfo {
            pre_process,
            post_process,
            layer_ids,
            chunks: local_chunks,
        };
        GptModel::assemble(c.clone(), layout, dense(params), None, Some(stage))
    }

    /// The part of the model this one holds (the whole model unless a stage).
    pub(crate) fn part(&self) -> ModelPart {
        let mut part = match &self.stage {
            Some(s) => ModelPart {
                layer_ids: s.layer_ids.clone(),
                pre_process: s.pre_process,
                post_process: s.post_process,
                experts: None,
                expert_tp: Default::default(),
            },
            None => ModelPart::whole(self.config().num_layers),
        };
        part.experts = self.ep.as_ref().map(crate::ExpertParallel::shard);
        part.expert_tp = self
            .tp
            .as_ref()
            .map_or_else(Default::default, |t| t.experts);
        part
    }

    /// The pipeline stage info, `None` for a whole model.
    pub fn stage_info(&self) -> Option<&StageInfo> {
        self.stage.as_ref()
    }

    /// Takes token ids and holds the embedding (true for a whole model).
    pub fn is_pre_process(&self) -> bool {
        self.stage.as_ref().is_none_or(|s| s.pre_process)
    }

    /// Holds the final norm, output layer and loss (true for a whole model).
    pub fn is_post_process(&self) -> bool {
        self.stage.as_ref().is_none_or(|s| s.post_process)
    }

    /// Global index of `self.layers()[i]`.
    pub fn global_layer(&self, i: usize) -> usize {
        self.layers()[i].number
    }

    /// Model chunks held (`virtual_pipeline_model_parallel_size` on an interleaved stage, 1
    /// otherwise).
    pub fn num_chunks(&self) -> usize {
        self.stage.as_ref().map_or(1, |s| s.chunks.len())
    }

    /// What [`GptModel::stage_forward`] of model chunk `chunk` runs.
    ///
    /// # Errors
    /// `chunk >= num_chunks()`.
    pub(crate) fn chunk_part(&self, chunk: usize) -> Result<ChunkPart> {
        let n = self.num_chunks();
        if chunk >= n {
            return Err(ModelError::Input(format!(
                "model chunk {chunk} of a stage holding {n}"
            )));
        }
        let layers = self
            .stage
            .as_ref()
            .map_or(0..self.layers().len(), |s| s.chunks[chunk].clone());
        Ok(ChunkPart {
            chunk: layers.clone(),
            layers,
            pre_process: self.is_pre_process() && chunk == 0,
            post_process: self.is_post_process() && chunk + 1 == n,
        })
    }

    /// Whether the word embedding is one of this model's parameters: on the first stage,
    /// and on the last stage of a tied model (its output weight).
    pub(crate) fn has_embedding_param(&self) -> bool {
        self.layout().embedding.is_some()
    }

    /// A last stage of a tied model that is not also the first: its embedding parameter is
    /// the shared copy of the output weight (Megatron's `shared_embedding`).
    pub fn holds_shared_embedding_copy(&self) -> bool {
        !self.is_pre_process() && self.has_embedding_param()
    }
}
