//! Small parsers and checks shared by validation: blends, splits, paths, numbers.

use super::sections::{BlendItem, DataPath};
use std::path::{Path, PathBuf};

/// `x > 0` (false for NaN).
pub(super) fn positive(x: f64) -> bool {
    x > 0.0
}

/// `x >= 0` (false for NaN).
pub(super) fn nonneg(x: f64) -> bool {
    x >= 0.0
}

pub(super) fn ceil_div(a: u64, b: u64) -> u64 {
    a.div_ceil(b.max(1))
}

pub(super) fn blend_tokens(dp: &DataPath) -> Vec<String> {
    match dp {
        DataPath::Blend(s) => s.split_whitespace().map(str::to_string).collect(),
        DataPath::List(items) => items
            .iter()
            .map(|i| match i {
                BlendItem::Weight(w) => w.to_string(),
                BlendItem::Text(t) => t.clone(),
            })
            .collect(),
    }
}

/// Parses Megatron's blend tokens: a single prefix, or `W1 P1 W2 P2 ...`.
pub(super) fn parse_blend(tokens: &[String], p: &mut Vec<String>) -> Vec<(f64, PathBuf)> {
    if tokens.len() == 1 {
        return vec![(1.0, PathBuf::from(&tokens[0]))];
    }
    if tokens.is_empty() || !tokens.len().is_multiple_of(2) {
        p.push(format!(
            "data.data_path: expected one prefix or `weight prefix` pairs, got {} token(s)",
            tokens.len()
        ));
        return Vec::new();
    }
    let mut out = Vec::new();
    for pair in tokens.chunks(2) {
        match pair[0].parse::<f64>() {
            Ok(w) if w.is_finite() && w >= 0.0 => out.push((w, PathBuf::from(&pair[1]))),
            _ => p.push(format!(
                "data.data_path: `{}` is not a non-negative weight",
                pair[0]
            )),
        }
    }
    if !out.is_empty() && out.iter().map(|(w, _)| w).sum::<f64>() <= 0.0 {
        p.push("data.data_path: blend weights sum to 0".to_string());
    }
    out
}

pub(super) fn parse_split(s: &str, p: &mut Vec<String>) -> [f64; 3] {
    let parts: Vec<Option<f64>> = s
        .split([',', '/'])
        .map(|x| x.trim().parse::<f64>().ok().filter(|v| *v >= 0.0))
        .collect();
    if parts.len() > 3 || parts.iter().any(Option::is_none) {
        p.push(format!(
            "data.split: `{s}` must be up to 3 non-negative numbers like \"969,30,1\""
        ));
        return [1.0, 0.0, 0.0];
    }
    let mut out = [0.0; 3];
    for (o, v) in out.iter_mut().zip(&parts) {
        *o = v.unwrap_or(0.0);
    }
    if out.iter().sum::<f64>() <= 0.0 {
        p.push(format!("data.split: `{s}` sums to 0"));
    }
    out
}

pub(super) fn check_exists(key: &str, path: &Path, p: &mut Vec<String>) {
    if !path.exists() {
        p.push(format!("{key}: `{}` does not exist", path.display()));
    }
}
