//! `expand_vocab`: an HF model directory with tokens added to its vocabulary
//! (Pai-Megatron-Patch's vocabulary expansion for continued pretraining in a new language).
//!
//! The tokens join `tokenizer.json` either as HF's `tokenizer.add_tokens` adds them
//! ([`VocabMode::Added`]: non-special added tokens, new ones numbered after the tokenizer's
//! last, ones already in the vocabulary keeping their ids) or merged into the BPE model's own
//! `vocab` and `merges` ([`VocabMode::Merged`], see [`merged`]); the embedding and untied
//! output rows grow with each new entry's row the mean of the rows of the pieces the old
//! tokenizer split it into ([`GptModel::expand_vocab`]), `vocab_size` padded to a multiple
//! (for tensor parallelism); everything else is copied.

mod merged;

use std::path::{Path, PathBuf};

use ferrotron_model::families::load_hf_model;
use ferrotron_model::{GptModel, NewToken};
use ferrotron_tensor::DType;
use serde_json::{Value, json};
use tokenizers::{AddedToken, Tokenizer};

use crate::error::display_name;
use crate::hf_export::{
    HfExportOptions, HfExportSource, TOKENIZER_FILES, export_hf, input_dtype, model_err,
};
use crate::{CheckpointError, OutputDtype};

/// How new tokens join the tokenizer (the two forms of HF vocabulary expansion).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum VocabMode {
    /// As `tokenizer.add_tokens(...)`: the tokens are matched in the text before the
    /// pre-tokenizer and model run (`added_tokens` of `tokenizer.json`, and
    /// `added_tokens_decoder` of `tokenizer_config.json`).
    #[default]
    Added,
    /// Merged into the BPE model (`model.vocab` + new `model.merges` after the old ones), as
    /// a tokenizer trained on the new text and merged into the old one: a token is produced
    /// wherever BPE meets its text inside a word, and intermediate strings its merges need
    /// join the vocabulary too. Needs a BPE model and tokens the pre-tokenizer keeps whole.
    Merged,
}

/// Options of [`expand_vocab`].
#[derive(Clone, Debug)]
pub struct ExpandVocabOptions {
    /// How the tokens join the tokenizer.
    pub mode: VocabMode,
    /// `vocab_size` is rounded up to a multiple of this (Megatron's
    /// `make_vocab_size_divisible_by` x tensor-parallel size; 1 keeps it exact). Must be > 0.
    pub pad_to_multiple_of: usize,
    /// Element type of the output weights; `None` keeps the input's (`torch_dtype`).
    pub dtype: Option<OutputDtype>,
    /// Replace an existing non-empty output directory.
    pub force: bool,
}

impl Default for ExpandVocabOptions {
    fn default() -> Self {
        ExpandVocabOptions {
            mode: VocabMode::Added,
            pad_to_multiple_of: 1,
            dtype: None,
            force: false,
        }
    }
}

/// What [`expand_vocab`] did.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpandVocabReport {
    /// The output directory.
    pub output: PathBuf,
    /// Each new vocabulary entry (text, id, and the old ids its row was averaged from), in
    /// id order; in the merged mode it includes the intermediate strings the merges need.
    pub added: Vec<(String, NewToken)>,
    /// Tokens already in the vocabulary: they keep their ids and rows (and, as with HF's
    /// `add_tokens`, are matched as added tokens from now on).
    pub skipped: Vec<String>,
    /// `vocab_size` before and after.
    pub vocab_size: (usize, usize),
}

/// The tokenizer with the tokens in, and what changed.
struct TokenizerChange {
    tokenizer: Tokenizer,
    /// New vocabulary entries in id order.
    added: Vec<(String, NewToken)>,
    skipped: Vec<String>,
    /// The tokens to list in `tokenizer_config.json`'s `added_tokens_decoder` (added mode).
    added_tokens: Vec<(String, u32)>,
}

