//! [`TensorBoardWriter`]: scalar TensorBoard event files of a training run, with the tags
//! Megatron-LM writes (`training_log` and `evaluate_and_print_results` in
//! `megatron/training/training.py`, through `torch.utils.tensorboard.SummaryWriter`).

use super::event::{Event, EventData, Scalar};
use super::tfrecord::{read_records, write_record};
use crate::trainer::TrainLog;
use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// The `file_version` of the first record, as TensorFlow and PyTorch write it.
pub const FILE_VERSION: &str = "brain.Event:2";

/// Appends `tensorflow.Event` records to one event file, flushing after each
/// [`write_scalars`](Self::write_scalars) / [`record`](Self::record) call.
///
/// Mirrors `torch.utils.tensorboard.SummaryWriter.add_scalar`: one event per scalar, with
/// `simple_value` and the given step.
#[derive(Debug)]
pub struct TensorBoardWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl TensorBoardWriter {
    /// Creates `dir` if needed and a new event file in it named
    /// `events.out.tfevents.<unix seconds, 10 digits>.<hostname>` (TensorFlow's name; the
    /// hostname falls back to `localhost` when it cannot be read), or, when that file exists
    /// (two writers in one second), the same name followed by `.<pid>.<n>`.
    ///
    /// # Errors
    /// As [`create_file`](Self::create_file); creating `dir` fails with its path named.
    pub fn create(dir: impl AsRef<Path>) -> io::Result<TensorBoardWriter> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|e| with_path(e, "creating", dir))?;
        let host = gethostname::gethostname().to_string_lossy().into_owned();
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let name = event_file_name(secs, &host);
        // A second writer in the same second (a resumed run) gets the name with the pid and a
        // counter appended, as torch's SummaryWriter names its files.
        let mut last = None;
        for n in 0..1000u32 {
            let file = if n == 0 {
                name.clone()
            } else {
                format!("{name}.{}.{n}", std::process::id())
            };
            match TensorBoardWriter::create_file(dir.join(file)) {
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
                other => return other,
            }
        }
        Err(last.expect("1000 attempts"))
    }

    /// Creates the event file `path` (which must not exist yet: an earlier run's file is never
    /// overwritten) and writes the `file_version` record.
    ///
    /// # Errors
    /// The I/O error with `path` in its message (e.g. [`io::ErrorKind::AlreadyExists`]).
    pub fn create_file(path: impl Into<PathBuf>) -> io::Result<TensorBoardWriter> {
        let path = path.into();
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| with_path(e, "creating", &path))?;
        let mut writer = TensorBoardWriter {
            path,
            out: BufWriter::new(file),
        };
        let version = Event {
            wall_time: unix_time(),
            step: 0,
            data: EventData::FileVersion(FILE_VERSION.into()),
        };
        writer.write_events(&[version])?;
        Ok(writer)
    }

    /// The event file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes the Megatron scalars of one training or validation report (see
    /// [`megatron_scalars`]) at `step = iteration`, then flushes; other reports (checkpoint
    /// saves) write nothing, as in Megatron.
    ///
    /// # Errors
    /// As [`write_scalars`](Self::write_scalars).
    pub fn record(&mut self, log: &TrainLog) -> io::Result<()> {
        match megatron_scalars(log) {
            Some((step, scalars)) => self.write_scalars(step, &scalars),
            None => Ok(()),
        }
    }

    /// Writes one scalar event per `(tag, value)` at `step` (values are stored as `f32`, as
    /// TensorBoard's `simple_value`), then flushes so that a crash loses nothing written.
    ///
    /// # Errors
    /// [`io::ErrorKind::InvalidInput`] if `step` exceeds `i64::MAX` (the protobuf `int64`);
    /// a write error with the file's path in its message.
    pub fn write_scalars(&mut self, step: u64, scalars: &[(&str, f64)]) -> io::Result<()> {
        let step = i64::try_from(step).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{}: step {step} exceeds int64", self.path.display()),
            )
        })?;
        let wall_time = unix_time();
        let events: Vec<Event> = scalars
            .iter()
            .map(|&(tag, value)| Event {
                wall_time,
                step,
                data: EventData::Summary(vec![Scalar {
                    tag: tag.to_string(),
                    value: value as f32,
                }]),
            })
            .collect();
        self.write_events(&events)
    }

    fn write_events(&mut self, events: &[Event]) -> io::Result<()> {
        let written: io::Result<()> = events
            .iter()
            .try_for_each(|e| write_record(&mut self.out, &e.encode()))
            .and_then(|()| self.out.flush());
        written.map_err(|e| with_path(e, "writing", &self.path))
    }
}

