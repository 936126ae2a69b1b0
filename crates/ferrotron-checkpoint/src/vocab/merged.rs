//! "Merged" vocabulary expansion: new tokens join the BPE model itself (its `vocab` and
//! `merges` in `tokenizer.json`), as when a tokenizer trained on the new language's text is
//! merged into the old one (Chinese-LLaMA's and Pai-Megatron-Patch's recipe), instead of
//! being matched as added tokens before the model runs.
//!
//! A token's text is split by the tokenizer as it stands (normalizer, pre-tokenizer, BPE)
//! into pieces `p₀ … pₙ₋₁`; the pieces are joined by a binary tree of new merges, appended
//! after every existing merge (so no old merge changes rank and text without the new strings
//! encodes as before), each node's string joining the vocabulary unless it is there already.
//! The tree is the one needing the fewest new vocabulary entries (intervals DP), so an
//! intermediate string the vocabulary already has is reused; among those, the one with the
//! fewest new entries that end inside a character (bytes of a UTF-8 character split), so
//! "天气" is built from "天" and "气" as a BPE trained on Chinese text would; then the
//! leftmost split.
//! Merges act within one pre-tokenized word, so a token the pre-tokenizer splits (e.g. one
//! with an inner space under GPT-2's regex) cannot be merged: that is an error suggesting
//! the added mode.

use std::collections::{HashMap, HashSet};

use ahash::AHashMap;
use ferrotron_model::NewToken;
use serde_json::Value;
use tokenizers::models::bpe::BPE;
use tokenizers::{Model, ModelWrapper, Tokenizer};

/// A tokenizer with tokens merged into its BPE model.
pub(super) struct MergedBpe {
    /// The tokenizer with the grown vocabulary and merges.
    pub tokenizer: Tokenizer,
    /// Each new vocabulary entry: its text (decoded) and id, and the old model's pieces of
    /// its string (for the mean initialisation). Intermediate nodes come before the tokens
    /// built from them.
    pub added: Vec<(String, NewToken)>,
    /// Tokens whose text was a single token already (they keep it).
    pub skipped: Vec<String>,
}

/// Merges `tokens` into the BPE model of `doc` (a parsed `tokenizer.json`); errors are
/// details naming the token and what went wrong. New ids start after the tokenizer's largest
/// (model or added-token) id.
pub(super) fn merge_tokens(doc: &Value, tokens: &[String]) -> Result<MergedBpe, String> {
    let old = Tokenizer::from_bytes(doc.to_string()).map_err(|e| e.to_string())?;
    let mut state = BpeState::new(doc, &old)?;
    let mut cur = old.clone();
    let (mut roots, mut skipped, mut added) = (Vec::new(), Vec::new(), Vec::new());
    for t in tokens {
        if t.is_empty() {
            return Err("an added token is empty".into());
        }
        if old.token_to_id(t).is_some() {
            skipped.push(t.clone());
            continue;
        }
        let enc = old
            .encode(t.as_str(), false)
            .map_err(|e| format!("encoding `{t}`: {e}"))?;
        let words: HashSet<Option<u32>> = enc.get_word_ids().iter().copied().collect();
        if words.len() > 1 {
            return Err(format!(
                "`{t}` is split by the pre-tokenizer into {} words, which BPE merges never \
                 join; add it as an added token instead (--mode added)",
                words.len()
            ));
        }
        let string = enc.get_tokens().concat();
        if string.is_empty() {
            return Err(format!("`{t}` encodes to no tokens"));
        }
        state.refresh_for(&string, &mut cur)?;
        let enc = cur.encode(t.as_str(), false).map_err(|e| e.to_string())?;
        let pieces = enc.get_tokens();
        if pieces.len() == 1 {
            skipped.push(t.clone());
            continue;
        }
        let whole = |s: &str| {
            let ids = old_pieces(&old, s).unwrap_or_default();
            old.decode(&ids, false)
                .is_ok_and(|text| !text.contains(char::REPLACEMENT_CHARACTER))
        };
        for (l, r) in merge_tree(pieces, |s| state.vocab.contains_key(s), whole) {
            if let Some((id, string)) = state.push_merge(&l, &r) {
                let ids = old_pieces(&old, &string)?;
                let text = old.decode(&ids, false).map_err(|e| e.to_string())?;
                added.push((text, NewToken { id, pieces: ids }));
            }
        }
        roots.push((t.clone(), state.vocab[&string]));
    }
    state.refresh(&mut cur)?;
    for (t, id) in &roots {
        let got = cur.encode(t.as_str(), false).map_err(|e| e.to_string())?;
        if got.get_ids() != [*id] {
            return Err(format!(
                "`{t}` encodes to {:?} after merging, not to its new id {id} (the merges of \
                 another new token interfere; add it in a separate run)",
                got.get_ids()
            ));
        }
    }
    Ok(MergedBpe {
        tokenizer: cur,
        added,
        skipped,
    })
}

