//! Turning one JSON record into a [`Conversation`]: format detection and field checks, with
//! messages naming the offending field (`messages[3].content: expected a string, found null`).

use serde_json::Value;

use super::source::{Conversation, SftFormat};
use crate::chat::ChatMessage;

/// The format a record looks like, if any.
pub(super) fn detect(v: &Value) -> Option<SftFormat> {
    let o = v.as_object()?;
    if o.contains_key("messages") {
        Some(SftFormat::Chat)
    } else if o.contains_key("instruction") || o.contains_key("query") {
        Some(SftFormat::Alpaca)
    } else {
        None
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The string field `names[0]` (or an alias), `None` when absent (or null if `null_ok`).
fn string_field(v: &Value, names: &[&str], null_ok: bool) -> Result<Option<String>, String> {
    for name in names {
        match v.get(*name) {
            None => continue,
            Some(Value::String(s)) => return Ok(Some(s.clone())),
            Some(Value::Null) if null_ok => return Ok(None),
            Some(other) => {
                return Err(format!(
                    "field `{name}`: expected a string, found {}",
                    kind(other)
                ));
            }
        }
    }
    Ok(None)
}

pub(super) fn parse_alpaca(v: &Value) -> Result<Conversation, String> {
    if !v.is_object() {
        return Err(format!("expected an alpaca object, found {}", kind(v)));
    }
    let missing = |n: &str| format!("missing string field `{n}`");
    let instruction =
        string_field(v, &["instruction", "query"], false)?.ok_or_else(|| missing("instruction"))?;
    let input = string_field(v, &["input"], true)?.unwrap_or_default();
    let output =
        string_field(v, &["output", "response"], false)?.ok_or_else(|| missing("output"))?;
    Ok(Conversation::Alpaca {
        instruction,
        input,
        output,
    })
}

pub(super) fn parse_chat(v: &Value) -> Result<Conversation, String> {
    let messages = match v.get("messages") {
        Some(Value::Array(a)) => a,
        Some(other) => {
            return Err(format!(
                "field `messages`: expected an array, found {}",
                kind(other)
            ));
        }
        None => return Err("missing field `messages`".into()),
    };
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let field = |name: &str| match m.get(name) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(other) => Err(format!(
                "messages[{i}].{name}: expected a string, found {}",
                kind(other)
            )),
            None if m.is_object() => Err(format!("messages[{i}]: missing field `{name}`")),
            None => Err(format!(
                "messages[{i}]: expected an object, found {}",
                kind(m)
            )),
        };
        out.push(ChatMessage::new(field("role")?, field("content")?));
    }
    if !out.iter().any(|m| m.role == "assistant") {
        return Err("no `assistant` message: nothing to train on".into());
    }
    Ok(Conversation::Chat(out))
}
