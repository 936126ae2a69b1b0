//! The model's module tree and its parameter declarations.
//!
//! Each module kind declares its parameters **once**, in its own file: Megatron name, full
//! shape, tensor-parallel split (column / row / vocabulary / replicated), init, role (which
//! fixes the storage dtype and weight decay) and the HF tensors that make it up
//! ([`ParamDecl`]). Everything else is derived from those declarations:
//!
//! - the parameter table's order and every flat per-parameter list (gradients, the
//!   optimizer's buffer and buckets): [`ModelLayout::decls`];
//! - tensor-parallel sharding, gathering and checkpoint boxes: [`ParamDecl::split`];
//! - HF loading, export and conversion: [`ParamDecl::hf`]
//!   ([`crate::families::param_mapping`]);
//! - random init: [`ParamDecl::init`]; parameter counts: [`ModelLayout::num_parameters`].
//!
//! Modules keep [`ParamId`]s into the model's table ([`crate::GptModel`] owns the values), so
//! a module struct is small, `Copy` where it can be, and the same for a full model, a
//! tensor-parallel shard and a pipeline stage. Adding a module kind means one file here
//! declaring its parameters and one forward/backward pair using them.

mod attention;
mod decl;
mod layer;
mod layout;
mod linear;
mod lora;
mod mla;
mod mlp;
mod moe;
mod norm;

pub use attention::SelfAttention;
pub(crate) use attention::{pack_qkv, split_qkv};
pub use decl::{HfPart, Init, ParamDecl, ParamId, ParamRole};
pub use layer::TransformerLayer;
pub use layout::{ExpertShard, ExpertTensorParallel, ModelLayout, ModelPart};
pub use linear::LinearParams;
pub use lora::LoraParams;
pub use mla::{LayerAttention, MlaQuery, MlaSelfAttention};
pub use mlp::Mlp;
pub use moe::{LayerMlp, MoeMlp};
pub use norm::Norm;
