//! Compares the training-loss curves of runs (their `metrics.jsonl`, one line per logged
//! iteration) against the first run: prints every run's loss and its relative difference
//! `(loss − loss_ref) / loss_ref` at evenly spaced iterations, the largest |relative difference|
//! over all common iterations, and draws both curves and the difference into one PNG.
//! Exit code 4 when a run strays beyond `--tolerance` (default 1%), 2 on bad input.
//!
//! `cargo run --release -p ferrotron-train --example compare_losses -- --output cmp.png \
//!  f32=runs/f32/metrics.jsonl bf16=runs/bf16/metrics.jsonl`
//!
//! Used by `scripts/bf16-loss-curves.sh` (bf16 vs f32 training on the KJV Bible).

use anyhow::{Context, Result, bail};
use clap::Parser;
use ferrotron_train::metrics::{FONT, register_font, write_png};
use plotters::prelude::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Compares training-loss curves (metrics.jsonl) against the first run.
#[derive(Parser)]
struct Args {
    /// Runs as LABEL=PATH to a metrics.jsonl; the first is the reference.
    #[arg(required = true, num_args = 2..)]
    runs: Vec<String>,
    /// PNG to draw the curves and their relative difference into.
    #[arg(long)]
    output: PathBuf,
    /// Largest allowed |relative difference| of a run's loss at any iteration.
    #[arg(long, default_value_t = 0.01)]
    tolerance: f64,
    /// Rows of the printed table.
    #[arg(long, default_value_t = 10)]
    rows: usize,
}

/// A run's label and its train loss per iteration.
struct Run {
    label: String,
    loss: BTreeMap<u64, f64>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match compare(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(4),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// Reads the `"kind": "train"` rows' `iteration` and `lm_loss`.
fn read_run(spec: &str) -> Result<Run> {
    let Some((label, path)) = spec.split_once('=') else {
        bail!("run '{spec}': expected LABEL=PATH/metrics.jsonl");
    };
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    let mut loss = BTreeMap::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let row: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{path}:{}: not a JSON object", n + 1))?;
        if row["kind"] != "train" {
            continue;
        }
        let (Some(it), Some(l)) = (row["iteration"].as_u64(), row["lm_loss"].as_f64()) else {
            bail!("{path}:{}: a train row without iteration/lm_loss", n + 1);
        };
        loss.insert(it, l);
    }
    if loss.is_empty() {
        bail!("{path}: no train rows");
    }
    Ok(Run {
        label: label.to_string(),
        loss,
    })
}

/// `(iteration, relative difference)` of `run` against `reference` at common iterations.
fn rel_diff(run: &Run, reference: &Run) -> Vec<(u64, f64)> {
    run.loss
        .iter()
        .filter_map(|(it, l)| reference.loss.get(it).map(|r| (*it, (l - r) / r)))
        .collect()
}

fn compare(args: &Args) -> Result<bool> {
    let runs = args
        .runs
        .iter()
        .map(|s| read_run(s))
        .collect::<Result<Vec<_>>>()?;
    let reference = &runs[0];
    let iters: Vec<u64> = reference.loss.keys().copied().collect();
    let step = iters.len().div_ceil(args.rows.max(1)).max(1);
    print!("{:>9} {:>10}", "iteration", reference.label);
    for r in &runs[1..] {
        print!(" {:>10} {:>9}", r.label, "rel diff");
    }
    println!();
    for it in iters.iter().step_by(step).chain(iters.last()) {
        print!("{it:>9} {:>10.4}", reference.loss[it]);
        for r in &runs[1..] {
            match r.loss.get(it) {
                Some(l) => print!(
                    " {l:>10.4} {:>8.3}%",
                    100.0 * (l - reference.loss[it]) / reference.loss[it]
                ),
                None => print!(" {:>10} {:>9}", "-", "-"),
            }
        }
        println!();
    }
    let mut ok = true;
    for r in &runs[1..] {
        let d = rel_diff(r, reference);
        if d.is_empty() {
            bail!("{} and {} share no iteration", r.label, reference.label);
        }
        let (at, worst) = d
            .iter()
            .copied()
            .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
            .expect("non-empty");
        let mean = d.iter().map(|x| x.1.abs()).sum::<f64>() / d.len() as f64;
        let within = worst.abs() <= args.tolerance;
        ok &= within;
        println!(
            "{} vs {}: {} common iterations, max |rel diff| {:.3}% (iteration {at}), mean {:.3}%: {}",
            r.label,
            reference.label,
            d.len(),
            100.0 * worst.abs(),
            100.0 * mean,
            if within { "within" } else { "BEYOND" },
        );
    }
    draw(&runs, &args.output)?;
    println!("wrote {}", args.output.display());
    Ok(ok)
}

const COLORS: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
];

