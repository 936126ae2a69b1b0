//! A model's LoRA adapters as the tensors of a HuggingFace PEFT adapter
//! (`adapter_model.safetensors`, PEFT's `LoraModel` names) and back.
//!
//! PEFT adapts each HF projection on its own (`q_proj`, `k_proj`, `v_proj`, `gate_proj`,
//! `up_proj`, ...); our fused `linear_qkv` / `linear_fc1` carry one adapter whose `A` every
//! projection shares. So the export is exact: each projection's `lora_A` is that `A`, its
//! `lora_B` the rows of `B` that make up the projection (q/k/v interleaved per query group
//! as the base weight's are, [`crate::module::HfPart`]), and `Δ = (alpha/r)·B_q·A` is the
//! same matrix PEFT computes. Importing needs the projections of one fused layer to share
//! their `lora_A` (bit for bit), as an adapter made that way does.

use crate::lora::LoraConfig;
use crate::module::{HfPart, LinearParams, ParamId};
use crate::{GptModel, ModelError, Result};

/// PEFT's prefix of every module name in a saved adapter (`PeftModel.base_model.model`).
const PEFT_PREFIX: &str = "base_model.model.";

/// One tensor of a PEFT adapter: its name in `adapter_model.safetensors` and its `[rows,
/// cols]` f32 values (row-major).
#[derive(Clone, Debug, PartialEq)]
pub struct PeftTensor {
    /// E.g. `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.
    pub name: String,
    /// `[r, in]` for `lora_A`, `[out, r]` for `lora_B`.
    pub shape: [usize; 2],
    /// Row-major values.
    pub values: Vec<f32>,
}

/// The HF module (`model.layers.0.self_attn.q_proj`) of a base weight's HF part.
fn hf_module(part: &HfPart) -> &str {
    part.name.strip_suffix(".weight").unwrap_or(&part.name)
}

fn peft_name(part: &HfPart, matrix: &str) -> String {
    format!("{PEFT_PREFIX}{}.{matrix}.weight", hf_module(part))
}

/// The HF modules of `model` that carry an adapter (PEFT's `target_modules` as full module
/// names, e.g. `model.layers.0.self_attn.q_proj`), in table order.
pub fn peft_module_names(model: &GptModel) -> Vec<String> {
    model
        .adapted_linears()
        .flat_map(|p| model.layout().decl(p.weight).hf.clone())
        .map(|part| hf_module(&part).to_string())
        .collect()
}

