//! `expand_vocab`: an HF model directory with tokens added to its vocabulary
//! (Pai-Megatron-Patch's vocabulary expansion for continued pretraining in a new language).
//!
//! The tokens join `tokenizer.json` as HF's `tokenizer.add_tokens` adds them (non-special
//! added tokens, new ones numbered after the tokenizer's last, ones already in the vocabulary
//! keeping their ids); the embedding and untied output rows grow
//! with each new token's row the mean of the rows of the pieces the old tokenizer split it
//! into ([`GptModel::expand_vocab`]), `vocab_size` padded to a multiple (for tensor
//! parallelism); everything else is copied.

use std::path::{Path, PathBuf};

use ferrotron_model::families::load_hf_model;
use ferrotron_model::{GptModel, NewToken};
use ferrotron_tensor::DType;
use serde_json::{Value, json};
use tokenizers::{AddedToken, Tokenizer};

use crate::error::display_name;
use crate::hf_export::{HfExportOptions, HfExportSource, TOKENIZER_FILES, export_hf, model_err};
use crate::{CheckpointError, OutputDtype};

/// Options of [`expand_vocab`].
#[derive(Clone, Debug)]
pub struct ExpandVocabOptions {
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
    /// Each added token, its id and the old ids its row was averaged from.
    pub added: Vec<(String, NewToken)>,
    /// Tokens already in the vocabulary: they keep their ids and rows (and, as with HF's
    /// `add_tokens`, are matched as added tokens from now on).
    pub skipped: Vec<String>,
    /// `vocab_size` before and after.
    pub vocab_size: (usize, usize),
}

/// Writes `hf` (an HF model directory with `tokenizer.json`) with `tokens` added to its
/// vocabulary as `output` (staged, then renamed into place).
///
/// # Errors
/// No `tokenizer.json` or `config.json` in `hf`, an unreadable model, an empty token, a token
/// the old tokenizer encodes to nothing, `pad_to_multiple_of` 0, or a failed write; each names
/// the file or token. The output is not created then.
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
    let mut tokenizer =
        Tokenizer::from_file(&tok_path).map_err(|e| bad_tokenizer(e.to_string()))?;
    let first_id = tokenizer.get_vocab_size(true);
    let (mut fresh, mut skipped, mut pieces) = (Vec::new(), Vec::new(), Vec::new());
    for t in tokens {
        if t.is_empty() {
            return Err(bad_tokenizer("an added token is empty".into()));
        }
        if tokenizer.token_to_id(t).is_some() || fresh.contains(t) {
            skipped.push(t.clone());
            continue;
        }
        let ids = tokenizer
            .encode(t.as_str(), false)
            .map_err(|e| bad_tokenizer(format!("encoding `{t}`: {e}")))?
            .get_ids()
            .to_vec();
        if ids.is_empty() {
            return Err(bad_tokenizer(format!("`{t}` encodes to no tokens")));
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
    let added: Vec<AddedToken> = all
        .iter()
        .map(|t| AddedToken::from((*t).clone(), false))
        .collect();
    tokenizer
        .add_tokens(added)
        .map_err(|e| bad_tokenizer(format!("adding the tokens: {e}")))?;
    let mut report_added = Vec::new();
    for (t, pieces) in fresh.iter().zip(pieces) {
        let id = tokenizer
            .token_to_id(t)
            .ok_or_else(|| bad_tokenizer(format!("`{t}` was not added")))?;
        report_added.push((t.clone(), NewToken { id, pieces }));
    }
    let source = HfExportSource::from_dir(hf)?;
    let dtype = opts
        .dtype
        .unwrap_or_else(|| input_dtype(source.config.original.as_ref()));
    let (model, _) = load_hf_model(hf, DType::F32).map_err(|e| model_err(&e))?;
    let old_vocab = model.config().vocab_size;
    let needed = old_vocab.max(first_id + fresh.len());
    let new_vocab = needed.div_ceil(opts.pad_to_multiple_of) * opts.pad_to_multiple_of;
    let new_tokens: Vec<NewToken> = report_added.iter().map(|(_, n)| n.clone()).collect();
    let model = model
        .expand_vocab(new_vocab, &new_tokens)
        .map_err(|e| model_err(&e))?;
    write(
        &model, &source, &tokenizer, hf, output, dtype, &fresh, first_id, opts.force,
    )?;
    Ok(ExpandVocabReport {
        output: output.to_path_buf(),
        added: report_added,
        skipped,
        vocab_size: (old_vocab, new_vocab),
    })
}

/// The weights' dtype of an HF `config.json` (`dtype` or `torch_dtype`; f32 when absent).
fn input_dtype(config: Option<&Value>) -> OutputDtype {
    let name = config.and_then(|c| c.get("dtype").or_else(|| c.get("torch_dtype")));
    match name.and_then(Value::as_str) {
        Some("bfloat16") => OutputDtype::BF16,
        Some("float16") => OutputDtype::F16,
        _ => OutputDtype::F32,
    }
}

/// Writes the expanded model and tokenizer: the tokenizer files go to a scratch directory
/// beside `output` (the new `tokenizer.json`, `tokenizer_config.json` with the tokens in its
/// `added_tokens_decoder` when it has one, the others copied), which [`export_hf`] copies.
#[allow(clippy::too_many_arguments)]
fn write(
    model: &GptModel,
    source: &HfExportSource,
    tokenizer: &Tokenizer,
    hf: &Path,
    output: &Path,
    dtype: OutputDtype,
    fresh: &[String],
    first_id: usize,
    force: bool,
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
        tokenizer
            .save(&tok_out, true)
            .map_err(|e| CheckpointError::Tokenizer {
                file: "tokenizer.json".into(),
                detail: format!("cannot write: {e}"),
            })?;
        add_to_tokenizer_config(&scratch.join("tokenizer_config.json"), fresh, first_id)?;
        let opts = HfExportOptions {
            dtype,
            force,
            tokenizer_dir: Some(scratch.clone()),
            ..HfExportOptions::default()
        };
        export_hf(model, source, output, &opts).map(|_| ())
    })();
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

/// Adds the new tokens to `tokenizer_config.json`'s `added_tokens_decoder` (as transformers
/// saves it), when the file exists and has one.
fn add_to_tokenizer_config(
    path: &Path,
    fresh: &[String],
    first_id: usize,
) -> Result<(), CheckpointError> {
    if !path.is_file() {
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
    for (i, t) in fresh.iter().enumerate() {
        decoder.insert(
            (first_id + i).to_string(),
            json!({"content": t, "lstrip": false, "normalized": true, "rstrip": false,
                   "single_word": false, "special": false}),
        );
    }
    let mut bytes = serde_json::to_vec_pretty(&config).expect("JSON values serialize");
    bytes.push(b'\n');
    std::fs::write(path, bytes).map_err(|e| CheckpointError::io(path, e))
}