/// The step and the tags and values Megatron writes to TensorBoard for one report; `None`
/// for reports without scalars (checkpoint saves).
///
/// | report | tag | value |
/// |---|---|---|
/// | train | `lm loss` | [`LogLine::lm_loss`](crate::trainer::LogLine::lm_loss), nats |
/// | train | `learning-rate` | learning rate |
/// | train | `grad-norm` | gradient norm (when computed) |
/// | train | `loss-scale` | fp16 loss scale (fp16 only) |
/// | train | `load_balancing_loss`, `z_loss` | MoE balancing losses over their coefficients (MoE models) |
/// | train | `iteration-time` | seconds per iteration (Megatron's `elapsed_time_per_iteration`) |
/// | train | `throughput` | input tokens per second (Megatron's own `throughput` is TFLOP/s/GPU) |
/// | valid | `lm loss validation` | validation loss, nats |
/// | valid | `lm loss validation ppl` | `exp(min(20, loss))` |
pub fn megatron_scalars(log: &TrainLog) -> Option<(u64, Vec<(&'static str, f64)>)> {
    match log {
        TrainLog::Train(l) => {
            let mut s = vec![("lm loss", l.lm_loss), ("learning-rate", l.learning_rate)];
            if let Some(g) = l.grad_norm {
                s.push(("grad-norm", g));
            }
            if let Some(scale) = l.loss_scale {
                s.push(("loss-scale", f64::from(scale)));
            }
            s.extend(l.moe.iter().flat_map(|m| m.scalars()));
            s.push(("iteration-time", l.elapsed_ms_per_iteration / 1000.0));
            s.push(("throughput", l.tokens_per_second));
            Some((l.iteration, s))
        }
        TrainLog::Valid(v) => Some((
            v.iteration,
            vec![
                ("lm loss validation", v.lm_loss),
                ("lm loss validation ppl", v.ppl),
            ],
        )),
        TrainLog::Saved(_) => None,
    }
}

/// TensorFlow's event file name: `events.out.tfevents.{secs:010}.{host}`.
pub fn event_file_name(unix_secs: u64, host: &str) -> String {
    let host = if host.is_empty() { "localhost" } else { host };
    format!("events.out.tfevents.{unix_secs:010}.{host}")
}

/// Reads a whole event file back: every record's framing and CRCs are checked and every
/// payload decoded as an [`Event`].
///
/// # Errors
/// The read error, a framing/CRC error or a protobuf error, each with `path` in the message.
pub fn read_event_file(path: impl AsRef<Path>) -> io::Result<Vec<Event>> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| with_path(e, "reading", path))?;
    read_records(&bytes)
        .and_then(|records| records.into_iter().map(Event::decode).collect())
        .map_err(|e| with_path(e, "reading", path))
}

fn unix_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

