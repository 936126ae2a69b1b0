//! Run configuration of `ferrotron train --config run.toml [--set section.key=value ...]`.
//!
//! The TOML uses Megatron's argument names, grouped in sections (`[model]`, `[data]`,
//! `[training]`, `[optimizer]`, `[precision]`, `[checkpoint]`, `[logging]`, `[lora]`, `[moe]`, ...). Loading is two
//! steps: the text (plus `--set` overrides) is parsed into a [`RawConfig`], then
//! [`RunConfig::from_raw`] checks everything and derives the values the trainer uses. Both steps
//! collect *every* problem and report them together in one [`ConfigError`], each naming its key.

mod mla;
mod moe;
mod offload;
pub(crate) mod requirements;
mod sections;
mod training;
mod types;
mod validate;
mod values;

pub use mla::{MlaSection, MlaSettings};
pub use moe::{MoeLayerFreq, MoeOptions, MoeSection, MoeSettings};
pub use sections::{
    BlendItem, CheckpointSection, DataPath, DataSection, DpoSection, LoggingSection, LoraSection,
    ModelSection, OptimizerSection, ParallelSection, PrecisionSection, RawConfig, RewardSection,
    SECTIONS, TrainingSection,
};
pub(crate) use training::is_gguf;
pub use types::{
    DatasetType, LrDecayStyle, ModelDims, ModelSource, Precision, Recompute, RecomputeMethod,
    RunConfig,
};

use serde::Deserialize;
use std::fmt;
use std::path::Path;

/// Every problem found in a configuration, each a line naming the offending key.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    /// One human-readable line per problem, in discovery order.
    pub problems: Vec<String>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.problems.len();
        write!(
            f,
            "invalid run configuration ({n} problem{}):",
            if n == 1 { "" } else { "s" }
        )?;
        for p in &self.problems {
            write!(f, "\n  - {p}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

/// One documented key: what `--help` / `--print-config` show.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyDoc {
    /// Section name, e.g. `"training"`.
    pub section: &'static str,
    /// Key name, e.g. `"micro_batch_size"`.
    pub key: &'static str,
    /// The default as a TOML value, or `"(unset)"`.
    pub default: String,
    /// The key's docstring (units, default, Megatron flag).
    pub doc: &'static str,
}

/// All keys of all sections with their defaults and docs, in file order.
pub fn documented_keys() -> Vec<KeyDoc> {
    let defaults = toml::Table::try_from(RawConfig::default()).expect("defaults serialize");
    let mut out = Vec::new();
    for &(section, keys) in SECTIONS {
        let table = defaults.get(section).and_then(|v| v.as_table());
        for &(key, doc) in keys {
            let default = match table.and_then(|t| t.get(key)) {
                Some(v) => v.to_string(),
                None => "(unset)".to_string(),
            };
            out.push(KeyDoc {
                section,
                key,
                default,
                doc: doc.trim_end(),
            });
        }
    }
    out
}

fn section_keys(section: &str) -> Option<&'static [(&'static str, &'static str)]> {
    SECTIONS
        .iter()
        .find(|(s, _)| *s == section)
        .map(|(_, k)| *k)
}

/// Parses a `--set` value as TOML; a bare word that is not valid TOML is taken as a string
/// (so `--set data.dataset_type=gpt` works), and type checking happens on deserialization.
fn parse_override_value(text: &str) -> toml::Value {
    match toml::from_str::<toml::Table>(&format!("v = {text}")) {
        Ok(mut t) => t.remove("v").expect("parsed key"),
        Err(_) => toml::Value::String(text.to_string()),
    }
}

