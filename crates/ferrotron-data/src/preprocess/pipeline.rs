//! The preprocessing pipeline: a reader thread batches records, worker threads tokenize
//! batches, and the calling thread writes them in input order. Channels are bounded and a pool
//! of permits caps the batches in flight, so memory stays bounded whatever the input size.

use super::encode::{EncodeSettings, Encoded};
use super::input::{Batch, detect_format, read_file};
use super::{
    InputFormat, MAX_SKIP_EXAMPLES, OutputDataset, PreprocessConfig, PreprocessError,
    PreprocessReport, Progress, SkippedLine, output_prefix_for,
};
use crate::Tokenizer;
use crate::indexed::{IndexedDatasetBuilder, TokenDtype};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Checks the settings; returns each input's format.
fn validate(cfg: &PreprocessConfig) -> Result<Vec<InputFormat>, PreprocessError> {
    let bad = |m: String| Err(PreprocessError::Config(m));
    if cfg.inputs.is_empty() {
        return bad("no input files".into());
    }
    if cfg.json_keys.is_empty() {
        return bad("no JSON keys".into());
    }
    if let Some(k) = cfg.json_keys.iter().find(|k| k.is_empty()) {
        return bad(format!("empty JSON key {k:?}"));
    }
    for (i, k) in cfg.json_keys.iter().enumerate() {
        if cfg.json_keys[..i].contains(k) {
            return bad(format!("JSON key {k:?} given twice"));
        }
    }
    let formats: Vec<InputFormat> = cfg
        .inputs
        .iter()
        .map(|p| cfg.format.unwrap_or_else(|| detect_format(p)))
        .collect();
    if let Some(i) = formats.iter().position(|&f| f == InputFormat::Text)
        && cfg.json_keys.len() != 1
    {
        return bad(format!(
            "{}: a text input needs exactly one key to name its output, got {:?}",
            cfg.inputs[i].display(),
            cfg.json_keys
        ));
    }
    Ok(formats)
}

/// Tokenizes `cfg.inputs` with `tokenizer` into one Megatron dataset per JSON key (see the
/// [module docs](super)). `progress` is called on this thread after every batch written.
///
/// Errors: invalid settings, unreadable inputs, a bad record in strict mode, tokenizer
/// failures, tokens that do not fit the dtype, write failures, cancellation. On error no file
/// is left under the output names.
pub fn preprocess_data(
    cfg: &PreprocessConfig,
    tokenizer: &Tokenizer,
    progress: &mut dyn FnMut(&Progress),
) -> Result<PreprocessReport, PreprocessError> {
    let start = Instant::now();
    let formats = validate(cfg)?;
    let dtype = cfg
        .dtype
        .unwrap_or_else(|| TokenDtype::optimal(tokenizer.vocab_size()));
    let input_bytes_total = total_input_bytes(&cfg.inputs)?;
    let prefixes: Vec<PathBuf> = cfg
        .json_keys
        .iter()
        .map(|k| output_prefix_for(&cfg.output_prefix, k))
        .collect();
    let mut builders = prefixes
        .iter()
        .map(|p| IndexedDatasetBuilder::create(p, dtype))
        .collect::<Result<Vec<_>, _>>()?;
    let settings = EncodeSettings {
        tokenizer,
        keys: &cfg.json_keys,
        add_special_tokens: cfg.add_special_tokens,
        eod: cfg.append_eod,
    };
    let mut report = empty_report(dtype, cfg.append_eod);
    run_threads(
        cfg,
        &settings,
        &formats,
        &mut builders,
        &mut report,
        &mut |p: &mut Progress| {
            p.input_bytes_total = input_bytes_total;
            p.elapsed = start.elapsed();
            progress(p)
        },
    )?;
    if is_cancelled(cfg) {
        return Err(PreprocessError::Cancelled);
    }
    commit_outputs(cfg, builders, prefixes, &mut report)?;
    report.elapsed = start.elapsed();
    Ok(report)
}

