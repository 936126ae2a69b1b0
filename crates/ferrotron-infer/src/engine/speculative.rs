//! Speculative decoding: a decoding sequence proposes the next tokens cheaply, the model
//! scores the proposal and the real next token in one pass, and
//! [`crate::sampler::Sampler::verify`] keeps each proposed token with exactly the probability
//! that leaves the output distribution unchanged. Greedy output is identical with and without
//! speculation: the proposal is checked row by row with the arithmetic of one-token decode
//! steps. Proposals come from prompt lookup ([`NgramConfig`], vLLM's `ngram` method; Saxena's
//! prompt lookup decoding: the tokens that followed the most recent earlier occurrence of the
//! last n tokens) or from a draft model (`super::draft`).

use serde::Deserialize;

/// How decoding sequences propose tokens (vLLM's speculative methods).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpeculativeConfig {
    /// Prompt lookup.
    Ngram(NgramConfig),
    /// A smaller model with the same vocabulary proposes `num_speculative_tokens` tokens
    /// greedily ([`super::Engine::with_draft_model`] gives it to the engine).
    DraftModel {
        /// Tokens proposed per step.
        num_speculative_tokens: usize,
    },
}

impl SpeculativeConfig {
    /// Checks the settings (at least one token proposed).
    pub fn validate(&self) -> Result<(), String> {
        match self {
            SpeculativeConfig::Ngram(c) => c.validate(),
            SpeculativeConfig::DraftModel {
                num_speculative_tokens: 0,
            } => Err("speculative config: need num_speculative_tokens >= 1".into()),
            SpeculativeConfig::DraftModel { .. } => Ok(()),
        }
    }
}

/// `--speculative-config` for prompt lookup (vLLM's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NgramConfig {
    /// Most tokens proposed per step.
    pub num_speculative_tokens: usize,
    /// Longest n-gram matched (tried first).
    pub prompt_lookup_max: usize,
    /// Shortest n-gram matched (default 1).
    #[serde(default = "one")]
    pub prompt_lookup_min: usize,
}

fn one() -> usize {
    1
}

impl NgramConfig {
    /// Parses vLLM's `--speculative-config` JSON, e.g. `{"method": "ngram",
    /// "num_speculative_tokens": 4, "prompt_lookup_max": 3}`; errors name the problem.
    pub fn from_json(text: &str) -> Result<NgramConfig, String> {
        let mut v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let method = v.as_object_mut().and_then(|o| o.remove("method"));
        match method.as_ref().and_then(|m| m.as_str()) {
            Some("ngram") => {}
            other => {
                return Err(format!(
                    "\"method\" must be \"ngram\" (prompt lookup; a draft model is given \
                     with --draft-model), got {other:?}"
                ));
            }
        }
        let config: NgramConfig = serde_json::from_value(v).map_err(|e| e.to_string())?;
        config.validate()?;
        Ok(config)
    }

    /// Checks `1 <= prompt_lookup_min <= prompt_lookup_max` and `num_speculative_tokens >= 1`.
    pub fn validate(&self) -> Result<(), String> {
        let ok = self.num_speculative_tokens >= 1
            && 1 <= self.prompt_lookup_min
            && self.prompt_lookup_min <= self.prompt_lookup_max;
        match ok {
            true => Ok(()),
            false => Err(format!(
                "speculative config: need num_speculative_tokens >= 1 and 1 <= \
                 prompt_lookup_min <= prompt_lookup_max, got {self:?}"
            )),
        }
    }

    /// Up to `max` tokens proposed to follow `tokens`: for n from `prompt_lookup_max` down to
    /// `prompt_lookup_min`, the last n tokens are searched for earlier in `tokens`, and the
    /// tokens after the most recent match are the proposal (empty when nothing matches).
    pub fn propose(&self, tokens: &[u32], max: usize) -> Vec<u32> {
        let k = self.num_speculative_tokens.min(max);
        if k == 0 {
            return Vec::new();
        }
        for n in (self.prompt_lookup_min..=self.prompt_lookup_max).rev() {
            if tokens.len() <= n {
                continue;
            }
            let pattern = &tokens[tokens.len() - n..];
            // Starts of earlier occurrences, most recent first (not the suffix itself).
            let found = (0..tokens.len() - n)
                .rev()
                .find(|&i| &tokens[i..i + n] == pattern);
            if let Some(i) = found {
                let after = &tokens[i + n..];
                return after[..k.min(after.len())].to_vec();
            }
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_longest_most_recent_match() {
        let c = NgramConfig {
            num_speculative_tokens: 3,
            prompt_lookup_max: 3,
            prompt_lookup_min: 1,
        };
        // "1 2 3 4 5 ... 1 2 3" -> 4 5 6 (3-gram match).
        assert_eq!(c.propose(&[1, 2, 3, 4, 5, 6, 9, 1, 2, 3], 8), [4, 5, 6]);
        // Only the 1-gram "7" matches; its most recent earlier occurrence is followed by 8.
        assert_eq!(c.propose(&[7, 1, 7, 8, 2, 7], 8), [8, 2, 7]);
        // The budget caps the proposal; no match proposes nothing.
        assert_eq!(c.propose(&[1, 2, 3, 4, 5, 6, 9, 1, 2, 3], 1), [4]);
        assert!(c.propose(&[1, 2, 3], 8).is_empty());
        assert!(c.validate().is_ok());
        let parsed = NgramConfig::from_json(
            r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}"#,
        );
        assert_eq!(parsed, Ok(c));
        for bad in [
            r#"{"method": "draft_model", "num_speculative_tokens": 3, "prompt_lookup_max": 3}"#,
            r#"{"method": "ngram", "num_speculative_tokens": 3}"#,
            r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "x": 1}"#,
            "{",
        ] {
            assert!(NgramConfig::from_json(bad).is_err(), "{bad}");
        }
        let bad = NgramConfig {
            prompt_lookup_min: 4,
            ..c
        };
        assert!(bad.validate().is_err());
    }
}
