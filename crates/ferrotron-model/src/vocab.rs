//! Vocabulary expansion (Pai-Megatron-Patch's recipe for continued pretraining in a new
//! language): the `[v, h]` tables grow to a larger vocabulary, each new token's row the mean of
//! the rows of the old tokens it used to be split into (e.g. "天气" = mean("天", "气")), so
//! the model starts out reading a new token as it read its pieces.

use crate::module::{ModelLayout, ModelPart, ParamRole};
use crate::param_table::ParamValue;
use crate::{GptModel, ModelError, Result};
use ferrotron_tensor::Tensor;

/// One token added to the vocabulary: its new id and the old ids its text encoded to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewToken {
    /// Its id in the expanded vocabulary.
    pub id: u32,
    /// The ids the old tokenizer split its text into (non-empty).
    pub pieces: Vec<u32>,
}

impl GptModel {
    /// This whole model with `new_vocab` vocabulary rows: every `[v, h]` table (the word
    /// embedding and, when untied, the output layer, as HF's `resize_token_embeddings`) keeps
    /// its rows, each of `new_tokens` gets the mean of its pieces' rows (computed in f64, then
    /// stored in the model's dtype), and any other added row (padding, e.g. for tensor
    /// parallelism) the mean of all the old rows. Logits over the old vocabulary are
    /// unchanged for any input of old tokens.
    ///
    /// # Errors
    /// A shard or stage; `new_vocab` smaller than the vocabulary; a new token whose id is
    /// outside `new_vocab`, or whose pieces are empty or outside the old vocabulary (naming
    /// the id). (A new token may take an old padding row past the tokenizer's tokens, as HF's
    /// `add_tokens` does when `vocab_size` was padded.)
    pub fn expand_vocab(&self, new_vocab: usize, new_tokens: &[NewToken]) -> Result<GptModel> {
        self.require_whole("the vocabulary is expanded")?;
        let old_vocab = self.config().vocab_size;
        if new_vocab < old_vocab {
            return Err(ModelError::Input(format!(
                "the expanded vocabulary ({new_vocab}) is smaller than the model's ({old_vocab})"
            )));
        }
        for t in new_tokens {
            if t.id as usize >= new_vocab {
                return Err(ModelError::Input(format!(
                    "new token id {} is outside the expanded vocabulary of {new_vocab}",
                    t.id
                )));
            }
            if t.pieces.is_empty() || t.pieces.iter().any(|&p| p as usize >= old_vocab) {
                return Err(ModelError::Input(format!(
                    "new token {}: its pieces {:?} must be ids of the old vocabulary (< {old_vocab})",
                    t.id, t.pieces
                )));
            }
        }
        let mut config = self.config().clone();
        config.vocab_size = new_vocab;
        let h = config.hidden_size;
        let table = self.param_table();
        let values = self
            .layout()
            .decls()
            .iter()
            .enumerate()
            .map(|(i, d)| match d.role {
                ParamRole::Embedding => {
                    let rows = grow(&table.f32_values(i), h, new_vocab, new_tokens);
                    let t = Tensor::from_f32(&[new_vocab, h], rows)?;
                    Ok(ParamValue::Dense(t.to_dtype(self.dtype())))
                }
                _ => Ok(table.value(i)),
            })
            .collect::<Result<Vec<_>>>()?;
        debug_assert_eq!(
            values.len(),
            ModelLayout::new(&config, new_vocab, &ModelPart::whole(config.num_layers))
                .decls()
                .len()
        );
        GptModel::from_values(config, values)
    }
}

/// `old: [old_v, h]` grown to `[new_v, h]`: old rows kept, new tokens' rows the mean of their
/// pieces' rows, other new rows the mean of all old rows.
fn grow(old: &[f32], h: usize, new_v: usize, new_tokens: &[NewToken]) -> Vec<f32> {
    let old_v = old.len() / h;
    let mean = |rows: &mut dyn Iterator<Item = usize>| {
        let mut sum = vec![0f64; h];
        let mut n = 0usize;
        for r in rows {
            sum.iter_mut()
                .zip(&old[r * h..(r + 1) * h])
                .for_each(|(s, &v)| *s += v as f64);
            n += 1;
        }
        sum.into_iter()
            .map(|s| (s / n as f64) as f32)
            .collect::<Vec<f32>>()
    };
    let mut out = old.to_vec();
    let pad = mean(&mut (0..old_v));
    for _ in old_v..new_v {
        out.extend_from_slice(&pad);
    }
    for t in new_tokens {
        let row = mean(&mut t.pieces.iter().map(|&p| p as usize));
        out[t.id as usize * h..][..h].copy_from_slice(&row);
    }
    out
}
