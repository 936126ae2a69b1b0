//! The trainable parameters of a [`GptModel`] in one fixed order with Megatron-Core names
//! (`megatron/core/models/gpt/gpt_model.py` state-dict keys at tensor-parallel size 1), and
//! copies between the model and flat f32 views (the optimizer's buffers).

use crate::{GptModel, ModelError, Result};
use ferrotron_nn::Linear;
use ferrotron_tensor::{Storage, Tensor};

/// One trainable parameter: its Megatron name, shape and the flags the optimizer needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamInfo {
    /// Megatron name, e.g. `decoder.layers.0.self_attention.linear_qkv.weight`.
    pub name: String,
    /// Shape (`[out, in]` for linear weights, `[v, h]` for the embedding, `[n]` for norms/biases).
    pub shape: Vec<usize>,
    /// A norm gain or a bias (no weight decay by default, as Megatron's
    /// `no_weight_decay_cond`).
    pub is_norm_or_bias: bool,
    /// The word embedding (or the untied output layer): a `[v, h]` table.
    pub is_embedding: bool,
}

impl ParamInfo {
    /// Element count.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Indices into the parameter list of one decoder layer's parameters.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LayerSlots {
    pub norm1: usize,
    pub qkv_w: usize,
    pub qkv_b: Option<usize>,
    pub proj_w: usize,
    pub proj_b: Option<usize>,
    pub norm2: usize,
    pub fc1_w: usize,
    pub fc1_b: Option<usize>,
    pub fc2_w: usize,
    pub fc2_b: Option<usize>,
}

impl LayerSlots {
    /// Every parameter index of the layer.
    pub(crate) fn indices(&self) -> Vec<usize> {
        [
            Some(self.norm1),
            Some(self.qkv_w),
            self.qkv_b,
            Some(self.proj_w),
            self.proj_b,
            Some(self.norm2),
            Some(self.fc1_w),
            self.fc1_b,
            Some(self.fc2_w),
            self.fc2_b,
        ]
        .into_iter()
        .flatten()
        .collect()
    }
}

/// Indices into the parameter list (the order of [`GptModel::parameters`]).
#[derive(Clone, Debug)]
pub(crate) struct Slots {
    /// `None` on a pipeline stage without the word embedding.
    pub embedding: Option<usize>,
    pub layers: Vec<LayerSlots>,
    /// `None` on a pipeline stage before the last.
    pub final_norm: Option<usize>,
    /// `None` when tied (the output layer's gradient goes to `embedding`) or not the last
    /// stage.
    pub output: Option<usize>,
}

/// A borrowed parameter: a tensor in its storage dtype or an f32 slice.
#[derive(Clone, Copy, Debug)]
pub(crate) enum View<'a> {
    Tensor(&'a Tensor),
    F32(&'a [f32]),
}

impl<'a> View<'a> {
    /// The values as f32: borrowed when stored in f32, widened (exactly) otherwise.
    pub(crate) fn to_f32(self) -> std::borrow::Cow<'a, [f32]> {
        match self {
            View::F32(s) => std::borrow::Cow::Borrowed(s),
            View::Tensor(t) => match t.storage() {
                Storage::F32(v) => std::borrow::Cow::Borrowed(v),
                _ => std::borrow::Cow::Owned(t.to_f32_vec()),
            },
        }
    }
}

