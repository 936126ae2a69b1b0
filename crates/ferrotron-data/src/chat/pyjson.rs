//! Python-compatible value printing for chat templates: `tojson` with the exact output of
//! Python's `json.dumps` (separators, `ensure_ascii`, `indent`, `sort_keys`, float repr), as
//! transformers' Jinja environment produces it.

use minijinja::value::{Kwargs, Rest, Value, ValueKind, from_args};
use minijinja::{Error, ErrorKind};

/// HF's `tojson` filter: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, arguments positional or keyword.
pub(super) fn tojson(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    type Args = (Option<Value>, Option<Value>, Option<Value>, Option<Value>);
    let (ensure_ascii, indent, separators, sort_keys): Args = from_args(&args)?;
    let arg = |positional: Option<Value>, name: &str| -> Result<Value, Error> {
        match (positional, kwargs.get::<Option<Value>>(name)?) {
            (Some(_), Some(_)) => Err(Error::new(
                ErrorKind::TooManyArguments,
                format!("tojson() got multiple values for argument '{name}'"),
            )),
            (p, k) => Ok(p.or(k).unwrap_or(Value::from(()))),
        }
    };
    let (ensure_ascii, indent) = (arg(ensure_ascii, "ensure_ascii")?, arg(indent, "indent")?);
    let (separators, sort_keys) = (arg(separators, "separators")?, arg(sort_keys, "sort_keys")?);
    kwargs.assert_all_used()?;
    let indent = match indent.kind() {
        ValueKind::None => None,
        ValueKind::String => Some(indent.as_str().unwrap_or_default().to_owned()),
        _ => Some(" ".repeat(i64::try_from(indent.clone())?.max(0) as usize)),
    };
    let (item_sep, key_sep) = match separators.kind() {
        ValueKind::None => (
            if indent.is_some() { "," } else { ", " }.into(),
            ": ".into(),
        ),
        _ => from_args(&separators.try_iter()?.collect::<Vec<_>>())?,
    };
    let (ascii, sort) = (ensure_ascii.is_true(), sort_keys.is_true());
    let style = Style {
        repr: false,
        ascii,
        indent,
        item_sep,
        key_sep,
        sort,
    };
    Ok(Value::from(dump(value, &style, 0)?))
}

/// Layout of [`dump`]: Python's `json.dumps` options, or `repr` mode.
pub(super) struct Style {
    repr: bool,
    ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort: bool,
}

impl Style {
    pub(super) fn python_repr() -> Self {
        let (item_sep, key_sep) = (", ".into(), ": ".into());
        Style {
            repr: true,
            ascii: false,
            indent: None,
            item_sep,
            key_sep,
            sort: false,
        }
    }
}

/// Python's `json.dumps` (`JSONEncoder` layout rules) or, in `repr` mode, Python's `repr`.
pub(super) fn dump(value: &Value, st: &Style, depth: usize) -> Result<String, Error> {
    let [null, yes, no, nan, inf] = match st.repr {
        true => ["None", "True", "False", "nan", "inf"],
        false => ["null", "true", "false", "NaN", "Infinity"],
    };
    let mut entries: Vec<(Option<(String, String)>, Value)> = match value.kind() {
        ValueKind::None => return Ok(null.into()),
        ValueKind::Bool => return Ok(if value.is_true() { yes } else { no }.into()),
        ValueKind::Number if value.is_integer() => return Ok(value.to_string()),
        ValueKind::Number => {
            let f = f64::try_from(value.clone())?;
            return Ok(match f {
                _ if f.is_nan() => nan.into(),
                _ if f.is_infinite() => format!("{}{inf}", if f < 0.0 { "-" } else { "" }),
                _ => py_float(f),
            });
        }
        ValueKind::String if st.repr => return Ok(py_str_repr(value.as_str().unwrap_or_default())),
        ValueKind::String => return Ok(json_str(value.as_str().unwrap_or_default(), st.ascii)),
        ValueKind::Seq | ValueKind::Iterable => value.try_iter()?.map(|v| (None, v)).collect(),
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let text = match key.kind() {
                    ValueKind::String if !st.repr => key.as_str().unwrap_or_default().to_owned(),
                    ValueKind::String | ValueKind::None | ValueKind::Bool | ValueKind::Number => {
                        dump(&key, st, depth)?
                    }
                    kind => return Err(not_serializable(&format!("{kind} key"))),
                };
                let encoded = if st.repr {
                    text.clone()
                } else {
                    json_str(&text, st.ascii)
                };
                entries.push((Some((text, encoded)), value.get_item(&key)?));
            }
            entries
        }
        _ if st.repr => return Ok(value.to_string()),
        kind => return Err(not_serializable(&kind.to_string())),
    };
    if st.sort {
        entries.sort_by(|a, b| a.0.cmp(&b.0));
    }
    let (open, close) = match value.kind() {
        ValueKind::Map => ("{", "}"),
        _ if st.repr && value.is_tuple() => ("(", if entries.len() == 1 { ",)" } else { ")" }),
        _ => ("[", "]"),
    };
    let newline = |out: &mut String, level: usize| {
        if let Some(indent) = &st.indent {
            out.push('\n');
            (0..level).for_each(|_| out.push_str(indent));
        }
    };
    let mut out = String::from(open);
    for (i, (key, item)) in entries.iter().enumerate() {
        if i > 0 {
            out.push_str(&st.item_sep);
        }
        newline(&mut out, depth + 1);
        if let Some((_, encoded)) = key {
            out.push_str(encoded);
            out.push_str(&st.key_sep);
        }
        out.push_str(&dump(item, st, depth + 1)?);
    }
    if !entries.is_empty() {
        newline(&mut out, depth);
    }
    out.push_str(close);
    Ok(out)
}

fn not_serializable(what: &str) -> Error {
    let message = format!("Object of type {what} is not JSON serializable");
    Error::new(ErrorKind::InvalidOperation, message)
}

/// Python `float.__repr__`: shortest round-trip digits, scientific outside 1e-4 <= |x| < 1e16.
fn py_float(f: f64) -> String {
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    let sci = format!("{:e}", f.abs());
    let (mantissa, exp) = sci
        .split_once('e')
        .expect("LowerExp always has an exponent");
    let exp: i32 = exp.parse().expect("LowerExp exponent is an integer");
    let digits = mantissa.replace('.', "");
    let sign = if f < 0.0 { "-" } else { "" };
    if !(-4..16).contains(&exp) {
        let (head, tail) = digits.split_at(1);
        let dot = if tail.is_empty() { "" } else { "." };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{head}{dot}{tail}e{exp_sign}{:02}", exp.abs())
    } else if exp >= 0 {
        let int_len = exp as usize + 1;
        match digits.len().checked_sub(int_len) {
            Some(1..) => format!("{sign}{}.{}", &digits[..int_len], &digits[int_len..]),
            _ => format!("{sign}{digits}{}.0", "0".repeat(int_len - digits.len())),
        }
    } else {
        format!("{sign}0.{}{digits}", "0".repeat((-exp - 1) as usize))
    }
}

/// Python `str.__repr__` (control characters as `\xNN`).
fn py_str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::from(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => out.extend(['\\', c]),
            c if c.is_control() && (c as u32) < 0x100 => out += &format!("\\x{:02x}", c as u32),
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// Python's `encode_basestring` / `encode_basestring_ascii`.
fn json_str(s: &str, ascii: bool) -> String {
    let mut out = String::from('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if c < ' ' || (ascii && c > '~') => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out += &format!("\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}