/// Writes `hf` (an HF model directory with `tokenizer.json`) with `tokens` added to its
/// vocabulary as `output` (staged, then renamed into place).
///
/// # Errors
/// No `tokenizer.json` or `config.json` in `hf`, an unreadable model, an empty token, a token
/// the old tokenizer encodes to nothing, `pad_to_multiple_of` 0, a failed write, and in the
/// merged mode a tokenizer model other than BPE or a token the pre-tokenizer splits; each
/// names the file or token. The output is not created then.
pub fn expand_vocab(
    hf: &Path,
    tokens: &[String],
    output: &Path,
    opts: &ExpandVocabOptions,
) -> Result<ExpandVocabReport, CheckpointError> {
    let tok_path = hf.join("tokenizer.json");
    let file = display_name(&tok_path);
    let bad_tokenizer = |detail: String| CheckpointError::Tokenizer {
        file: file.clone(),
        detail,
    };
    if opts.pad_to_multiple_of == 0 {
        return Err(bad_tokenizer("pad_to_multiple_of must be > 0".into()));
    }
    let tokenizer = Tokenizer::from_file(&tok_path).map_err(|e| bad_tokenizer(e.to_string()))?;
    let change = match opts.mode {
        VocabMode::Added => add_tokens(tokenizer, tokens),
        VocabMode::Merged => merge_into_model(&tok_path, tokens),
    }
    .map_err(bad_tokenizer)?;
    let source = HfExportSource::from_dir(hf)?;
    let dtype = opts
        .dtype
        .unwrap_or_else(|| input_dtype(source.config.original.as_ref()));
    let (model, _) = load_hf_model(hf, DType::F32).map_err(|e| model_err(&e))?;
    let old_vocab = model.config().vocab_size;
    let last_new = change.added.iter().map(|(_, n)| n.id as usize + 1).max();
    let needed = old_vocab.max(last_new.unwrap_or(0));
    let new_vocab = needed.div_ceil(opts.pad_to_multiple_of) * opts.pad_to_multiple_of;
    let new_tokens: Vec<NewToken> = change.added.iter().map(|(_, n)| n.clone()).collect();
    let model = model
        .expand_vocab(new_vocab, &new_tokens)
        .map_err(|e| model_err(&e))?;
    let write_opts = HfExportOptions {
        dtype,
        force: opts.force,
        ..HfExportOptions::default()
    };
    write(&model, &source, &change, hf, output, write_opts)?;
    Ok(ExpandVocabReport {
        output: output.to_path_buf(),
        added: change.added,
        skipped: change.skipped,
        vocab_size: (old_vocab, new_vocab),
    })
}

/// [`VocabMode::Added`]: `tokens` added as HF's `add_tokens` adds them; errors are details.
fn add_tokens(mut tokenizer: Tokenizer, tokens: &[String]) -> Result<TokenizerChange, String> {
    let (mut fresh, mut skipped, mut pieces) = (Vec::new(), Vec::new(), Vec::new());
    for t in tokens {
        if t.is_empty() {
            return Err("an added token is empty".into());
        }
        if tokenizer.token_to_id(t).is_some() || fresh.contains(t) {
            skipped.push(t.clone());
            continue;
        }
        let ids = tokenizer
            .encode(t.as_str(), false)
            .map_err(|e| format!("encoding `{t}`: {e}"))?
            .get_ids()
            .to_vec();
        if ids.is_empty() {
            return Err(format!("`{t}` encodes to no tokens"));
        }
        fresh.push(t.clone());
        pieces.push(ids);
    }
    // As HF's `add_tokens`: a token already in the vocabulary is registered too (keeping its
    // id), so it is matched as an added token from now on.
    let mut all: Vec<&String> = Vec::new();
    for t in tokens {
        if !all.contains(&t) {
            all.push(t);
        }
    }
    let entries: Vec<AddedToken> = all
        .iter()
        .map(|t| AddedToken::from((*t).clone(), false))
        .collect();
    tokenizer
        .add_tokens(entries)
        .map_err(|e| format!("adding the tokens: {e}"))?;
    let mut added = Vec::new();
    for (t, pieces) in fresh.iter().zip(pieces) {
        let id = tokenizer
            .token_to_id(t)
            .ok_or_else(|| format!("`{t}` was not added"))?;
        added.push((t.clone(), NewToken { id, pieces }));
    }
    let added_tokens = added.iter().map(|(t, n)| (t.clone(), n.id)).collect();
    Ok(TokenizerChange {
        tokenizer,
        added,
        skipped,
        added_tokens,
    })
}

