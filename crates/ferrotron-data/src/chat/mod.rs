//! HuggingFace chat templates, rendered with minijinja.
//!
//! Mirrors transformers' `utils/chat_template_utils.py` (`_compile_jinja_template`,
//! `render_jinja_template`) as used by `PreTrainedTokenizerBase.apply_chat_template`:
//! - environment: `trim_blocks=True`, `lstrip_blocks=True`, no autoescape, trailing newline of the
//!   template dropped (jinja2 default), `{% break %}`/`{% continue %}` (jinja2.ext.loopcontrols),
//!   dict literals keep insertion order;
//! - globals `raise_exception(msg)` (becomes [`ChatError::Raised`]) and `strftime_now(fmt)`
//!   (`datetime.now().strftime(fmt)`, local time);
//! - filter `tojson(ensure_ascii=False, indent=None, separators=None, sort_keys=False)`, which is
//!   `json.dumps` byte for byte (HF replaces jinja's HTML-escaping `tojson` with it);
//! - Python string/dict/list methods (`strip`, `startswith`, `split`, `items`, ...) through
//!   `minijinja_contrib::pycompat`;
//! - `{{ value }}` prints like Python's `str()`: `None`, `True`, `False`, `1e-05`, `['a', 1]`;
//! - variables `messages`, `tools` (None), `documents` (None), `add_generation_prompt`, the special
//!   tokens `bos_token`/`eos_token` when set, then any extra kwargs (which override special tokens,
//!   like HF's `{**special_tokens_map, **kwargs}`).
//!
//! Not supported: HF's `{% generation %}` tag (assistant-mask tracking) is a syntax error, and
//! `~`/`|string` still print `none`/`true` the minijinja way.

use std::path::{Path, PathBuf};

use minijinja::value::{Value, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, syntax::SyntaxConfig};
use serde::{Deserialize, Serialize};
use serde_json::Value as J;

mod pyjson;
use pyjson::{Style, dump, tojson};

const NAME: &str = "chat_template";
const RESERVED: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// One chat turn, as in HF's `[{"role": ..., "content": ...}]` conversations.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The turn's text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Errors from compiling, rendering or loading a chat template.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// The template does not parse (line is 1-based).
    #[error("chat template syntax error{}: {message}", at_line(*line))]
    Syntax {
        line: Option<usize>,
        message: String,
    },
    /// The template called `raise_exception(message)`.
    #[error("chat template raised an exception: {0}")]
    Raised(String),
    /// Any other failure while rendering (undefined attribute, bad filter argument, ...).
    #[error("chat template render error{}: {message}", at_line(*line))]
    Render {
        line: Option<usize>,
        message: String,
    },
    /// A render kwarg collides with an argument HF always passes (Python raises TypeError).
    #[error("render kwarg `{0}` is reserved (messages, tools, documents, add_generation_prompt)")]
    ReservedKwarg(String),
    /// A file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A tokenizer config is not valid JSON.
    #[error("{} is not valid JSON: {source}", path.display())]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    /// A tokenizer config field is missing or malformed.
    #[error("{}: field `{field}` {problem}", path.display())]
    Config {
        path: PathBuf,
        field: &'static str,
        problem: String,
    },
}

fn at_line(line: Option<usize>) -> String {
    line.map(|l| format!(" at line {l}")).unwrap_or_default()
}