/// Whether the caller has asked the run to stop.
fn is_cancelled(cfg: &PreprocessConfig) -> bool {
    cfg.cancel
        .as_ref()
        .is_some_and(|c| c.load(Ordering::Relaxed))
}

/// The summed size of the input files, for progress reports.
fn total_input_bytes(inputs: &[PathBuf]) -> Result<u64, PreprocessError> {
    let mut total = 0;
    for p in inputs {
        let meta = std::fs::metadata(p).map_err(|source| PreprocessError::Io {
            path: p.clone(),
            source,
        })?;
        total += meta.len();
    }
    Ok(total)
}

/// A report with nothing counted yet.
fn empty_report(dtype: TokenDtype, eod: Option<u32>) -> PreprocessReport {
    PreprocessReport {
        outputs: Vec::new(),
        dtype,
        eod,
        documents: 0,
        empty_documents: 0,
        tokens: 0,
        bytes_read: 0,
        input_bytes: 0,
        blank_lines: 0,
        skipped: 0,
        skipped_examples: Vec::new(),
        elapsed: Default::default(),
    }
}

/// Runs the reader and worker threads and writes their batches in order on this thread.
fn run_threads(
    cfg: &PreprocessConfig,
    settings: &EncodeSettings,
    formats: &[InputFormat],
    builders: &mut [IndexedDatasetBuilder],
    report: &mut PreprocessReport,
    progress: &mut dyn FnMut(&mut Progress),
) -> Result<(), PreprocessError> {
    let workers = cfg.workers.max(1);
    let in_flight = workers * 4;
    let (batch_tx, batch_rx) = sync_channel::<Batch>(workers * 2);
    let (out_tx, out_rx) = sync_channel::<Result<Encoded, PreprocessError>>(workers * 2);
    let (permit_tx, permit_rx) = sync_channel::<()>(in_flight);
    for _ in 0..in_flight {
        permit_tx.send(()).expect("receiver alive");
    }
    let batch_rx = Arc::new(Mutex::new(batch_rx));

    std::thread::scope(|s| {
        let reader = s.spawn(|| read_inputs(cfg, formats, batch_tx, permit_rx));
        for _ in 0..workers {
            let (rx, tx) = (Arc::clone(&batch_rx), out_tx.clone());
            s.spawn(move || worker(&rx, tx, settings, cfg, formats));
        }
        // Only workers hold the channel ends now: when they stop, the reader's sends fail
        // and the writer's receive loop ends.
        drop(batch_rx);
        drop(out_tx);
        let written = write_in_order(cfg, builders, report, out_rx, permit_tx, progress);
        let read = reader.join().expect("reader thread panicked");
        // A reader error explains a short write; a writer error stops the reader.
        written.and(read)
    })
}

/// The reader: batches every input in order, each batch taking a permit; stops early when
/// cancelled or when the workers are gone.
fn read_inputs(
    cfg: &PreprocessConfig,
    formats: &[InputFormat],
    batch_tx: SyncSender<Batch>,
    permit_rx: Receiver<()>,
) -> Result<(), PreprocessError> {
    let mut emit =
        |b: Batch| !is_cancelled(cfg) && permit_rx.recv().is_ok() && batch_tx.send(b).is_ok();
    let mut seq = 0;
    let mut pos = 0;
    for (i, path) in cfg.inputs.iter().enumerate() {
        pos += read_file(path, i, formats[i], cfg.text_mode, pos, &mut seq, &mut emit)?;
    }
    Ok(())
}