/// [`VocabMode::Merged`]: `tokens` merged into the BPE model of `tok_path`.
fn merge_into_model(tok_path: &Path, tokens: &[String]) -> Result<TokenizerChange, String> {
    let text = std::fs::read_to_string(tok_path).map_err(|e| e.to_string())?;
    let doc: Value = serde_json::from_str(&text).map_err(|e| format!("not JSON: {e}"))?;
    let merged = merged::merge_tokens(&doc, tokens)?;
    Ok(TokenizerChange {
        tokenizer: merged.tokenizer,
        added: merged.added,
        skipped: merged.skipped,
        added_tokens: Vec::new(),
    })
}

/// Writes the expanded model and tokenizer: the tokenizer files go to a scratch directory
/// beside `output` (the new `tokenizer.json`, `tokenizer_config.json` with the added tokens
/// in its `added_tokens_decoder` when it has one, the others copied), which [`export_hf`]
/// copies.
fn write(
    model: &GptModel,
    source: &HfExportSource,
    change: &TokenizerChange,
    hf: &Path,
    output: &Path,
    opts: HfExportOptions,
) -> Result<(), CheckpointError> {
    let parent = output
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| CheckpointError::io(parent, e))?;
    let scratch = parent.join(format!(
        ".{}.tokenizer-{}",
        display_name(output),
        std::process::id()
    ));
    let result = (|| {
        std::fs::create_dir_all(&scratch).map_err(|e| CheckpointError::io(&scratch, e))?;
        for name in TOKENIZER_FILES {
            let src = hf.join(name);
            if src.is_file() && name != "tokenizer.json" {
                std::fs::copy(&src, scratch.join(name))
                    .map_err(|e| CheckpointError::io(&src, e))?;
            }
        }
        let tok_out = scratch.join("tokenizer.json");
        change
            .tokenizer
            .save(&tok_out, true)
            .map_err(|e| CheckpointError::Tokenizer {
                file: "tokenizer.json".into(),
                detail: format!("cannot write: {e}"),
            })?;
        add_to_tokenizer_config(&scratch.join("tokenizer_config.json"), &change.added_tokens)?;
        let opts = HfExportOptions {
            tokenizer_dir: Some(scratch.clone()),
            ..opts
        };
        export_hf(model, source, output, &opts).map(|_| ())
    })();
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

/// Adds the new tokens to `tokenizer_config.json`'s `added_tokens_decoder` (as transformers
/// saves it), when the file exists and has one.
fn add_to_tokenizer_config(path: &Path, added: &[(String, u32)]) -> Result<(), CheckpointError> {
    if added.is_empty() || !path.is_file() {
        return Ok(());
    }
    let text = std::fs::read_to_string(path).map_err(|e| CheckpointError::io(path, e))?;
    let mut config: Value = serde_json::from_str(&text).map_err(|e| CheckpointError::Format {
        file: "tokenizer_config.json".into(),
        detail: format!("not JSON: {e}"),
    })?;
    let Some(decoder) = config
        .get_mut("added_tokens_decoder")
        .and_then(Value::as_object_mut)
    else {
        return Ok(());
    };
    for (t, id) in added {
        decoder.insert(
            id.to_string(),
            json!({"content": t, "lstrip": false, "normalized": true, "rstrip": false,
                   "single_word": false, "special": false}),
        );
    }
    let mut bytes = serde_json::to_vec_pretty(&config).expect("JSON values serialize");
    bytes.push(b'\n');
    std::fs::write(path, bytes).map_err(|e| CheckpointError::io(path, e))
}