/// The old BPE model's ids for a model-space string (after normalization, pre-tokenization
/// and byte mapping): the pieces a new entry's row is averaged from.
fn old_pieces(old: &Tokenizer, string: &str) -> Result<Vec<u32>, String> {
    let tokens = old
        .get_model()
        .tokenize(string)
        .map_err(|e| format!("splitting `{string}` with the old model: {e}"))?;
    Ok(tokens.iter().map(|t| t.id).collect())
}

/// The BPE model being grown: the old model (for its options), the vocabulary, the merges
/// in rank order, the pairs already merged, the next free id, and the strings of the merges
/// added since the tokenizer was last rebuilt.
struct BpeState {
    options: BPE,
    vocab: HashMap<String, u32>,
    merges: Vec<(String, String)>,
    pairs: HashSet<(String, String)>,
    next_id: u32,
    pending: Vec<String>,
}

impl BpeState {
    fn new(doc: &Value, old: &Tokenizer) -> Result<BpeState, String> {
        let ModelWrapper::BPE(bpe) = old.get_model() else {
            let kind = doc["model"]["type"].as_str().unwrap_or("?");
            return Err(format!(
                "merging needs a BPE model, the tokenizer's is `{kind}` (use --mode added)"
            ));
        };
        let merges = doc["model"]["merges"]
            .as_array()
            .ok_or("model.merges is not a list")?
            .iter()
            .map(merge_pair)
            .collect::<Option<Vec<_>>>()
            .ok_or("model.merges: a merge is neither \"a b\" nor [a, b]")?;
        let next_id = old.get_vocab(true).values().max().map_or(0, |&m| m + 1);
        Ok(BpeState {
            options: bpe.clone(),
            vocab: bpe.get_vocab(),
            pairs: merges.iter().cloned().collect(),
            merges,
            next_id,
            pending: Vec::new(),
        })
    }

    /// Appends the merge `(l, r)` unless present; returns the id and string of the merged
    /// string when it joined the vocabulary.
    fn push_merge(&mut self, l: &str, r: &str) -> Option<(u32, String)> {
        let string = format!("{l}{r}");
        let mut new = None;
        if !self.vocab.contains_key(&string) {
            self.vocab.insert(string.clone(), self.next_id);
            new = Some((self.next_id, string.clone()));
            self.next_id += 1;
        }
        if self.pairs.insert((l.to_string(), r.to_string())) {
            self.merges.push((l.to_string(), r.to_string()));
            self.pending.push(string);
        }
        new
    }

    /// Rebuilds `tokenizer`'s model when a merge added since the last rebuild can act inside
    /// `string` (a word's model-space string): a merge joins adjacent symbols, so it acts
    /// in a word only when its result is a substring of the word. Rebuilding takes the
    /// whole vocabulary, so this keeps a long token list from rebuilding at every token.
    fn refresh_for(&mut self, string: &str, tokenizer: &mut Tokenizer) -> Result<(), String> {
        if self.pending.iter().any(|p| string.contains(p.as_str())) {
            self.refresh(tokenizer)?;
        }
        Ok(())
    }

    /// `tokenizer` with the current vocabulary and merges (the old model's other options).
    fn refresh(&mut self, tokenizer: &mut Tokenizer) -> Result<(), String> {
        let o = &self.options;
        let mut b = BPE::builder()
            .vocab_and_merges(
                self.vocab
                    .iter()
                    .map(|(k, &v)| (k.clone(), v))
                    .collect::<AHashMap<_, _>>(),
                self.merges.clone(),
            )
            .fuse_unk(o.fuse_unk)
            .byte_fallback(o.byte_fallback)
            .ignore_merges(o.ignore_merges);
        if let Some(d) = o.dropout {
            b = b.dropout(d);
        }
        if let Some(u) = &o.unk_token {
            b = b.unk_token(u.clone());
        }
        if let Some(p) = &o.continuing_subword_prefix {
            b = b.continuing_subword_prefix(p.clone());
        }
        if let Some(s) = &o.end_of_word_suffix {
            b = b.end_of_word_suffix(s.clone());
        }
        tokenizer.with_model(b.build().map_err(|e| e.to_string())?);
        self.pending.clear();
        Ok(())
    }
}