/// A compiled HF chat template plus the special tokens it may reference.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl ChatTemplate {
    /// Compiles `template` in the HF environment; syntax errors come back as
    /// [`ChatError::Syntax`] with their line.
    pub fn new(
        template: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build();
        env.set_syntax(syntax.expect("default delimiters are valid"));
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(|out, _state, value| {
            let repr;
            let text = match value.kind() {
                ValueKind::Undefined => return Ok(()),
                ValueKind::String => value.as_str().unwrap_or_default(),
                _ => {
                    repr = dump(value, &Style::python_repr(), 0)?;
                    &repr
                }
            };
            out.write_str(text)
                .map_err(|_| Error::new(ErrorKind::WriteFailure, "output failed"))
        });
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg.clone()).with_source(Raised(msg)))
        });
        env.add_function("strftime_now", |fmt: String| -> Result<String, Error> {
            jiff::fmt::strtime::format(&fmt, &jiff::Zoned::now()).map_err(|e| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now({fmt:?}): {e}"),
                )
            })
        });
        env.add_template_owned(NAME, template.to_owned())
            .map_err(|e| ChatError::Syntax {
                line: e.line(),
                message: describe(&e),
            })?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
        })
    }

    /// Loads the template of an HF `tokenizer_config.json`. Like transformers, a
    /// `chat_template.jinja` next to it wins over the config's `chat_template`, which may be a
    /// string or a list of `{"name", "template"}` (the one named `default` is used).
    /// `bos_token`/`eos_token` may be strings, `{"content": ...}` objects, null or absent.
    pub fn from_tokenizer_config(path: impl AsRef<Path>) -> Result<Self, ChatError> {
        let path = path.as_ref();
        let read = |p: &Path| {
            std::fs::read_to_string(p).map_err(|source| ChatError::Io {
                path: p.into(),
                source,
            })
        };
        let mut config: J =
            serde_json::from_str(&read(path)?).map_err(|source| ChatError::Json {
                path: path.into(),
                source,
            })?;
        let jinja = path.with_file_name("chat_template.jinja");
        if jinja.is_file()
            && let Some(obj) = config.as_object_mut()
        {
            obj.insert("chat_template".into(), J::String(read(&jinja)?));
        }
        Self::from_tokenizer_config_json(&config, path)
    }

    /// The template of the contents of a `tokenizer_config.json` (e.g. one built from a GGUF
    /// file's metadata), read as [`ChatTemplate::from_tokenizer_config`] reads the file;
    /// `origin` names where it came from in errors.
    pub fn from_tokenizer_config_json(config: &J, origin: &Path) -> Result<Self, ChatError> {
        let err = |field, problem: String| ChatError::Config {
            path: origin.into(),
            field,
            problem,
        };
        let template = match &config["chat_template"] {
            J::String(s) => s.clone(),
            J::Array(list) => {
                let names: Vec<_> = list.iter().map(|e| e["name"].as_str()).collect();
                match list.iter().find(|e| e["name"] == "default") {
                    Some(e) => e["template"].as_str().map(String::from).ok_or_else(|| {
                        err(
                            "chat_template",
                            "entry \"default\" lacks a string `template`".into(),
                        )
                    })?,
                    None => {
                        let problem = format!("has no template named \"default\" ({names:?})");
                        return Err(err("chat_template", problem));
                    }
                }
            }
            J::Null => {
                let problem = "is missing (and no chat_template.jinja is beside it)";
                return Err(err("chat_template", problem.into()));
            }
            other => {
                let problem = format!("must be a string or a list, found {other}");
                return Err(err("chat_template", problem));
            }
        };
        let token = |field: &'static str| match &config[field] {
            J::Null => Ok(None),
            J::String(s) => Ok(Some(s.clone())),
            v => v["content"]
                .as_str()
                .map(|s| Some(s.to_owned()))
                .ok_or_else(|| {
                    err(
                        field,
                        "must be a string or an object with a string `content`".into(),
                    )
                }),
        };
        Self::new(&template, token("bos_token")?, token("eos_token")?)
    }

    /// The `bos_token` passed to templates, if any.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The `eos_token` passed to templates, if any.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// `tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        self.render_with_kwargs(messages, add_generation_prompt, &[])
    }

    /// [`ChatTemplate::render`] with extra template variables (HF's `**kwargs`); they override
    /// `bos_token`/`eos_token`. See [`json_to_value`] to pass JSON (e.g. tool schemas).
    pub fn render_with_kwargs(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &[(&str, Value)],
    ) -> Result<String, ChatError> {
        if let Some((name, _)) = kwargs.iter().find(|(k, _)| RESERVED.contains(k)) {
            return Err(ChatError::ReservedKwarg((*name).to_owned()));
        }
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                Value::from_pairs([("role", m.role.as_str()), ("content", m.content.as_str())])
            })
            .collect();
        let mut vars: Vec<(&str, Value)> = vec![
            ("messages", Value::from(messages)),
            ("tools", Value::from(())),
            ("documents", Value::from(())),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
        ];
        let tokens = [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
        ];
        vars.extend(
            tokens
                .iter()
                .filter_map(|(k, v)| v.as_deref().map(|v| (*k, Value::from(v)))),
        );
        vars.extend(kwargs.iter().cloned());
        let template = self.env.get_template(NAME).map_err(|e| render_error(&e))?;
        template
            .render(Value::from_pairs(vars))
            .map_err(|e| render_error(&e))
    }
}

/// Converts JSON to a template value (objects keep serde_json's key order, which is sorted
/// unless serde_json's `preserve_order` feature is on).
pub fn json_to_value(json: &J) -> Value {
    match json {
        J::Null => Value::from(()),
        J::Bool(b) => Value::from(*b),
        J::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Value::from(i),
            (_, Some(u)) => Value::from(u),
            _ => Value::from(n.as_f64().unwrap_or(f64::NAN)),
        },
        J::String(s) => Value::from(s.as_str()),
        J::Array(a) => Value::from(a.iter().map(json_to_value).collect::<Vec<_>>()),
        J::Object(o) => Value::from_pairs(o.iter().map(|(k, v)| (k.as_str(), json_to_value(v)))),
    }
}

/// Marker attached to the error produced by the template's `raise_exception`.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Raised(String);

fn describe(err: &Error) -> String {
    match err.detail() {
        Some(detail) => format!("{}: {detail}", err.kind()),
        None => err.kind().to_string(),
    }
}

fn render_error(err: &Error) -> ChatError {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cause {
        if let Some(raised) = e.downcast_ref::<Raised>() {
            return ChatError::Raised(raised.0.clone());
        }
        cause = e.source();
    }
    ChatError::Render {
        line: err.line(),
        message: describe(err),
    }
}
