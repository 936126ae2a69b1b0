//! Times one optimizer step (clip + AdamW + master -> params) on a flat buffer.
//!
//! `cargo run --release -p ferrotron-optim --example step_bench -- [million_params] [bf16|fp32|fp16]`
//! Default: 135 M params (SmolLM2-135M), bf16. Prints the median of 5 steps and GB/s moved.

use std::time::Instant;

use ferrotron_optim::*;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let millions: usize = args
        .get(1)
        .map_or(135, |s| s.parse().expect("million params"));
    let precision = Precision::parse(args.get(2).map_or("bf16", String::as_str))
        .expect("precision: bf16, fp32 or fp16");
    let n = millions * 1_000_000;
    let mut b = ParamAndGradBufferBuilder::new(BufferConfig::new(precision.param_dtype(), 1));
    let per = 1_000_000;
    for i in 0..n / per {
        b.register_auto(&format!("p{i}.weight"), &[1000, per / 1000])?;
    }
    let mut buf = b.build()?;
    for (i, g) in buf.grads_mut().iter_mut().enumerate() {
        *g = ((i % 101) as f32 - 50.0) * 1e-4;
    }
    let mut opt = Optimizer::new(OptimizerConfig::new(precision), &buf)?;
    let mut times = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        opt.step(&mut buf, 1e-4, 0.1)?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let med = times[2];
    let p_bytes = precision.param_dtype().size_in_bytes();
    // grad read (norm) + grad read/write (clip may scale) + AdamW: g, m, v, master r/w, p w.
    let adam_bytes = n * (4 + 8 + 8 + if p_bytes == 4 { 8 } else { 8 + p_bytes });
    println!(
        "{millions}M params {precision:?}: step median {:.1} ms (min {:.1}), AdamW traffic ~{:.1} GB/s",
        med * 1e3,
        times[0] * 1e3,
        (adam_bytes + n * 4) as f64 / med / 1e9
    );
    Ok(())
}
