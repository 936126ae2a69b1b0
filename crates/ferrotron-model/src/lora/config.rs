//! [`LoraConfig`]: which linear layers get a LoRA adapter and its size (NeMo's `LoRA` model
//! transform, `nemo/collections/llm/peft/lora.py`, with PEFT's `r` / `lora_alpha` meaning).

use crate::Result;
use crate::config::field_error;

/// The linear layers a bare target name can mean (Megatron-Core module names).
pub const LORA_MODULES: [&str; 4] = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"];

/// Low-rank adapters on linear layers (Hu et al. 2021, "LoRA"): each matched layer computes
/// `y = x·Wᵀ + b + (alpha/rank)·(x·Aᵀ)·Bᵀ` with `A = linear_in: [rank, in]` and
/// `B = linear_out: [out, rank]` (NeMo's `ParallelLinearAdapter` names), and every other
/// parameter of the model is frozen.
///
/// Fused layers keep one adapter: `linear_qkv`'s `A` is shared by the q, k and v rows and
/// `linear_fc1`'s by gate and up, so a PEFT adapter with one `lora_A` per HF projection is
/// the same adapter with that `A` repeated (exported that way; imported when the repeats are
/// equal).
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    /// Which linear layers get an adapter (NeMo's `target_modules`): a bare module name
    /// (`linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`) matches that module in
    /// every layer; a target with `*` or `.` matches whole Megatron module names, `*`
    /// standing for any run of characters (`*.layers.0.*.linear_qkv` and
    /// `decoder.layers.0.self_attention.linear_qkv` both match the latter). NeMo's default
    /// is all four.
    pub target_modules: Vec<String>,
    /// The adapter rank (NeMo `dim`, PEFT `r`); > 0. NeMo's default is 32.
    pub rank: usize,
    /// The scale numerator (NeMo / PEFT `alpha`): the adapter's output is multiplied by
    /// `alpha / rank`. NeMo's default is 32.
    pub alpha: f32,
    /// Dropout on the adapter's input in training passes (NeMo `dropout`, position `pre`;
    /// PEFT `lora_dropout`), in `[0, 1)`; 0 (NeMo's default) turns it off.
    pub dropout: f32,
}

impl Default for LoraConfig {
    /// NeMo's defaults: all four linear layers, rank 32, alpha 32, no dropout.
    fn default() -> LoraConfig {
        LoraConfig {
            target_modules: LORA_MODULES.iter().map(|m| m.to_string()).collect(),
            rank: 32,
            alpha: 32.0,
            dropout: 0.0,
        }
    }
}

impl LoraConfig {
    /// The factor on the adapter's output, `alpha / rank`.
    pub fn scale(&self) -> f32 {
        self.alpha / self.rank as f32
    }

    /// Whether the linear layer named `module` (Megatron prefix, e.g.
    /// `decoder.layers.3.mlp.linear_fc1`) gets an adapter.
    pub fn matches(&self, module: &str) -> bool {
        self.target_modules
            .iter()
            .any(|t| target_matches(t, module))
    }

    /// Checks the fields, naming the first bad one (`lora.rank`, ...).
    ///
    /// # Errors
    /// No targets, a bare target that is no linear layer's name, rank 0, a non-finite
    /// alpha, or a dropout outside `[0, 1)`.
    pub fn validate(&self) -> Result<()> {
        if self.target_modules.is_empty() {
            return Err(field_error(
                "lora.target_modules",
                format!("is empty; name modules among {LORA_MODULES:?} or patterns with `*`"),
            ));
        }
        for t in &self.target_modules {
            if !is_pattern(t) && !LORA_MODULES.contains(&t.as_str()) {
                return Err(field_error(
                    "lora.target_modules",
                    format!(
                        "`{t}` is not a linear layer: name one of {LORA_MODULES:?} or give a \
                         pattern with `*` over Megatron module names (e.g. \
                         `*.layers.0.*.linear_qkv`)"
                    ),
                ));
            }
        }
        if self.rank == 0 {
            return Err(field_error("lora.rank", "must be > 0"));
        }
        if !self.alpha.is_finite() {
            return Err(field_error(
                "lora.alpha",
                format!("must be finite, got {}", self.alpha),
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(field_error(
                "lora.dropout",
                format!("must be in [0, 1), got {}", self.dropout),
            ));
        }
        Ok(())
    }
}

/// A target over whole module names (it has a `*` or a `.`).
fn is_pattern(target: &str) -> bool {
    target.contains(['*', '.'])
}

/// NeMo's `ModuleMatcher`: a target with `*` (or, here, a `.`) is a wildcard over the whole
/// module name; one without is the module's own (last) name.
pub(crate) fn target_matches(target: &str, module: &str) -> bool {
    if is_pattern(target) {
        wildcard_match(target.as_bytes(), module.as_bytes())
    } else {
        module.rsplit('.').next() == Some(target)
    }
}

/// `pattern` (where `*` is any run of bytes, possibly empty) matches all of `text`.
fn wildcard_match(pattern: &[u8], text: &[u8]) -> bool {
    // Greedy with backtracking to the last star: O(len(pattern)·len(text)) at worst.
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        if p < pattern.len() && pattern[p] == b'*' {
            star = Some((p, t));
            p += 1;
        } else if p < pattern.len() && pattern[p] == text[t] {
            p += 1;
            t += 1;
        } else if let Some((sp, st)) = star {
            p = sp + 1;
            t = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    pattern[p..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_names_and_wildcards_match_as_nemo() {
        let c = LoraConfig {
            target_modules: vec!["linear_qkv".into(), "*.layers.1.*.linear_fc*".into()],
            ..LoraConfig::default()
        };
        assert!(c.matches("decoder.layers.0.self_attention.linear_qkv"));
        assert!(!c.matches("decoder.layers.0.self_attention.linear_proj"));
        assert!(c.matches("decoder.layers.1.mlp.linear_fc1"));
        assert!(c.matches("decoder.layers.1.mlp.linear_fc2"));
        assert!(!c.matches("decoder.layers.11.mlp.linear_fc2"));
        assert!(!c.matches("decoder.layers.0.mlp.linear_fc1"));
        assert!(target_matches(
            "decoder.layers.2.mlp.linear_fc2",
            "decoder.layers.2.mlp.linear_fc2"
        ));
        assert!(!target_matches(
            "decoder.layers.2.mlp.linear_fc2",
            "decoder.layers.12.mlp.linear_fc2"
        ));
        assert!(wildcard_match(b"*", b""));
        assert!(wildcard_match(b"a*b*c", b"aXbYbc"));
        assert!(!wildcard_match(b"a*b", b"aXbc"));
    }

    #[test]
    fn bad_fields_are_named() {
        let bad = |c: LoraConfig| c.validate().unwrap_err().to_string();
        let d = LoraConfig::default;
        assert!(bad(LoraConfig { rank: 0, ..d() }).contains("lora.rank"));
        let q = LoraConfig {
            target_modules: vec!["q_proj".into()],
            ..d()
        };
        assert!(bad(q).contains("`q_proj` is not a linear layer"));
        assert!(
            bad(LoraConfig {
                dropout: 1.0,
                ..d()
            })
            .contains("lora.dropout")
        );
        assert!(
            bad(LoraConfig {
                alpha: f32::NAN,
                ..d()
            })
            .contains("lora.alpha")
        );
        assert_eq!(d().scale(), 1.0);
    }
}