/// Completes every output under temp names, then renames them all, recording each in the report.
fn commit_outputs(
    cfg: &PreprocessConfig,
    builders: Vec<IndexedDatasetBuilder>,
    prefixes: Vec<PathBuf>,
    report: &mut PreprocessReport,
) -> Result<(), PreprocessError> {
    // Two phases: complete every output under temp names, then rename them all.
    let finished = builders
        .into_iter()
        .map(|b| b.finish())
        .collect::<Result<Vec<_>, _>>()?;
    for ((f, key), prefix) in finished.into_iter().zip(&cfg.json_keys).zip(prefixes) {
        let s = f.commit()?;
        report.outputs.push(OutputDataset {
            key: key.clone(),
            prefix,
            documents: s.documents,
            sequences: s.sequences,
            tokens: s.tokens,
        });
    }
    Ok(())
}

/// A worker: takes batches until the reader is done, sends each result to the writer.
fn worker(
    rx: &Mutex<Receiver<Batch>>,
    tx: SyncSender<Result<Encoded, PreprocessError>>,
    settings: &EncodeSettings,
    cfg: &PreprocessConfig,
    formats: &[InputFormat],
) {
    loop {
        let batch = match rx.lock() {
            Ok(rx) => match rx.recv() {
                Ok(b) => b,
                Err(_) => return,
            },
            Err(_) => return,
        };
        let file = batch.file;
        let result = settings.encode_batch(batch, &cfg.inputs[file], formats[file]);
        let failed = result.is_err();
        if tx.send(result).is_err() || failed {
            return;
        }
    }
}

/// Receives encoded batches, writes them in sequence order, returns a permit per batch written.
fn write_in_order(
    cfg: &PreprocessConfig,
    builders: &mut [IndexedDatasetBuilder],
    report: &mut PreprocessReport,
    out_rx: Receiver<Result<Encoded, PreprocessError>>,
    permit_tx: SyncSender<()>,
    progress: &mut dyn FnMut(&mut Progress),
) -> Result<(), PreprocessError> {
    let mut pending = BTreeMap::new();
    let mut next = 0u64;
    let mut prog = Progress::default();
    for result in out_rx {
        let enc = result?;
        pending.insert(enc.seq, enc);
        while let Some(enc) = pending.remove(&next) {
            if is_cancelled(cfg) {
                return Err(PreprocessError::Cancelled);
            }
            write_batch(cfg, builders, report, &enc)?;
            next += 1;
            let _ = permit_tx.send(());
            prog.documents = report.documents;
            prog.tokens = report.tokens;
            prog.bytes = report.bytes_read;
            prog.input_bytes = enc.input_pos;
            prog.skipped = report.skipped;
            progress(&mut prog);
        }
    }
    report.input_bytes = prog.input_bytes;
    Ok(())
}

fn write_batch(
    cfg: &PreprocessConfig,
    builders: &mut [IndexedDatasetBuilder],
    report: &mut PreprocessReport,
    enc: &Encoded,
) -> Result<(), PreprocessError> {
    let path = &cfg.inputs[enc.file];
    if let Some((line, reason)) = enc.bad.first()
        && cfg.strict
    {
        return Err(PreprocessError::BadLine {
            path: path.clone(),
            line: *line,
            reason: reason.clone(),
        });
    }
    for (line, reason) in &enc.bad {
        if report.skipped_examples.len() < MAX_SKIP_EXAMPLES {
            report.skipped_examples.push(SkippedLine {
                path: path.clone(),
                line: *line,
                reason: reason.clone(),
            });
        }
    }
    report.skipped += enc.bad.len() as u64;
    for (b, docs) in builders.iter_mut().zip(&enc.keys) {
        let (mut tok, mut seq) = (0, 0);
        for &n in &docs.doc_sequences {
            let lens = &docs.sequence_lengths[seq..seq + n];
            let len: usize = lens.iter().sum();
            b.add_document(&docs.tokens[tok..tok + len], lens)?;
            report.empty_documents += u64::from(n == 0);
            tok += len;
            seq += n;
        }
    }
    report.documents += enc.documents;
    report.tokens += enc.tokens;
    report.bytes_read += enc.text_bytes;
    report.blank_lines += enc.blank_lines;
    Ok(())
}
