//! Files -> records -> encoded samples -> packed groups, shared by the raw and the preprocessed
//! forms so that both produce the same sequences. Encoding (template rendering and
//! tokenization, the expensive part) runs on [`SftOptions::workers`] threads over batches of
//! records; results are consumed in input order, so the output does not depend on the count.

use std::path::Path;

use super::encode::{EncodedSample, SftEncoder};
use super::pack::Packer;
use super::source::{self, Record};
use super::{MAX_BAD_EXAMPLES, SftError, SftOptions, SftReport};

/// Records encoded per worker per batch.
const BATCH_PER_WORKER: usize = 64;

/// Reads `files` in order, encodes every record, and hands each finished group of samples
/// (one sequence's worth) to `emit`, counting into `report`.
///
/// Errors: invalid options, unreadable files, errors from `emit`, and in strict mode the first
/// bad record met (with several workers, a JSON error can be met before an earlier record's
/// rendering error).
pub(crate) fn for_each_group(
    files: &[&Path],
    encoder: &SftEncoder,
    opts: &SftOptions,
    report: &mut SftReport,
    emit: &mut dyn FnMut(Vec<EncodedSample>) -> Result<(), SftError>,
) -> Result<(), SftError> {
    if opts.max_padding_length < 2 {
        return Err(SftError::Options(format!(
            "max_padding_length must be at least 2, got {}",
            opts.max_padding_length
        )));
    }
    let workers = opts.workers.max(1);
    let mut state = State {
        encoder,
        opts,
        workers,
        packer: Packer::new(opts.max_padding_length, opts.pack, opts.overlong),
        counts: SftReport::default(),
        batch: Vec::with_capacity(workers * BATCH_PER_WORKER),
        emit,
    };
    for path in files {
        // Bad lines are counted by the reader, bad renders by `state`: two reports, merged.
        let mut read_counts = SftReport::default();
        let result = source::read_file(
            path,
            opts.format,
            opts.strict,
            &mut read_counts,
            &mut |record| state.push(record),
        )
        .and_then(|()| state.flush());
        merge(report, read_counts);
        merge(report, std::mem::take(&mut state.counts));
        result?;
    }
    if let Some(g) = state.packer.finish() {
        report.sequences += 1;
        (state.emit)(g)?;
    }
    Ok(())
}

struct State<'a> {
    encoder: &'a SftEncoder,
    opts: &'a SftOptions,
    workers: usize,
    packer: Packer,
    counts: SftReport,
    batch: Vec<Record>,
    emit: &'a mut dyn FnMut(Vec<EncodedSample>) -> Result<(), SftError>,
}

impl State<'_> {
    fn push(&mut self, record: Record) -> Result<(), SftError> {
        self.batch.push(record);
        if self.batch.len() >= self.workers * BATCH_PER_WORKER {
            self.flush()?;
        }
        Ok(())
    }

    /// Encodes the batch (in parallel) and feeds the results to the packer in order.
    fn flush(&mut self) -> Result<(), SftError> {
        let batch = std::mem::take(&mut self.batch);
        let encoder = self.encoder;
        let encode = |rs: &[Record]| -> Vec<Result<EncodedSample, String>> {
            rs.iter().map(|r| encoder.encode(&r.conversation)).collect()
        };
        let results: Vec<Result<EncodedSample, String>> = if self.workers == 1 || batch.len() < 2 {
            encode(&batch)
        } else {
            let chunk = batch.len().div_ceil(self.workers);
            std::thread::scope(|scope| {
                let handles: Vec<_> = batch
                    .chunks(chunk)
                    .map(|rs| scope.spawn(move || encode(rs)))
                    .collect();
                handles
                    .into_iter()
                    .flat_map(|h| match h.join() {
                        Ok(v) => v,
                        Err(_) => vec![Err("encoder thread panicked".to_string())],
                    })
                    .collect()
            })
        };
        for (record, result) in batch.iter().zip(results) {
            match result {
                Ok(sample) => {
                    self.counts.records += 1;
                    if let Some(group) = self.packer.push(sample, &mut self.counts) {
                        self.counts.sequences += 1;
                        (self.emit)(group)?;
                    }
                }
                Err(msg) => {
                    let strict = self.opts.strict;
                    let (path, line) = (&record.path, record.line);
                    source::bad_record(&mut self.counts, strict, path, line, msg)?;
                }
            }
        }
        self.batch = batch;
        self.batch.clear();
        Ok(())
    }
}

fn merge(into: &mut SftReport, from: SftReport) {
    into.records += from.records;
    into.bad_records += from.bad_records;
    for e in from.bad_examples {
        if into.bad_examples.len() < MAX_BAD_EXAMPLES {
            into.bad_examples.push(e);
        }
    }
    into.truncated += from.truncated;
    into.dropped_overlong += from.dropped_overlong;
    into.dropped_no_answer += from.dropped_no_answer;
    into.samples += from.samples;
    into.sequences += from.sequences;
    into.tokens += from.tokens;
    into.trained_tokens += from.trained_tokens;
}
