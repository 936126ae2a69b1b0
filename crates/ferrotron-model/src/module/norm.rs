//! Norm gains and the vocabulary tables: parameters that are one HF tensor each.

use super::decl::{Declarer, Init, ParamId, ParamRole, whole};
use crate::TpSplit;

/// Declares an RMSNorm gain `[h]` (replicated over tensor-parallel ranks), `mg` and `hf` the
/// Megatron and HF names without `.weight`.
pub(crate) fn declare_norm(
    d: &mut Declarer<'_>,
    mg: &str,
    hf: &str,
    layer: Option<usize>,
) -> ParamId {
    let h = d.c.hidden_size;
    d.push(whole(
        format!("{mg}.weight"),
        format!("{hf}.weight"),
        vec![h],
        TpSplit::Replicated,
        Init::Ones,
        ParamRole::Norm,
        layer,
    ))
}

/// Declares a `[v, h]` vocabulary table (Megatron `VocabParallelEmbedding` / the output
/// layer's `ColumnParallelLinear`): rows split over tensor-parallel ranks after padding.
pub(crate) fn declare_vocab_table(d: &mut Declarer<'_>, mg: &str, hf: &str) -> ParamId {
    let (v, h) = (d.c.vocab_size, d.c.hidden_size);
    let split = TpSplit::Vocab {
        padded: d.padded_vocab,
    };
    d.push(whole(
        mg.to_string(),
        hf.to_string(),
        vec![v, h],
        split,
        Init::Normal,
        ParamRole::Embedding,
        None,
    ))
}