/// A mutably borrowed parameter.
enum ViewMut<'a> {
    Tensor(&'a mut Tensor),
    F32(&'a mut [f32]),
}

impl GptModel {
    /// Every trainable parameter, in the fixed order all flat views use: the embedding, then per
    /// layer `input_layernorm`, `linear_qkv` (weight, bias), `linear_proj` (weight, bias),
    /// `pre_mlp_layernorm`, `linear_fc1` (weight, bias), `linear_fc2` (weight, bias), then
    /// `final_layernorm` and, when untied, `output_layer`. Biases appear only where the model
    /// has them.
    pub fn parameters(&self) -> Vec<ParamInfo> {
        self.param_views().into_iter().map(|(p, _)| p).collect()
    }

    /// One zeroed f32 vector per parameter, in the order of [`GptModel::parameters`], each
    /// [`ParamInfo::numel`] long: gradient storage for [`GptModel::forward_backward`].
    pub fn zero_grads(&self) -> Vec<Vec<f32>> {
        self.parameters()
            .iter()
            .map(|p| vec![0f32; p.numel()])
            .collect()
    }

    /// Every parameter's values widened to f32 (exact), in the order of
    /// [`GptModel::parameters`].
    pub fn parameters_f32(&self) -> Vec<Vec<f32>> {
        let mut values = self.zero_grads();
        let mut views: Vec<&mut [f32]> = values.iter_mut().map(Vec::as_mut_slice).collect();
        self.copy_parameters_to(&mut views)
            .expect("views built from parameters()");
        values
    }

    /// Copies every parameter, widened to f32, into `dst` (one slice per parameter in the order
    /// of [`GptModel::parameters`], each exactly [`ParamInfo::numel`] long; **overwritten**).
    ///
    /// # Errors
    /// A count or length mismatch.
    pub fn copy_parameters_to(&self, dst: &mut [&mut [f32]]) -> Result<()> {
        let views = self.param_views();
        check_count(views.len(), dst.len())?;
        for ((info, view), d) in views.into_iter().zip(dst.iter_mut()) {
            check_len(&info, d.len())?;
            match view {
                View::F32(s) => d.copy_from_slice(s),
                View::Tensor(t) => match t.storage() {
                    Storage::F32(v) => d.copy_from_slice(v),
                    _ => d.copy_from_slice(&t.to_f32_vec()),
                },
            }
        }
        Ok(())
    }

    /// Writes every parameter from `src` (f32, same order and lengths as
    /// [`GptModel::copy_parameters_to`]). Parameters stored in bf16/f16 are rounded to their
    /// storage dtype (round-to-nearest-even); norms and biases are always f32.
    ///
    /// This is the current training design: the optimizer keeps the f32 master weights in its
    /// own flat buffer and, after each step, copies them into the model with this function
    /// (the model does not alias the optimizer's memory).
    ///
    /// # Errors
    /// A count or length mismatch (nothing is written then).
    pub fn load_parameters_from(&mut self, src: &[&[f32]]) -> Result<()> {
        let infos = self.parameters();
        check_count(infos.len(), src.len())?;
        for (info, s) in infos.iter().zip(src) {
            check_len(info, s.len())?;
        }
        for (view, s) in self.param_views_mut().into_iter().zip(src) {
            match view {
                ViewMut::F32(d) => d.copy_from_slice(s),
                ViewMut::Tensor(t) => write_tensor(t, s)?,
            }
        }
        Ok(())
    }

    /// Parameter `index` (order of [`GptModel::parameters`]) widened to f32 (exact).
    ///
    /// # Errors
    /// No such parameter.
    pub fn parameter_f32(&self, index: usize) -> Result<Vec<f32>> {
        let mut views = self.param_views();
        if index >= views.len() {
            return Err(ModelError::Input(format!(
                "parameter {index} of a model with {} parameters",
                views.len()
            )));
        }
        Ok(views.swap_remove(index).1.to_f32().into_owned())
    }

    /// Writes the parameters `indices` (order of [`GptModel::parameters`]) from `src(i)`
    /// (f32, rounded to the storage dtype as [`GptModel::load_parameters_from`]), building
    /// the parameter views once, so writing a few or all of them costs the copies alone.
    ///
    /// # Errors
    /// An index beyond the parameters, or a source of the wrong length; the parameters
    /// before it in `indices` are written by then.
    pub fn load_parameters_with<'s>(
        &mut self,
        indices: &[usize],
        mut src: impl FnMut(usize) -> std::borrow::Cow<'s, [f32]>,
    ) -> Result<()> {
        let infos = self.parameters();
        let mut views: Vec<Option<ViewMut<'_>>> =
            self.param_views_mut().into_iter().map(Some).collect();
        for &i in indices {
            let (Some(info), Some(view)) = (infos.get(i), views.get_mut(i).and_then(Option::take))
            else {
                return Err(ModelError::Input(format!(
                    "parameter {i} of a model with {} parameters (or given twice)",
                    infos.len()
                )));
            };
            let values = src(i);
            check_len(info, values.len())?;
            match view {
                ViewMut::F32(d) => d.copy_from_slice(&values),
                ViewMut::Tensor(t) => write_tensor(t, &values)?,
            }
        }
        Ok(())
    }

    /// Indices of each parameter in the [`GptModel::parameters`] order.
    pub(crate) fn param_slots(&self) -> Slots {
        let mut next = 0;
        let mut take = || {
            next += 1;
            next - 1
        };
        let embedding = self.has_embedding_param().then(&mut take);
        let layers = self
            .layers
            .iter()
            .map(|l| {
                let norm1 = take();
                let qkv_w = take();
                let qkv_b = l.linear_qkv.bias().map(|_| take());
                let proj_w = take();
                let proj_b = l.linear_proj.bias().map(|_| take());
                let norm2 = take();
                let fc1_w = take();
                let fc1_b = l.mlp.linear_fc1.bias().map(|_| take());
                let fc2_w = take();
                let fc2_b = l.mlp.linear_fc2.bias().map(|_| take());
                LayerSlots {
                    norm1,
                    qkv_w,
                    qkv_b,
                    proj_w,
                    proj_b,
                    norm2,
                    fc1_w,
                    fc1_b,
                    fc2_w,
                    fc2_b,
                }
            })
            .collect();
        let post = self.is_post_process();
        let final_norm = post.then(&mut take);
        let output = self.output_layer.as_ref().filter(|_| post).map(|_| take());
        Slots {
            embedding,
            layers,
            final_norm,
            output,
        }
    }

    pub(crate) fn param_views(&self) -> Vec<(ParamInfo, View<'_>)> {
        let mut out = Vec::new();
        let emb = self.embedding.weight();
        if self.has_embedding_param() {
            out.push((
                info("embedding.word_embeddings.weight", emb.shape(), false, true),
                View::Tensor(emb),
            ));
        }
        for (i, l) in self.layers.iter().enumerate() {
            let p = format!("decoder.layers.{}", self.global_layer(i));
            out.push(norm_view(&p, "input_layernorm", l.input_layernorm.weight()));
            push_linear(
                &mut out,
                &format!("{p}.self_attention.linear_qkv"),
                &l.linear_qkv,
            );
            push_linear(
                &mut out,
                &format!("{p}.self_attention.linear_proj"),
                &l.linear_proj,
            );
            out.push(norm_view(
                &p,
                "pre_mlp_layernorm",
                l.pre_mlp_layernorm.weight(),
            ));
            push_linear(&mut out, &format!("{p}.mlp.linear_fc1"), &l.mlp.linear_fc1);
            push_linear(&mut out, &format!("{p}.mlp.linear_fc2"), &l.mlp.linear_fc2);
        }
        if !self.is_post_process() {
            return out;
        }
        let fw = self.final_layernorm.weight();
        out.push((
            info("decoder.final_layernorm.weight", &[fw.len()], true, false),
            View::F32(fw),
        ));
        if let Some(o) = &self.output_layer {
            out.push((
                info("output_layer.weight", o.weight().shape(), false, true),
                View::Tensor(o.weight()),
            ));
        }
        out
    }

    /// The same order as `param_views`, mutably.
    fn param_views_mut(&mut self) -> Vec<ViewMut<'_>> {
        let (has_embedding, post) = (self.has_embedding_param(), self.is_post_process());
        let mut out = Vec::new();
        if has_embedding {
            out.push(ViewMut::Tensor(self.embedding.weight_mut()));
        }
        for l in self.layers.iter_mut() {
            out.push(ViewMut::F32(l.input_layernorm.weight_mut()));
            push_linear_mut(&mut out, &mut l.linear_qkv);
            push_linear_mut(&mut out, &mut l.linear_proj);
            out.push(ViewMut::F32(l.pre_mlp_layernorm.weight_mut()));
            push_linear_mut(&mut out, &mut l.mlp.linear_fc1);
            push_linear_mut(&mut out, &mut l.mlp.linear_fc2);
        }
        if !post {
            return out;
        }
        out.push(ViewMut::F32(self.final_layernorm.weight_mut()));
        if let Some(o) = &mut self.output_layer {
            out.push(ViewMut::Tensor(o.weight_mut()));
        }
        out
    }
}