impl GptModel {
    /// The linear layers that carry an adapter.
    fn adapted_linears(&self) -> impl Iterator<Item = LinearParams> + '_ {
        self.linear_params().filter(|p| p.lora.is_some())
    }

    /// Every adapter as PEFT tensors (`lora_A`, then `lora_B`, per HF projection in table
    /// order); see the module doc. Whole models only.
    ///
    /// # Errors
    /// A shard or stage, or a model without adapters.
    pub fn peft_tensors(&self) -> Result<Vec<PeftTensor>> {
        self.require_adapters()?;
        let mut out = Vec::new();
        for p in self.adapted_linears() {
            let a = p.lora.expect("adapted");
            let a_view = self.param(a.linear_in);
            let (r, k) = (a_view.shape()[0], a_view.shape()[1]);
            let a_values = a_view.to_f32().into_owned();
            let b = self.param(a.linear_out).to_f32();
            for part in &self.layout().decl(p.weight).hf {
                out.push(PeftTensor {
                    name: peft_name(part, "lora_A"),
                    shape: [r, k],
                    values: a_values.clone(),
                });
                let rows: Vec<f32> = part
                    .rows
                    .iter()
                    .flat_map(|range| &b[range.start * r..range.end * r])
                    .copied()
                    .collect();
                out.push(PeftTensor {
                    name: peft_name(part, "lora_B"),
                    shape: [rows.len() / r, r],
                    values: rows,
                });
            }
        }
        Ok(out)
    }

    /// Sets every adapter from a PEFT adapter's tensors, `get(name)` giving the tensor of
    /// that name ([`GptModel::peft_tensors`]' names and shapes). Whole models only.
    ///
    /// # Errors
    /// A shard or stage, a model without adapters, a missing tensor or one of another
    /// shape (naming it), or projections of one fused layer whose `lora_A` differ (naming
    /// both). The adapters written before the error keep their new values.
    pub fn load_peft_tensors(
        &mut self,
        mut get: impl FnMut(&str) -> Option<PeftTensor>,
    ) -> Result<()> {
        self.require_adapters()?;
        let linears: Vec<LinearParams> = self.adapted_linears().collect();
        for p in linears {
            let a = p.lora.expect("adapted");
            let r = self.param(a.linear_in).shape()[0];
            let (a_values, b_values) = self.fused_from_peft(p.weight, r, &mut get)?;
            let in_name = self.layout().decl(a.linear_in).name.clone();
            self.param_table_mut()
                .set_from_f32(a.linear_in.index(), &in_name, &a_values)?;
            let out_name = self.layout().decl(a.linear_out).name.clone();
            self.param_table_mut()
                .set_from_f32(a.linear_out.index(), &out_name, &b_values)?;
        }
        Ok(())
    }

    /// The fused adapter of the linear layer whose weight is `weight` (`[out, in]`), rank
    /// `r`, from its projections' PEFT tensors: `A: [r, in]` (the projections' shared
    /// `lora_A`) and `B: [out, r]` (their `lora_B` rows where the projections' rows sit in
    /// the fused weight), both row-major.
    ///
    /// # Errors
    /// A missing tensor or one of another shape, or projections whose `lora_A` differ (each
    /// named).
    pub(crate) fn fused_from_peft(
        &self,
        weight: ParamId,
        r: usize,
        get: &mut impl FnMut(&str) -> Option<PeftTensor>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let parts = self.peft_parts(weight, r, get)?;
        if let Some(name) = parts.absent.first() {
            return Err(ModelError::Input(format!(
                "PEFT adapter tensor {name} is missing"
            )));
        }
        if let [(first, _), (other, _), ..] = parts.blocks.as_slice() {
            return Err(ModelError::Input(format!(
                "{other} differs from {first}: the fused layer {} has one adapter, so its \
                 projections must share lora_A",
                self.layout().decl(weight).name
            )));
        }
        let b = parts.fused_b(self.layout().decl(weight).shape[0], r);
        let (_, a) = parts
            .blocks
            .into_iter()
            .next()
            .expect("a linear weight has an HF part");
        Ok((a, b))
    }

    /// The adapter of the linear layer whose weight is `weight` (`[out, in]`) in a PEFT
    /// adapter of rank `r` that adapts any of its projections, each with its own `lora_A`
    /// (how PEFT trains them): the distinct `lora_A`s stacked, `A: [n·r, in]`, and
    /// `B: [out, n·r]` with each projection's `lora_B` in its rows and its `A`'s columns,
    /// zero elsewhere, so `B·A` is exactly the projections' `B_p·A_p` side by side (rows of
    /// projections the adapter leaves alone stay zero). Projections that share their
    /// `lora_A` share its block, so an adapter made for the fused layer keeps rank `r`.
    /// `None` when the adapter has no tensor for the layer.
    ///
    /// # Errors
    /// A `lora_A` without its `lora_B`, or a tensor of another shape (each named).
    pub(crate) fn stacked_from_peft(
        &self,
        weight: ParamId,
        r: usize,
        get: &mut impl FnMut(&str) -> Option<PeftTensor>,
    ) -> Result<Option<(Vec<f32>, Vec<f32>)>> {
        let parts = self.peft_parts(weight, r, get)?;
        if parts.blocks.is_empty() {
            return Ok(None);
        }
        let b = parts.fused_b(self.layout().decl(weight).shape[0], r);
        let a = parts.blocks.into_iter().flat_map(|(_, a)| a).collect();
        Ok(Some((a, b)))
    }

    /// The PEFT tensors of the projections fused in the linear layer whose weight is
    /// `weight`, rank `r`: the distinct `lora_A`s, each `lora_B`, and the projections
    /// without a `lora_A`.
    ///
    /// # Errors
    /// A `lora_A` without its `lora_B`, or a tensor of another shape (each named).
    fn peft_parts(
        &self,
        weight: ParamId,
        r: usize,
        get: &mut impl FnMut(&str) -> Option<PeftTensor>,
    ) -> Result<PeftParts> {
        let decl = self.layout().decl(weight);
        let inp = decl.shape[1];
        let mut parts = PeftParts::default();
        for part in &decl.hf {
            let a_name = peft_name(part, "lora_A");
            let Some(a) = get(&a_name) else {
                parts.absent.push(a_name);
                continue;
            };
            let a = shaped(a, &a_name, [r, inp])?.values;
            let rows: usize = part.rows.iter().map(|range| range.len()).sum();
            let b = fetch(get, &peft_name(part, "lora_B"), [rows, r])?.values;
            let block = match parts.blocks.iter().position(|(_, x)| *x == a) {
                Some(i) => i,
                None => {
                    parts.blocks.push((a_name, a));
                    parts.blocks.len() - 1
                }
            };
            parts.lora_b.push((part.rows.clone(), b, block));
        }
        Ok(parts)
    }

    fn require_adapters(&self) -> Result<()> {
        self.require_whole("PEFT adapters are mapped")?;
        if self.config().lora.is_none() {
            return Err(ModelError::Input("the model has no LoRA adapters".into()));
        }
        Ok(())
    }
}