fn merge_pair(m: &Value) -> Option<(String, String)> {
    match m {
        Value::String(s) => s
            .split_once(' ')
            .map(|(a, b)| (a.to_string(), b.to_string())),
        Value::Array(a) if a.len() == 2 => Some((a[0].as_str()?.into(), a[1].as_str()?.into())),
        _ => None,
    }
}

/// The merges, children before parents, of the binary tree over `pieces` (n >= 2) whose
/// internal nodes need the fewest strings outside the vocabulary (`known`), then the fewest
/// such strings that are not whole characters (`whole`); then the leftmost split.
fn merge_tree(
    pieces: &[String],
    known: impl Fn(&str) -> bool,
    whole: impl Fn(&str) -> bool,
) -> Vec<(String, String)> {
    let n = pieces.len();
    let span = |i: usize, j: usize| pieces[i..j].concat();
    // cost[i][j]: (new strings, new partial-character strings) to build pieces[i..j];
    // split[i][j]: its best split.
    let mut cost = vec![vec![(0usize, 0usize); n + 1]; n + 1];
    let mut split = vec![vec![0usize; n + 1]; n + 1];
    for len in 2..=n {
        for i in 0..=n - len {
            let j = i + len;
            let s = span(i, j);
            let new = !known(&s);
            let own = (usize::from(new), usize::from(new && !whole(&s)));
            let (k, c) = (i + 1..j)
                .map(|k| {
                    let (l, r) = (cost[i][k], cost[k][j]);
                    (k, (l.0 + r.0, l.1 + r.1))
                })
                .min_by_key(|&(k, c)| (c, k))
                .expect("len >= 2");
            cost[i][j] = (c.0 + own.0, c.1 + own.1);
            split[i][j] = k;
        }
    }
    let mut out = Vec::new();
    emit(0, n, &split, &span, &mut out);
    out
}

fn emit(
    i: usize,
    j: usize,
    split: &[Vec<usize>],
    span: &dyn Fn(usize, usize) -> String,
    out: &mut Vec<(String, String)>,
) {
    if j - i < 2 {
        return;
    }
    let k = split[i][j];
    emit(i, k, split, span, out);
    emit(k, j, split, span, out);
    out.push((span(i, k), span(k, j)));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(p: &[&str]) -> Vec<String> {
        p.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_tree_reuses_known_intermediates() {
        // "ab" is known: ((a b) c) needs one new string, (a (b c)) two.
        let t = merge_tree(&pieces(&["a", "b", "c"]), |s| s == "ab", |_| true);
        assert_eq!(
            t,
            [("a".into(), "b".into()), ("ab".into(), "c".into())] as [(String, String); 2]
        );
        let t = merge_tree(&pieces(&["a", "b", "c"]), |s| s == "bc", |_| true);
        assert_eq!(
            t,
            [("b".into(), "c".into()), ("a".into(), "bc".into())] as [(String, String); 2]
        );
        // Nothing known: the leftmost split, children first.
        let t = merge_tree(&pieces(&["a", "b", "c", "d"]), |_| false, |_| true);
        assert_eq!(t.len(), 3);
        assert_eq!(t[2], ("a".into(), "bcd".into()));
        // Characters "ab" and "cde" (as UTF-8 bytes): each built whole, then joined.
        let whole = |s: &str| ["ab", "cde", "abcde"].contains(&s);
        let t = merge_tree(&pieces(&["a", "b", "c", "d", "e"]), |_| false, whole);
        let names: Vec<String> = t.iter().map(|(l, r)| format!("{l}+{r}")).collect();
        assert_eq!(names, ["a+b", "d+e", "c+de", "ab+cde"]);
    }

    #[test]
    fn merges_are_read_in_both_forms_and_appended_once() {
        assert_eq!(
            merge_pair(&serde_json::json!("a b")),
            Some(("a".into(), "b".into()))
        );
        assert_eq!(
            merge_pair(&serde_json::json!(["a", "b"])),
            Some(("a".into(), "b".into()))
        );
        assert_eq!(merge_pair(&serde_json::json!("ab")), None);
        let mut s = BpeState {
            options: BPE::default(),
            vocab: HashMap::from([("a".into(), 0), ("b".into(), 1), ("ab".into(), 2)]),
            merges: vec![("a".into(), "b".into())],
            pairs: HashSet::from([("a".into(), "b".into())]),
            next_id: 3,
            pending: Vec::new(),
        };
        assert_eq!(s.push_merge("a", "b"), None);
        assert_eq!(s.push_merge("ab", "b"), Some((3, "abb".into())));
        assert_eq!(
            s.push_merge("a", "bb"),
            None,
            "the string exists, the merge is new"
        );
        assert_eq!(s.merges.len(), 3);
        assert_eq!(s.pending, ["abb", "abb"]);
    }
}