fn info(name: &str, shape: &[usize], is_norm_or_bias: bool, is_embedding: bool) -> ParamInfo {
    ParamInfo {
        name: name.to_string(),
        shape: shape.to_vec(),
        is_norm_or_bias,
        is_embedding,
    }
}

fn norm_view<'a>(prefix: &str, name: &str, w: &'a [f32]) -> (ParamInfo, View<'a>) {
    (
        info(&format!("{prefix}.{name}.weight"), &[w.len()], true, false),
        View::F32(w),
    )
}

fn push_linear<'a>(out: &mut Vec<(ParamInfo, View<'a>)>, prefix: &str, l: &'a Linear) {
    out.push((
        info(
            &format!("{prefix}.weight"),
            l.weight().shape(),
            false,
            false,
        ),
        View::Tensor(l.weight()),
    ));
    if let Some(b) = l.bias() {
        out.push((
            info(&format!("{prefix}.bias"), &[b.len()], true, false),
            View::F32(b),
        ));
    }
}

fn push_linear_mut<'a>(out: &mut Vec<ViewMut<'a>>, l: &'a mut Linear) {
    let (w, b) = l.parts_mut();
    out.push(ViewMut::Tensor(w));
    if let Some(b) = b {
        out.push(ViewMut::F32(b));
    }
}

/// Overwrites `t` with `src` in place, rounding to its storage dtype.
fn write_tensor(t: &mut Tensor, src: &[f32]) -> Result<()> {
    Ok(t.copy_from_f32(src)?)
}

fn check_count(want: usize, got: usize) -> Result<()> {
    if want != got {
        return Err(ModelError::Input(format!(
            "{got} parameter slices given, the model has {want} parameters"
        )));
    }
    Ok(())
}

fn check_len(info: &ParamInfo, got: usize) -> Result<()> {
    if info.numel() != got {
        return Err(ModelError::Input(format!(
            "{}: slice of {got} elements, the parameter has {} ({:?})",
            info.name,
            info.numel(),
            info.shape
        )));
    }
    Ok(())
}
