use std::borrow::Borrow;
use std::path::{Path, PathBuf};

/// Errors from loading or running a tokenizer; messages name the file.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// `tokenizer.json` is missing or invalid.
    #[error("{path}: cannot load tokenizer: {message}")]
    Load { path: PathBuf, message: String },
    /// Encoding or decoding failed inside the `tokenizers` crate.
    #[error("tokenizer: {0}")]
    Run(String),
}

/// An HF tokenizer loaded from a model directory's `tokenizer.json` (byte-level BPE and the
/// other models the `tokenizers` crate supports). Encoding matches transformers'
/// `tokenizer(text)["input_ids"]` for the same file.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    /// Loads `<dir>/tokenizer.json`.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        Self::from_file(&dir.join("tokenizer.json"))
    }

    /// Loads a `tokenizer.json` file.
    pub fn from_file(path: &Path) -> Result<Tokenizer, TokenizerError> {
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| TokenizerError::Load {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        Ok(Tokenizer { inner })
    }

    /// Loads a tokenizer from the contents of a `tokenizer.json` (e.g. one built from a GGUF
    /// file's metadata); `origin` names where it came from in errors.
    pub fn from_json(json: &str, origin: &Path) -> Result<Tokenizer, TokenizerError> {
        let inner: tokenizers::Tokenizer =
            json.parse()
                .map_err(|e: tokenizers::Error| TokenizerError::Load {
                    path: origin.to_path_buf(),
                    message: e.to_string(),
                })?;
        Ok(Tokenizer { inner })
    }

    /// Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. a BOS token),
    /// as transformers does by default.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TokenizerError::Run(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`; `skip_special_tokens` drops special tokens such as `<|im_end|>`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Run(e.to_string()))
    }

    /// The id of a token string (e.g. `"<|im_end|>"`), if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

/// Turns a stream of token ids into text pieces as soon as they form complete characters
/// (transformers' `TextStreamer` rule: hold back text that ends in U+FFFD, the mark of a
/// partial UTF-8 sequence). Holds the tokenizer as any `T: Borrow<Tokenizer>`: a reference,
/// or an `Arc` for a decoder that must own what it uses (a server's response stream).
pub struct StreamDecoder<T: Borrow<Tokenizer>> {
    tokenizer: T,
    ids: Vec<u32>,
    printed: usize,
    skip_special_tokens: bool,
}

impl<T: Borrow<Tokenizer>> StreamDecoder<T> {
    /// A decoder with nothing decoded yet.
    pub fn new(tokenizer: T, skip_special_tokens: bool) -> Self {
        StreamDecoder {
            tokenizer,
            ids: Vec::new(),
            printed: 0,
            skip_special_tokens,
        }
    }

    /// Adds a token; returns the newly completed text, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>, TokenizerError> {
        self.ids.push(id);
        let text = self
            .tokenizer
            .borrow()
            .decode(&self.ids, self.skip_special_tokens)?;
        if text.ends_with('\u{FFFD}') || text.len() <= self.printed {
            return Ok(None);
        }
        let piece = text.get(self.printed..).map(str::to_string);
        self.printed = text.len();
        Ok(piece)
    }

    /// Whatever is still held back (at the end of generation).
    pub fn finish(&mut self) -> Result<Option<String>, TokenizerError> {
        let text = self
            .tokenizer
            .borrow()
            .decode(&self.ids, self.skip_special_tokens)?;
        if text.len() <= self.printed {
            return Ok(None);
        }
        let piece = text.get(self.printed..).map(str::to_string);
        self.printed = text.len();
        Ok(piece)
    }
}