fn with_path(e: io::Error, doing: &str, path: &Path) -> io::Error {
    io::Error::new(e.kind(), format!("{doing} {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trainer::{EvalLine, LogLine};

    fn line(iteration: u64, lm_loss: f64) -> LogLine {
        LogLine {
            iteration,
            train_iters: 100,
            consumed_samples: iteration * 8,
            elapsed_ms_per_iteration: 250.0,
            tflops: 1.5,
            tokens_per_second: 4096.0,
            learning_rate: 3e-4,
            global_batch_size: 8,
            lm_loss,
            loss_scale: None,
            grad_norm: Some(1.25),
            skipped_iterations: 0,
            nan_iterations: 0,
            comm_wait_ms: 0.0,
            model_state_bytes: 0,
            peak_rss_bytes: None,
            dpo: None,
            moe: None,
            offload: None,
        }
    }

    fn scalars(e: &Event) -> (i64, Vec<(String, f32)>) {
        match &e.data {
            EventData::Summary(v) => (e.step, v.iter().map(|s| (s.tag.clone(), s.value)).collect()),
            EventData::FileVersion(v) => panic!("unexpected file_version {v}"),
        }
    }

    #[test]
    fn writers_in_the_same_second_get_distinct_files() {
        let dir = tempfile::tempdir().unwrap();
        let writers: Vec<_> = (0..3)
            .map(|_| TensorBoardWriter::create(dir.path()).unwrap())
            .collect();
        let mut names: Vec<_> = writers.iter().map(|w| w.path().to_path_buf()).collect();
        names.dedup();
        assert_eq!(names.len(), 3, "{names:?}");
    }

    #[test]
    fn writes_megatron_tags_and_reads_them_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = TensorBoardWriter::create(dir.path().join("tb")).unwrap();
        let name = w.path().file_name().unwrap().to_str().unwrap().to_string();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        assert_eq!(name.split('.').nth(3).unwrap().len(), 10, "{name}");

        w.record(&TrainLog::Train(line(10, 3.5))).unwrap();
        // Flushed: the file on disk already holds the interval.
        assert_eq!(read_event_file(w.path()).unwrap().len(), 1 + 5);
        let fp16 = LogLine {
            loss_scale: Some(65536.0),
            grad_norm: None,
            ..line(20, f64::NAN)
        };
        w.record(&TrainLog::Train(fp16)).unwrap();
        w.record(&TrainLog::Valid(EvalLine::new(20, 2.0))).unwrap();

        let events = read_event_file(w.path()).unwrap();
        assert_eq!(events.len(), 1 + 5 + 5 + 2);
        assert_eq!(
            events[0].data,
            EventData::FileVersion("brain.Event:2".into())
        );
        assert!(events[0].wall_time > 1.6e9, "{}", events[0].wall_time);
        let s: Vec<_> = events[1..].iter().map(scalars).collect();
        let tags: Vec<&str> = s.iter().map(|(_, v)| v[0].0.as_str()).collect();
        assert_eq!(
            tags,
            [
                "lm loss",
                "learning-rate",
                "grad-norm",
                "iteration-time",
                "throughput",
                "lm loss",
                "learning-rate",
                "loss-scale",
                "iteration-time",
                "throughput",
                "lm loss validation",
                "lm loss validation ppl",
            ]
        );
        let steps: Vec<i64> = s.iter().map(|(step, _)| *step).collect();
        assert_eq!(steps, [10, 10, 10, 10, 10, 20, 20, 20, 20, 20, 20, 20]);
        let values: Vec<f32> = s.iter().map(|(_, v)| v[0].1).collect();
        assert_eq!(&values[..5], &[3.5, 3e-4, 1.25, 0.25, 4096.0]);
        assert!(values[5].is_nan());
        assert_eq!(values[7], 65536.0);
        assert_eq!(values[10], 2.0);
        assert!((values[11] - 2f32.exp()).abs() < 1e-5);
    }

    /// Two records from TensorBoard's own writer (`tensorboard.summary.writer.record_writer.
    /// RecordWriter`, tensorboard 2.21.0): `Event(wall_time=1700000000.5,
    /// file_version="brain.Event:2")` then `Event(wall_time=1700000001.25, step=10, summary=
    /// Summary(value=[Summary.Value(tag="lm loss", simple_value=3.21)]))`.
    const TENSORBOARD_RECORDS: &str = "1800000000000000a37f4b220900002040fc54d9411a0d627261696e\
        2e4576656e743a322b3531101d00000000000000602fdf230900005040fc54d941100a2a100a0e0a076c6d\
        206c6f737315a4704d40ae2e2dd3";

    #[test]
    fn records_are_byte_identical_to_tensorboard() {
        let events = [
            Event {
                wall_time: 1_700_000_000.5,
                step: 0,
                data: EventData::FileVersion(FILE_VERSION.into()),
            },
            Event {
                wall_time: 1_700_000_001.25,
                step: 10,
                data: EventData::Summary(vec![Scalar {
                    tag: "lm loss".into(),
                    value: 3.21,
                }]),
            },
        ];
        let mut ours = Vec::new();
        for e in &events {
            write_record(&mut ours, &e.encode()).unwrap();
        }
        let hex: String = ours.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, TENSORBOARD_RECORDS);
        let back: Vec<Event> = read_records(&ours)
            .unwrap()
            .into_iter()
            .map(|r| Event::decode(r).unwrap())
            .collect();
        assert_eq!(back, events);
    }

    #[test]
    fn errors_name_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(event_file_name(1_700_000_000, "host"));
        assert!(path.ends_with("events.out.tfevents.1700000000.host"));
        TensorBoardWriter::create_file(&path).unwrap();
        let err = TensorBoardWriter::create_file(&path).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AlreadyExists);
        assert!(err.to_string().contains(&*path.to_string_lossy()), "{err}");

        let mut w = TensorBoardWriter::create_file(dir.path().join("e")).unwrap();
        let err = w.write_scalars(u64::MAX, &[("x", 1.0)]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert!(err.to_string().contains("exceeds int64"), "{err}");

        std::fs::write(dir.path().join("bad"), b"0123456789abcdef").unwrap();
        let err = read_event_file(dir.path().join("bad"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("bad") && err.contains("length CRC mismatch"),
            "{err}"
        );
        assert_eq!(
            event_file_name(5, ""),
            "events.out.tfevents.0000000005.localhost"
        );
    }
}
