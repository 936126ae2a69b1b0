//! Reading SFT records from JSON / JSONL files (Pai's `json_sft.py` loads the same two layouts
//! with `datasets.load_dataset('json')`; `build_idxmap_sft_dataset.py` tries `json.load` and falls
//! back to one `json.loads` per line).
//!
//! A file whose first non-blank character is `[` is one JSON array of records; anything else is
//! JSONL (one record per line, blank lines ignored, a UTF-8 BOM and `\r\n` endings tolerated).
//! Line numbers are 1-based; for arrays they are the line where the element starts.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::sync::Arc;

use serde_json::Value;

use super::record::{detect, parse_alpaca, parse_chat};
use super::{MAX_BAD_EXAMPLES, SftError, SftReport};
use crate::chat::ChatMessage;

/// Input format of a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SftFormat {
    /// Detect per file from the first record: `messages` -> chat, `instruction`/`query` -> alpaca.
    Auto,
    /// `{"instruction", "input"?, "output"}`.
    Alpaca,
    /// `{"messages": [{"role", "content"}, ...]}`.
    Chat,
}

impl std::str::FromStr for SftFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(SftFormat::Auto),
            "alpaca" => Ok(SftFormat::Alpaca),
            "chat" | "messages" => Ok(SftFormat::Chat),
            _ => Err(format!("unknown SFT format {s:?} (auto, alpaca or chat)")),
        }
    }
}

/// One training example before rendering.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Conversation {
    /// An alpaca record; `input` is `""` when absent or null.
    Alpaca {
        instruction: String,
        input: String,
        output: String,
    },
    /// A chat with at least one `assistant` message.
    Chat(Vec<ChatMessage>),
}

/// A parsed record and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The file it was read from.
    pub path: Arc<Path>,
    /// 1-based line (for JSON arrays: where the element starts).
    pub line: usize,
    /// Its content.
    pub conversation: Conversation,
}

/// Counts a bad record in `report` (keeping the first [`MAX_BAD_EXAMPLES`] as `file:line: why`),
/// or returns it as [`SftError::BadRecord`] when `strict`.
pub(crate) fn bad_record(
    report: &mut SftReport,
    strict: bool,
    path: &Path,
    line: usize,
    message: String,
) -> Result<(), SftError> {
    if strict {
        return Err(SftError::BadRecord {
            path: path.to_path_buf(),
            line,
            message,
        });
    }
    report.bad_records += 1;
    if report.bad_examples.len() < MAX_BAD_EXAMPLES {
        report
            .bad_examples
            .push(format!("{}:{line}: {message}", path.display()));
    }
    Ok(())
}

/// Reads every record of `path` in order and hands it to `f`. Bad records (invalid JSON or
/// UTF-8, wrong fields) are counted in `report` with `file:line: reason`, or returned as
/// [`SftError::BadRecord`] when `strict`; I/O errors and errors returned by `f` stop the read.
pub fn read_file(
    path: &Path,
    format: SftFormat,
    strict: bool,
    report: &mut SftReport,
    f: &mut dyn FnMut(Record) -> Result<(), SftError>,
) -> Result<(), SftError> {
    let io = |source| SftError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut reader = BufReader::new(File::open(path).map_err(io)?);
    // Peek at the first non-blank byte (after a UTF-8 BOM), counting the newlines skipped so
    // that line numbers stay those of the file.
    let mut skipped_lines = 0;
    let mut at_start = true;
    let first = loop {
        let buf = reader.fill_buf().map_err(io)?;
        let bom = if at_start && buf.starts_with(b"\xEF\xBB\xBF") {
            3
        } else {
            0
        };
        at_start = false;
        let rest = &buf[bom..];
        match rest.iter().position(|b| !b.is_ascii_whitespace()) {
            Some(i) => {
                skipped_lines += rest[..i].iter().filter(|&&b| b == b'\n').count();
                let first = rest[i];
                reader.consume(bom + i);
                break Some(first);
            }
            None if buf.is_empty() => break None,
            None => {
                skipped_lines += rest.iter().filter(|&&b| b == b'\n').count();
                let n = buf.len();
                reader.consume(n);
            }
        }
    };
    let mut file = FileState {
        path: Arc::from(path),
        format,
        detected_at: 0,
        strict,
    };
    match first {
        None => Ok(()),
        Some(b'[') => {
            let mut text = String::new();
            std::io::Read::read_to_string(&mut reader, &mut text).map_err(io)?;
            file.read_array(&text, skipped_lines, report, f)
        }
        Some(_) => file.read_lines(reader, skipped_lines, report, f),
    }
}

struct FileState {
    path: Arc<Path>,
    format: SftFormat,
    detected_at: usize,
    strict: bool,
}

impl FileState {
    fn bad(&self, report: &mut SftReport, line: usize, msg: String) -> Result<(), SftError> {
        bad_record(report, self.strict, &self.path, line, msg)
    }