/// Loss curves (top) and relative differences against the first run in percent (bottom).
fn draw(runs: &[Run], path: &Path) -> Result<()> {
    register_font()?;
    let iters = || runs.iter().flat_map(|r| r.loss.keys().copied());
    let x0 = iters().min().unwrap_or(0);
    let x1 = iters().max().unwrap_or(1).max(x0 + 1);
    let values = || runs.iter().flat_map(|r| r.loss.values().copied());
    let (y0, y1) = (
        values().fold(f64::INFINITY, f64::min),
        values().fold(f64::NEG_INFINITY, f64::max),
    );
    let pad = ((y1 - y0) * 0.05).max(1e-3);
    let diffs: Vec<Vec<(u64, f64)>> = runs[1..]
        .iter()
        .map(|r| {
            rel_diff(r, &runs[0])
                .into_iter()
                .map(|(i, d)| (i, 100.0 * d))
                .collect()
        })
        .collect();
    let dmax = diffs
        .iter()
        .flatten()
        .map(|d| d.1.abs())
        .fold(0.1, f64::max)
        * 1.1;

    let (width, height) = (1000u32, 800u32);
    let mut rgb = vec![0u8; (width * height * 3) as usize];
    let result = (|| -> std::result::Result<(), Box<dyn std::error::Error>> {
        let root = BitMapBackend::with_buffer(&mut rgb, (width, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let (top, bottom) = root.split_vertically(500);
        let mut chart = ChartBuilder::on(&top)
            .margin(20)
            .caption("lm loss", (FONT, 26))
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(x0..x1, y0 - pad..y1 + pad)?;
        chart
            .configure_mesh()
            .y_desc("lm loss (nats)")
            .label_style((FONT, 15))
            .axis_desc_style((FONT, 18))
            .draw()?;
        for (r, color) in runs.iter().zip(COLORS.iter().cycle()) {
            let style = color.stroke_width(2);
            chart
                .draw_series(LineSeries::new(r.loss.iter().map(|(i, l)| (*i, *l)), style))?
                .label(r.label.as_str())
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 24, y)], style));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .label_font((FONT, 17))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
        let mut chart = ChartBuilder::on(&bottom)
            .margin(20)
            .caption(
                format!("relative difference vs {} (%)", runs[0].label),
                (FONT, 22),
            )
            .x_label_area_size(45)
            .y_label_area_size(70)
            .build_cartesian_2d(x0..x1, -dmax..dmax)?;
        chart
            .configure_mesh()
            .x_desc("iteration")
            .y_desc("%")
            .label_style((FONT, 15))
            .axis_desc_style((FONT, 18))
            .draw()?;
        for (d, color) in diffs.iter().zip(COLORS.iter().skip(1).cycle()) {
            chart.draw_series(LineSeries::new(d.iter().copied(), color.stroke_width(2)))?;
        }
        root.present()?;
        Ok(())
    })();
    result.map_err(|e| anyhow::anyhow!("drawing {}: {e}", path.display()))?;
    Ok(write_png(path, (width, height), &rgb)?)
}
