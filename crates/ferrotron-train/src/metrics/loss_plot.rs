//! [`LossPlot`]: the run's loss curve as a PNG (train loss line, validation loss markers),
//! redrawn after every report. Drawn with `plotters` into an RGB buffer and encoded with
//! `png`; text uses an embedded font (Ubuntu Light from `epaint_default_fonts`) through
//! plotters' `ab_glyph` backend, so no system font or fontconfig is needed.

use crate::trainer::TrainLog;
use plotters::prelude::*;
use plotters::style::FontStyle;
use std::ffi::OsString;
use std::fs::File;
use std::io::{self, BufWriter};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The font family name the embedded font is registered under (plotters' default family);
/// usable in any plotters chart once [`register_font`] succeeded.
pub const FONT: &str = "sans-serif";
const TRAIN_COLOR: RGBColor = RGBColor(31, 119, 180);
const VALID_COLOR: RGBColor = RGBColor(214, 39, 40);

/// Loss points of a run and the PNG they are drawn into.
#[derive(Clone, Debug)]
pub struct LossPlot {
    path: PathBuf,
    width: u32,
    height: u32,
    train: Vec<(u64, f64)>,
    valid: Vec<(u64, f64)>,
}

impl LossPlot {
    /// Default image size in pixels (width, height).
    pub const DEFAULT_SIZE: (u32, u32) = (1000, 600);

    /// A plot drawn to `path` (e.g. `<save>/loss.png`) at [`DEFAULT_SIZE`](Self::DEFAULT_SIZE).
    /// Nothing is written until the first point arrives.
    pub fn new(path: impl Into<PathBuf>) -> LossPlot {
        let (width, height) = LossPlot::DEFAULT_SIZE;
        LossPlot {
            path: path.into(),
            width,
            height,
            train: Vec::new(),
            valid: Vec::new(),
        }
    }

    /// The same plot at `width` x `height` pixels.
    ///
    /// # Errors
    /// [`io::ErrorKind::InvalidInput`] unless both sides are in `200..=8192`.
    pub fn with_size(mut self, width: u32, height: u32) -> io::Result<LossPlot> {
        for (name, v) in [("width", width), ("height", height)] {
            if !(200..=8192).contains(&v) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("loss plot {name} {v} is outside 200..=8192 pixels"),
                ));
            }
        }
        (self.width, self.height) = (width, height);
        Ok(self)
    }

    /// The PNG path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// (iteration, train loss in nats) points so far.
    pub fn train_points(&self) -> &[(u64, f64)] {
        &self.train
    }

    /// (iteration, validation loss in nats) points so far.
    pub fn valid_points(&self) -> &[(u64, f64)] {
        &self.valid
    }

    /// Adds the loss point of a training or validation report; returns whether one was
    /// added. A non-finite loss (e.g. an interval of NaN iterations) cannot be drawn and is
    /// left out; other reports (checkpoint saves) have no loss.
    pub fn push(&mut self, log: &TrainLog) -> bool {
        let (points, point) = match log {
            TrainLog::Train(l) => (&mut self.train, (l.iteration, l.lm_loss)),
            TrainLog::Valid(v) => (&mut self.valid, (v.iteration, v.lm_loss)),
            TrainLog::Saved(_) => return false,
        };
        let finite = point.1.is_finite();
        if finite {
            points.push(point);
        }
        finite
    }

    /// [`push`](Self::push)es the report's point and, if one was added, redraws the PNG.
    ///
    /// # Errors
    /// As [`draw`](Self::draw).
    pub fn record(&mut self, log: &TrainLog) -> io::Result<()> {
        if self.push(log) { self.draw() } else { Ok(()) }
    }

    /// Redraws the PNG from all points: written to `<path>.tmp`, then renamed over `path`, so
    /// a reader never sees a partial image. With no point yet nothing is written.
    ///
    /// # Errors
    /// A drawing, encoding, write or rename error with the path in its message.
    pub fn draw(&self) -> io::Result<()> {
        let Some((xs, ys)) = self.ranges() else {
            return Ok(());
        };
        register_font()?;
        let mut rgb = vec![0u8; self.width as usize * self.height as usize * 3];
        self.render(&mut rgb, xs, ys)
            .map_err(|e| io::Error::other(format!("drawing {}: {e}", self.path.display())))?;
        write_png(&self.path, (self.width, self.height), &rgb)
    }

    /// Axis ranges covering all points with a margin; `None` without points.
    fn ranges(&self) -> Option<(Range<u64>, Range<f64>)> {
        let all = || self.train.iter().chain(&self.valid);
        let x_lo = all().map(|p| p.0).min()?;
        let x_hi = all().map(|p| p.0).max()?;
        let y_lo = all().map(|p| p.1).fold(f64::INFINITY, f64::min);
        let y_hi = all().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
        let pad = ((y_hi - y_lo) * 0.05).max(y_hi.abs().max(1.0) * 1e-3);
        let xs = if x_lo == x_hi {
            x_lo.saturating_sub(1)..x_hi + 1
        } else {
            x_lo..x_hi
        };
        Some((xs, y_lo - pad..y_hi + pad))
    }

    fn render(
        &self,
        rgb: &mut [u8],
        xs: Range<u64>,
        ys: Range<f64>,
    ) -> Result<(), Box<dyn std::error::Error>> {
        // Enough decimals to tell the ~10 y ticks apart.
        let decimals = (1.0 - (ys.end - ys.start).log10().floor()).clamp(1.0, 6.0) as usize;
        let root = BitMapBackend::with_buffer(rgb, (self.width, self.height)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(20)
            .margin_right(45) // room for the last x label, centred on the right edge
            .caption("lm loss", (FONT, 28))
            .x_label_area_size(50)
            .y_label_area_size(80)
            .build_cartesian_2d(xs, ys)?;
        chart
            .configure_mesh()
            .x_desc("iteration")
            .y_desc("lm loss (nats)")
            .label_style((FONT, 16))
            .axis_desc_style((FONT, 20))
            .y_label_formatter(&|y| format!("{y:.decimals$}"))
            .draw()?;

        let train_style = TRAIN_COLOR.stroke_width(2);
        let train = chart.draw_series(LineSeries::new(self.train.iter().copied(), train_style))?;
        if !self.train.is_empty() {
            train
                .label("train")
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 24, y)], train_style));
        }
        let valid_style = VALID_COLOR.stroke_width(2);
        let radius = if self.valid.len() > 50 { 3 } else { 5 };
        chart.draw_series(LineSeries::new(self.valid.iter().copied(), valid_style))?;
        let valid = chart.draw_series(
            self.valid
                .iter()
                .map(|&p| Circle::new(p, radius, VALID_COLOR.filled())),
        )?;
        if !self.valid.is_empty() {
            valid.label("validation").legend(move |(x, y)| {
                EmptyElement::at((x, y))
                    + PathElement::new([(0, 0), (24, 0)], valid_style)
                    + Circle::new((12, 0), 5, VALID_COLOR.filled())
            });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .label_font((FONT, 18))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    }
}

/// Writes an RGB image (`width × height`, 3 bytes per pixel, row-major) as a PNG at `path`:
/// encoded into `<path>.tmp`, then renamed over `path`, so a reader never sees a partial image
/// (the temporary file is removed on failure).
///
/// # Errors
/// An encoding, write or rename error with the path in its message.
pub fn write_png(path: &Path, (width, height): (u32, u32), rgb: &[u8]) -> io::Result<()> {
    let mut tmp = OsString::from(path.as_os_str());
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let encode = || -> io::Result<()> {
        let file = File::create(&tmp)?;
        let mut encoder = png::Encoder::new(BufWriter::new(file), width, height);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder.write_header().map_err(io::Error::other)?;
        writer.write_image_data(rgb).map_err(io::Error::other)?;
        writer.finish().map_err(io::Error::other)
    };
    encode()
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io::Error::new(e.kind(), format!("writing {}: {e}", path.display()))
        })
}

/// Registers the embedded font with plotters (as [`FONT`]) once per process.
///
/// # Errors
/// When the embedded font does not parse.
pub fn register_font() -> io::Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, epaint_default_fonts::UBUNTU_LIGHT)
            .is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err(io::Error::other(
            "the embedded Ubuntu Light font does not parse",
        ))
    }
}