    /// Parses one record value (detecting the file's format on the first good one).
    fn record(
        &mut self,
        value: &Value,
        line: usize,
        report: &mut SftReport,
        f: &mut dyn FnMut(Record) -> Result<(), SftError>,
    ) -> Result<(), SftError> {
        let format = match self.format {
            SftFormat::Auto => match detect(value) {
                Some(d) => d,
                None => {
                    let msg = "cannot detect the format: expected an object with `messages` \
                               (chat) or `instruction`/`query` (alpaca)";
                    return self.bad(report, line, msg.into());
                }
            },
            fixed => fixed,
        };
        let parsed = match format {
            SftFormat::Chat => parse_chat(value),
            _ => parse_alpaca(value),
        };
        match parsed {
            Ok(conversation) => {
                if self.format == SftFormat::Auto {
                    self.format = format;
                    self.detected_at = line;
                }
                f(Record {
                    path: self.path.clone(),
                    line,
                    conversation,
                })
            }
            Err(msg) if self.detected_at > 0 => {
                let name = if format == SftFormat::Chat {
                    "chat"
                } else {
                    "alpaca"
                };
                let msg = format!("{msg} (file detected as {name} format at line {})", {
                    self.detected_at
                });
                self.bad(report, line, msg)
            }
            Err(msg) => self.bad(report, line, msg),
        }
    }

    fn read_lines(
        &mut self,
        mut reader: impl BufRead,
        skipped_lines: usize,
        report: &mut SftReport,
        f: &mut dyn FnMut(Record) -> Result<(), SftError>,
    ) -> Result<(), SftError> {
        let mut buf = Vec::new();
        let mut line = skipped_lines;
        loop {
            buf.clear();
            let n = reader
                .read_until(b'\n', &mut buf)
                .map_err(|source| SftError::Io {
                    path: self.path.to_path_buf(),
                    source,
                })?;
            if n == 0 {
                return Ok(());
            }
            line += 1;
            let text = match std::str::from_utf8(&buf) {
                Ok(t) => t.trim_start_matches('\u{feff}').trim(),
                Err(e) => {
                    self.bad(report, line, format!("invalid UTF-8: {e}"))?;
                    continue;
                }
            };
            if text.is_empty() {
                continue;
            }
            match serde_json::from_str::<Value>(text) {
                Ok(v) => self.record(&v, line, report, f)?,
                Err(e) => {
                    let msg = format!("invalid JSON at column {}: {}", e.column(), bare(&e));
                    self.bad(report, line, msg)?;
                }
            }
        }
    }

    fn read_array(
        &mut self,
        text: &str,
        skipped_lines: usize,
        report: &mut SftReport,
        f: &mut dyn FnMut(Record) -> Result<(), SftError>,
    ) -> Result<(), SftError> {
        let bytes = text.as_bytes();
        let mut lines = LineCounter {
            offset: 0,
            line0: skipped_lines,
        };
        let skip = |mut p: usize| {
            while p < bytes.len() && bytes[p].is_ascii_whitespace() {
                p += 1;
            }
            p
        };
        // Leading BOM/whitespace were consumed by the caller's peek: `[` is the first byte.
        let mut pos = 1;
        if bytes.get(skip(pos)) == Some(&b']') {
            pos = skip(pos) + 1;
        } else {
            loop {
                pos = skip(pos);
                let line = lines.line_at(bytes, pos);
                let mut stream = serde_json::Deserializer::from_str(&text[pos..]).into_iter();
                match stream.next() {
                    Some(Ok(v)) => {
                        pos += stream.byte_offset();
                        self.record(&v, line, report, f)?;
                    }
                    Some(Err(e)) => {
                        let at = line + e.line().saturating_sub(1);
                        let msg = format!("invalid JSON: {}; rest of the file skipped", bare(&e));
                        return self.bad(report, at, msg);
                    }
                    None => {
                        let msg = "unexpected end of file inside the JSON array".to_string();
                        return self.bad(report, line, msg);
                    }
                }
                pos = skip(pos);
                match bytes.get(pos) {
                    Some(b',') => pos += 1,
                    Some(b']') => {
                        pos += 1;
                        break;
                    }
                    other => {
                        let found =
                            other.map_or("end of file".into(), |b| format!("{:?}", *b as char));
                        let msg = format!(
                            "expected `,` or `]` after an array element, found {found}; rest of the file skipped"
                        );
                        return self.bad(report, lines.line_at(bytes, pos), msg);
                    }
                }
            }
        }
        let end = skip(pos);
        if end < bytes.len() {
            let msg = "trailing characters after the JSON array".to_string();
            return self.bad(report, lines.line_at(bytes, end), msg);
        }
        Ok(())
    }
}

/// 1-based line of increasing byte offsets, counted incrementally (linear overall).
struct LineCounter {
    offset: usize,
    line0: usize,
}

impl LineCounter {
    fn line_at(&mut self, bytes: &[u8], pos: usize) -> usize {
        let pos = pos.min(bytes.len());
        if pos >= self.offset {
            self.line0 += bytes[self.offset..pos]
                .iter()
                .filter(|&&b| b == b'\n')
                .count();
            self.offset = pos;
        }
        self.line0 + 1
    }
}

/// serde_json's message without its (slice-relative) " at line L column C" suffix.
fn bare(e: &serde_json::Error) -> String {
    let s = e.to_string();
    match s.rfind(" at line ") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}
