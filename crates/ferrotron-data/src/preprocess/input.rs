//! Reading input files into batches of raw records (one record = one document's bytes), on the
//! reader thread. JSONL records are lines; text records are lines or blank-line-separated
//! blocks. zstd-compressed files are recognized by their magic bytes, whatever their name.

use super::{InputFormat, PreprocessError, TextMode};
use std::cell::Cell;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::rc::Rc;

/// Target bytes of record text per batch (a unit of work for one tokenizing worker).
const BATCH_BYTES: usize = 128 << 10;
/// At most this many records per batch.
const BATCH_RECORDS: usize = 4096;
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xB5, 0x2F, 0xFD];

/// One record's bytes within [`Batch::data`] and the 1-based line where it starts.
pub(crate) struct Record {
    pub start: usize,
    pub end: usize,
    pub line: u64,
}

/// Consecutive records of one input file, numbered so that the writer can restore order.
pub(crate) struct Batch {
    pub seq: u64,
    pub file: usize,
    pub data: Vec<u8>,
    pub records: Vec<Record>,
    /// Blank lines skipped in this batch's span of the file.
    pub blank_lines: u64,
    /// Decompressed bytes this batch covers (records, newlines and blank lines).
    pub text_bytes: u64,
    /// Input-file bytes consumed so far over all inputs, at the end of this batch.
    pub input_pos: u64,
}

/// Format of `path` when none is given: `.txt` or `.txt.zst` is text, anything else JSONL.
pub(crate) fn detect_format(path: &Path) -> InputFormat {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default();
    let name = name.strip_suffix(".zst").unwrap_or(&name);
    if name.ends_with(".txt") {
        InputFormat::Text
    } else {
        InputFormat::Jsonl
    }
}

/// A reader that counts the bytes it hands out (compressed bytes for a zstd file).
struct Counting<R> {
    inner: R,
    count: Rc<Cell<u64>>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count.set(self.count.get() + n as u64);
        Ok(n)
    }
}

/// A line reader over an input, and the counter of raw file bytes it has consumed.
type Opened = (Box<dyn BufRead>, Rc<Cell<u64>>);

/// Opens `path` for line reading, decompressing zstd when the file starts with its magic.
fn open(path: &Path) -> Result<Opened, PreprocessError> {
    let io = |source| PreprocessError::Io {
        path: path.to_path_buf(),
        source,
    };
    let count = Rc::new(Cell::new(0));
    let file = File::open(path).map_err(io)?;
    let mut raw = BufReader::with_capacity(
        1 << 20,
        Counting {
            inner: file,
            count: count.clone(),
        },
    );
    let is_zstd = raw.fill_buf().map_err(io)?.starts_with(&ZSTD_MAGIC);
    let reader: Box<dyn BufRead> = if is_zstd {
        let dec = zstd::Decoder::with_buffer(raw).map_err(io)?;
        Box::new(BufReader::with_capacity(1 << 20, dec))
    } else {
        Box::new(raw)
    };
    Ok((reader, count))
}

fn is_blank(line: &[u8]) -> bool {
    line.iter().all(u8::is_ascii_whitespace)
}

/// Builds batches for one file and hands each to `emit` (which returns false to stop).
struct Batcher<'a> {
    file: usize,
    next_seq: &'a mut u64,
    batch: Batch,
}

impl Batcher<'_> {
    fn new_batch(seq: u64, file: usize) -> Batch {
        Batch {
            seq,
            file,
            data: Vec::with_capacity(BATCH_BYTES + (BATCH_BYTES >> 2)),
            records: Vec::new(),
            blank_lines: 0,
            text_bytes: 0,
            input_pos: 0,
        }
    }

    fn full(&self) -> bool {
        self.batch.data.len() >= BATCH_BYTES || self.batch.records.len() >= BATCH_RECORDS
    }

    /// Sends the current batch (even when empty, to carry counts) and starts the next.
    fn flush(&mut self, input_pos: u64, emit: &mut dyn FnMut(Batch) -> bool) -> bool {
        *self.next_seq += 1;
        let next = Self::new_batch(*self.next_seq, self.file);
        let mut batch = std::mem::replace(&mut self.batch, next);
        batch.input_pos = input_pos;
        emit(batch)
    }
}

/// Strips a trailing `\n` and then `\r`.
fn trim_newline(line: &[u8]) -> &[u8] {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    line.strip_suffix(b"\r").unwrap_or(line)
}

/// Reads input `file` (index `file_index`) and emits its records in batches. `base_pos` is the
/// number of input bytes of earlier files; returns this file's raw byte count. `emit` returning
/// false stops reading early (the pipeline is shutting down).
pub(crate) fn read_file(
    path: &Path,
    file_index: usize,
    format: InputFormat,
    text_mode: TextMode,
    base_pos: u64,
    next_seq: &mut u64,
    emit: &mut dyn FnMut(Batch) -> bool,
) -> Result<u64, PreprocessError> {
    let (mut reader, count) = open(path)?;
    let mut b = Batcher {
        file: file_index,
        batch: Batcher::new_batch(*next_seq, file_index),
        next_seq,
    };
    let blocks = format == InputFormat::Text && text_mode == TextMode::Blocks;
    let mut line = Vec::new();
    let mut line_no = 0u64;
    let mut in_block = false;
    loop {
        line.clear();
        let n = reader
            .read_until(b'\n', &mut line)
            .map_err(|source| PreprocessError::Io {
                path: path.to_path_buf(),
                source,
            })?;
        if n == 0 {
            break;
        }
        line_no += 1;
        b.batch.text_bytes += n as u64;
        let content = trim_newline(&line);
        if is_blank(content) {
            b.batch.blank_lines += 1;
            in_block = false;
        } else if blocks && in_block {
            // Continue the current block (the last record of this batch).
            let batch = &mut b.batch;
            batch.data.push(b'\n');
            batch.data.extend_from_slice(content);
            batch.records.last_mut().expect("open block").end = batch.data.len();
        } else {
            let batch = &mut b.batch;
            let start = batch.data.len();
            batch.data.extend_from_slice(content);
            batch.records.push(Record {
                start,
                end: batch.data.len(),
                line: line_no,
            });
            in_block = blocks;
        }
        // A block may span batches only at a blank line, so flush only outside a block.
        if !in_block && b.full() && !b.flush(base_pos + count.get(), emit) {
            return Ok(count.get());
        }
    }
    if !b.batch.records.is_empty() || b.batch.text_bytes > 0 {
        b.flush(base_pos + count.get(), emit);
    }
    Ok(count.get())
}
