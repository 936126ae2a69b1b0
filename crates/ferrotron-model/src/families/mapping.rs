//! The Megatron <-> HF tensor mapping of a model from its config alone (no weights): every
//! Megatron parameter's declaration in table order, with its full shape, tensor-parallel
//! split and the HF tensors that make up its rows (Pai-Megatron-Patch's `hf2mcore` /
//! `mcore2hf` name maps). Converters stream with it; HF loading and export use it too. The
//! declarations come from the module kinds themselves ([`crate::module`]).

use crate::module::{ModelLayout, ModelPart, ParamDecl};
use crate::{Result, TransformerConfig};

/// Every parameter of a model of config `c` (table order of
/// [`crate::GptModel::parameters`]) with its HF tensors; `padded_vocab` rows for the
/// [`crate::TpSplit::Vocab`] splits (`c.vocab_size` when not split, else
/// [`crate::padded_vocab_size`]).
///
/// # Errors
/// An invalid config.
pub fn param_mapping(c: &TransformerConfig, padded_vocab: usize) -> Result<Vec<ParamDecl>> {
    c.validate()?;
    Ok(ModelLayout::new(c, padded_vocab, &ModelPart::whole(c.num_layers)).into_decls())
}