/// The PEFT tensors of one fused linear layer ([`GptModel::peft_parts`]).
#[derive(Default)]
struct PeftParts {
    /// The distinct `lora_A`s `[r, in]`, each with the name of the first projection that has
    /// it.
    blocks: Vec<(String, Vec<f32>)>,
    /// Each adapted projection's rows in the fused weight, its `lora_B` `[rows, r]` and the
    /// index of its `lora_A` in `blocks`.
    lora_b: Vec<(Vec<std::ops::Range<usize>>, Vec<f32>, usize)>,
    /// The `lora_A` names of the projections the adapter leaves alone.
    absent: Vec<String>,
}

impl PeftParts {
    /// `B: [out, blocks·r]`: each projection's `lora_B` in its rows and its block's columns,
    /// zero elsewhere.
    fn fused_b(&self, out: usize, r: usize) -> Vec<f32> {
        let width = self.blocks.len() * r;
        let mut b = vec![0f32; out * width];
        for (ranges, values, block) in &self.lora_b {
            let mut src = values.chunks_exact(r);
            for row in ranges.iter().cloned().flatten() {
                let at = row * width + block * r;
                b[at..at + r].copy_from_slice(src.next().expect("rows counted"));
            }
        }
        b
    }
}

/// `get(name)`, checked to exist with `shape`.
fn fetch(
    get: &mut impl FnMut(&str) -> Option<PeftTensor>,
    name: &str,
    shape: [usize; 2],
) -> Result<PeftTensor> {
    let t = get(name)
        .ok_or_else(|| ModelError::Input(format!("PEFT adapter tensor {name} is missing")))?;
    shaped(t, name, shape)
}

/// `t` (the tensor `name`), checked to have `shape`.
fn shaped(t: PeftTensor, name: &str, shape: [usize; 2]) -> Result<PeftTensor> {
    if t.shape != shape || t.values.len() != shape[0] * shape[1] {
        return Err(ModelError::Input(format!(
            "PEFT adapter tensor {name} is {:?} ({} values), the model needs {shape:?}",
            t.shape,
            t.values.len()
        )));
    }
    Ok(t)
}

impl GptModel {
    /// The [`LoraConfig`] that puts adapters exactly where a PEFT adapter of rank `r` and
    /// `alpha` has them: `adapted(module)` says whether the adapter holds tensors for an HF
    /// module (`model.layers.0.self_attn.q_proj`). A module kind adapted in every layer is
    /// named bare (`linear_qkv`), otherwise each adapted layer by its Megatron name.
    ///
    /// # Errors
    /// Some but not all of a fused layer's projections adapted (naming them), or none at
    /// all.
    pub fn peft_lora_config(
        &self,
        rank: usize,
        alpha: f32,
        adapted: impl Fn(&str) -> bool,
    ) -> Result<LoraConfig> {
        let mut targets: Vec<String> = Vec::new();
        let mut kinds: Vec<(String, usize)> = Vec::new();
        for p in self.linear_params() {
            let decl = self.layout().decl(p.weight);
            let module = decl.name.strip_suffix(".weight").unwrap_or(&decl.name);
            let parts: Vec<&str> = decl.hf.iter().map(hf_module).collect();
            let on: Vec<bool> = parts.iter().map(|m| adapted(m)).collect();
            if on.iter().all(|&b| !b) {
                continue;
            }
            if on.iter().any(|&b| !b) {
                return Err(ModelError::Input(format!(
                    "the PEFT adapter adapts only some of {parts:?}, which {module} fuses: it \
                     takes one adapter for all of them"
                )));
            }
            let kind = module.rsplit('.').next().unwrap_or(module).to_string();
            match kinds.iter_mut().find(|(k, _)| *k == kind) {
                Some((_, n)) => *n += 1,
                None => kinds.push((kind, 1)),
            }
            targets.push(module.to_string());
        }
        if targets.is_empty() {
            return Err(ModelError::Input(
                "the PEFT adapter adapts none of the model's linear layers".into(),
            ));
        }
        let layers = self.layers().len();
        let whole: Vec<&String> = kinds
            .iter()
            .filter(|(_, n)| *n == layers)
            .map(|(k, _)| k)
            .collect();
        targets.retain(|t| !whole.iter().any(|k| t.ends_with(&format!(".{k}"))));
        let mut target_modules: Vec<String> = whole.into_iter().cloned().collect();
        target_modules.extend(targets);
        let lora = LoraConfig {
            target_modules,
            rank,
            alpha,
            dropout: 0.0,
        };
        lora.validate()?;
        Ok(lora)
    }
}