/// Applies `section.key=value` overrides to the parsed table; bad ones become problems.
fn apply_overrides(table: &mut toml::Table, overrides: &[String], problems: &mut Vec<String>) {
    for ov in overrides {
        let Some((path, value)) = ov.split_once('=') else {
            problems.push(format!("--set {ov}: expected section.key=value"));
            continue;
        };
        let path = path.trim();
        let Some((section, key)) = path.split_once('.') else {
            problems.push(format!(
                "--set {ov}: key must be section.key (e.g. training.train_iters)"
            ));
            continue;
        };
        let Some(keys) = section_keys(section) else {
            problems.push(format!("--set {ov}: unknown section [{section}]"));
            continue;
        };
        if !keys.iter().any(|(k, _)| *k == key) {
            problems.push(format!("--set {ov}: unknown key `{key}` in [{section}]"));
            continue;
        }
        let entry = table
            .entry(section.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        match entry.as_table_mut() {
            Some(t) => {
                t.insert(key.to_string(), parse_override_value(value.trim()));
            }
            None => problems.push(format!("[{section}] must be a table")),
        }
    }
}

/// Deserializes one section, reporting unknown keys and each mistyped key separately.
fn section_from_table<T>(section: &str, table: Option<toml::Value>, problems: &mut Vec<String>) -> T
where
    T: for<'de> Deserialize<'de> + Default,
{
    let Some(value) = table else {
        return T::default();
    };
    let toml::Value::Table(table) = value else {
        problems.push(format!(
            "[{section}] must be a table, got {}",
            value.type_str()
        ));
        return T::default();
    };
    let keys = section_keys(section).expect("known section");
    let mut good = toml::Table::new();
    for (key, value) in table {
        if !keys.iter().any(|(k, _)| *k == key) {
            problems.push(format!("unknown key `{key}` in [{section}]"));
            continue;
        }
        let mut single = toml::Table::new();
        single.insert(key.clone(), value.clone());
        match T::deserialize(toml::Value::Table(single)) {
            Ok(_) => {
                good.insert(key, value);
            }
            Err(e) => problems.push(format!("{section}.{key}: {}", e.message().trim())),
        }
    }
    T::deserialize(toml::Value::Table(good)).unwrap_or_else(|e| {
        problems.push(format!("[{section}]: {}", e.message().trim()));
        T::default()
    })
}

/// Parses TOML text plus `--set` overrides into a [`RawConfig`], collecting every syntax,
/// unknown-key, unknown-section and type problem.
pub fn parse_raw(text: &str, overrides: &[String]) -> Result<RawConfig, ConfigError> {
    let mut table = toml::from_str::<toml::Table>(text).map_err(|e| ConfigError {
        problems: vec![format!("TOML syntax: {e}")],
    })?;
    let mut problems = Vec::new();
    apply_overrides(&mut table, overrides, &mut problems);
    for name in table.keys() {
        if section_keys(name).is_none() {
            let known: Vec<&str> = SECTIONS.iter().map(|(s, _)| *s).collect();
            problems.push(format!(
                "unknown section [{name}] (known: {})",
                known.join(", ")
            ));
        }
    }
    let mut take = |s: &str| table.remove(s);
    let raw = RawConfig {
        model: section_from_table("model", take("model"), &mut problems),
        data: section_from_table("data", take("data"), &mut problems),
        training: section_from_table("training", take("training"), &mut problems),
        optimizer: section_from_table("optimizer", take("optimizer"), &mut problems),
        precision: section_from_table("precision", take("precision"), &mut problems),
        parallel: section_from_table("parallel", take("parallel"), &mut problems),
        checkpoint: section_from_table("checkpoint", take("checkpoint"), &mut problems),
        logging: section_from_table("logging", take("logging"), &mut problems),
        lora: section_from_table("lora", take("lora"), &mut problems),
        dpo: section_from_table("dpo", take("dpo"), &mut problems),
        reward: section_from_table("reward", take("reward"), &mut problems),
        moe: section_from_table("moe", take("moe"), &mut problems),
        mla: section_from_table("mla", take("mla"), &mut problems),
    };
    if problems.is_empty() {
        Ok(raw)
    } else {
        Err(ConfigError { problems })
    }
}

impl RunConfig {
    /// Parses and validates TOML text with `--set section.key=value` overrides.
    pub fn from_toml_str(text: &str, overrides: &[String]) -> Result<RunConfig, ConfigError> {
        RunConfig::from_raw(parse_raw(text, overrides)?)
    }

    /// Reads, parses and validates `path` with `--set` overrides.
    pub fn load(path: &Path, overrides: &[String]) -> Result<RunConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            problems: vec![format!("cannot read config `{}`: {e}", path.display())],
        })?;
        RunConfig::from_toml_str(&text, overrides)
    }

    /// The data-parallel size an `mpirun` world of `world_size` processes leaves for the
    /// model-parallel sizes `tensor x context x pipeline` (Megatron derives it from the world
    /// size the same way).
    ///
    /// # Errors
    /// The world does not divide by the model-parallel size, or `parallel.data_parallel_size`
    /// is set to another value.
    pub fn data_parallel_size_for_world(&self, world_size: usize) -> Result<usize, ConfigError> {
        let p = &self.resolved.parallel;
        let model =
            p.tensor_model_parallel_size * p.context_parallel_size * p.pipeline_model_parallel_size;
        let problem = |text: String| ConfigError {
            problems: vec![text],
        };
        if !world_size.is_multiple_of(model) {
            return Err(problem(format!(
                "mpirun started {world_size} processes, not a multiple of tensor x context x \
                 pipeline parallel sizes ({model})"
            )));
        }
        let dp = world_size / model;
        if let Some(set) = p.data_parallel_size
            && set != dp
        {
            return Err(problem(format!(
                "parallel.data_parallel_size is {set}, but {world_size} processes with \
                 model-parallel size {model} give {dp}"
            )));
        }
        Ok(dp)
    }

    /// The fully resolved configuration (defaults and derived values filled in) as TOML, each
    /// key preceded by its docstring; unset optional keys appear commented out. Parsing the
    /// output gives back an equal `RunConfig`.
    pub fn to_toml(&self) -> String {
        let table = toml::Table::try_from(&self.resolved).expect("config serializes");
        let mut out = String::from("# Ferrotron run configuration (fully resolved)\n");
        for &(section, keys) in SECTIONS {
            out.push_str(&format!("\n[{section}]\n"));
            let t = table.get(section).and_then(|v| v.as_table());
            for &(key, doc) in keys {
                for line in doc.lines() {
                    out.push_str(&format!("# {}\n", line.trim()));
                }
                match t.and_then(|t| t.get(key)) {
                    Some(v) => out.push_str(&format!("{key} = {v}\n")),
                    None => out.push_str(&format!("# {key} = (unset)\n")),
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests;
