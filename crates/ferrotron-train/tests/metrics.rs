//! The metrics sinks on a simulated run: a TensorBoard event file read back record by record,
//! and the loss PNG decoded after each redraw.
//!
//! With `FERROTRON_METRICS_OUT=<dir>` the files are kept in `<dir>/tensorboard` and
//! `<dir>/loss.png` (for `tools/check_tfevents.py` and for looking at the plot).

use ferrotron_train::metrics::{EventData, LossPlot, TensorBoardWriter, read_event_file};
use ferrotron_train::trainer::{EvalLine, LogLine, TrainLog};
use std::path::{Path, PathBuf};

/// A run of 40 iterations: a train report every 5, a validation every 10; the loss decays
/// from about 6 towards 3 nats.
fn simulated_run() -> Vec<TrainLog> {
    let loss = |it: u64| 3.0 + 3.0 * (-(it as f64) / 12.0).exp();
    let mut logs = Vec::new();
    for it in (5..=40).step_by(5) {
        logs.push(TrainLog::Train(LogLine {
            iteration: it,
            train_iters: 40,
            consumed_samples: it * 8,
            elapsed_ms_per_iteration: 800.0 + it as f64,
            tflops: 2.0,
            tokens_per_second: 10_240.0,
            learning_rate: 3e-4 * it as f64 / 40.0,
            global_batch_size: 8,
            lm_loss: loss(it),
            loss_scale: None,
            grad_norm: Some(1.0 / it as f64),
            skipped_iterations: 0,
            nan_iterations: 0,
            comm_wait_ms: 0.0,
            model_state_bytes: 0,
            peak_rss_bytes: None,
            dpo: None,
            moe: None,
            offload: None,
        }));
        if it % 10 == 0 {
            logs.push(TrainLog::Valid(EvalLine::new(it, loss(it) + 0.1)));
        }
    }
    logs
}

/// The kept output directory, or a temporary one.
fn out_dir() -> (PathBuf, Option<tempfile::TempDir>) {
    match std::env::var_os("FERROTRON_METRICS_OUT") {
        Some(dir) => (PathBuf::from(dir), None),
        None => {
            let tmp = tempfile::tempdir().unwrap();
            (tmp.path().to_path_buf(), Some(tmp))
        }
    }
}

#[test]
fn tensorboard_event_file_of_a_run() {
    let (dir, _keep) = out_dir();
    let tb_dir = dir.join("tensorboard");
    let _ = std::fs::remove_dir_all(&tb_dir);
    let mut tb = TensorBoardWriter::create(&tb_dir).unwrap();
    let logs = simulated_run();
    for log in &logs {
        tb.record(log).unwrap();
    }
    let events = read_event_file(tb.path()).unwrap();
    assert_eq!(
        events[0].data,
        EventData::FileVersion("brain.Event:2".into())
    );
    let mut lm_loss = Vec::new();
    let mut valid = Vec::new();
    for e in &events[1..] {
        let EventData::Summary(values) = &e.data else {
            panic!("second file_version event at step {}", e.step);
        };
        assert_eq!(values.len(), 1);
        match values[0].tag.as_str() {
            "lm loss" => lm_loss.push((e.step, values[0].value)),
            "lm loss validation" => valid.push((e.step, values[0].value)),
            _ => {}
        }
    }
    // 8 train reports with 5 scalars each, 4 validations with 2.
    assert_eq!(events.len(), 1 + 8 * 5 + 4 * 2);
    let steps: Vec<i64> = lm_loss.iter().map(|p| p.0).collect();
    assert_eq!(steps, [5, 10, 15, 20, 25, 30, 35, 40]);
    let TrainLog::Train(first) = &logs[0] else {
        unreachable!()
    };
    assert_eq!(lm_loss[0].1, first.lm_loss as f32);
    assert_eq!(
        valid.iter().map(|p| p.0).collect::<Vec<_>>(),
        [10, 20, 30, 40]
    );
}

/// Decodes a PNG: (width, height, RGB bytes).
fn decode_png(path: &Path) -> (u32, u32, Vec<u8>) {
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(path).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!(info.color_type, png::ColorType::Rgb);
    buf.truncate(info.buffer_size());
    (info.width, info.height, buf)
}

/// Pixels close to `rgb` (within 40 per channel).
fn count_color(pixels: &[u8], rgb: [u8; 3]) -> usize {
    pixels
        .chunks_exact(3)
        .filter(|p| (0..3).all(|c| p[c].abs_diff(rgb[c]) <= 40))
        .count()
}

#[test]
fn loss_plot_is_written_and_redrawn() {
    let (dir, _keep) = out_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("loss.png");
    let _ = std::fs::remove_file(&path);
    let mut plot = LossPlot::new(&path);
    let logs = simulated_run();

    // Nothing to draw yet: no file; a NaN loss is no point.
    plot.draw().unwrap();
    assert!(!path.exists());
    let TrainLog::Train(first) = &logs[0] else {
        unreachable!()
    };
    let nan = LogLine {
        lm_loss: f64::NAN,
        ..first.clone()
    };
    plot.record(&TrainLog::Train(nan)).unwrap();
    assert!(!path.exists());

    plot.record(&logs[0]).unwrap();
    let (w, h, one_point) = decode_png(&path);
    assert_eq!((w, h), LossPlot::DEFAULT_SIZE);
    let blue = [31, 119, 180];
    let red = [214, 39, 40];
    assert!(
        count_color(&one_point, blue) > 0,
        "train legend/line missing"
    );

    let (first_half, second_half) = logs.split_at(logs.len() / 2);
    for log in &first_half[1..] {
        plot.record(log).unwrap();
    }
    let (_, _, half) = decode_png(&path);
    for log in second_half {
        plot.record(log).unwrap();
    }
    let (_, _, full) = decode_png(&path);
    assert_eq!(
        (plot.train_points().len(), plot.valid_points().len()),
        (8, 4)
    );
    assert!(!dir.join("loss.png.tmp").exists());

    // Redrawn with more points: more train-line pixels, the validation markers appear.
    assert!(count_color(&full, blue) > count_color(&half, blue));
    assert!(count_color(&full, red) > count_color(&one_point, red) + 200);
    assert_ne!(half, full);
    // Mostly white background with dark text and axes.
    let white = count_color(&full, [255, 255, 255]);
    assert!(white > full.len() / 3 * 8 / 10, "{white}");
    assert!(count_color(&full, [0, 0, 0]) > 1000);
}

#[test]
fn loss_plot_errors_name_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("missing-dir").join("loss.png");
    let mut plot = LossPlot::new(&path).with_size(400, 300).unwrap();
    let err = plot.record(&simulated_run()[0]).unwrap_err().to_string();
    assert!(err.contains(&*path.to_string_lossy()), "{err}");
    let err = LossPlot::new(&path)
        .with_size(10, 300)
        .unwrap_err()
        .to_string();
    assert!(err.contains("width 10"), "{err}");
}
