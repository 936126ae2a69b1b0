//! GEMM and decode-GEMV throughput, 1 and 2 threads (see BENCHMARKS.md, section "GEMM").
//!
//! A plain `main` (no criterion harness): every case is warmed up, then timed repeatedly for a
//! fixed time budget, and the median and best of the samples are printed as one compact table.
//! `tools/bench_gemm_torch.py` runs the same cases with PyTorch and prints the same table
//! (`--compare FILE` joins it with this bench's output and adds the ratio).
//!
//! ```text
//! cargo bench -p ferrotron-tensor --bench gemm [-- FILTER]
//! ```
//! `FILTER` keeps the cases whose name contains it (e.g. `gemm/f32_fwd`, `/t2`).
//! `FERROTRON_BENCH_CASE_MS` sets the time budget per case (default 1500 ms).
//!
//! GEMM cases (GF/s = 2·m·n·k / time), for a linear layer `y[m, n] = x[m, k] · W[n, k]ᵀ`:
//! - `f32_fwd`: `sgemm(x, N, W, T)` (the forward);
//! - `f32_dx`:  `dX[m, k] = dY[m, n] · W[n, k]` (`sgemm(dY, N, W, N)`);
//! - `f32_dw`:  `dW[n, k] = dY[m, n]ᵀ · X[m, k]` (`sgemm(dY, T, X, N)`);
//! - `bf16_fwd`: `matmul_weight_t` with `WeightRef::BF16` (bf16 weights widened to f32 in
//!   blocks, then f32 GEMM);
//! - `{kernel}_{fwd,dx,dw}`: the same three products as bf16 GEMMs (f32 activations rounded
//!   to bf16, bf16 weights, f32 results) on every `Bf16Kernel` this machine runs
//!   (`amx-bf16`, `avx512-bf16`, `f32-widened`).
//!
//! `peak/{f32-fma-*,bf16-dot-avx512,bf16-amx}/t{1,2}`: the machine's measured peaks
//! ([`ferrotron_tensor::peak`], best of 5 rounds of register-only multiply-adds).
//!
//! GEMV cases (GB/s of weight bytes read, `y[n] = W[n, k] · x[k]`): each call reads the next of
//! several copies of `W` (at least 96 MiB in all, three times the 32 MiB L3), so the weights
//! stream from DRAM as they do in decode, where a whole model's layers do not fit in cache.

use ferrotron_tensor::gemm::{Op, WeightRef, matmul_weight_t, sgemm};
use ferrotron_tensor::gemm_bf16::{Bf16Kernel, Operand, bf16_gemm_with};
use ferrotron_tensor::gemv::gemv;
use ferrotron_tensor::peak::bf16_dot;
use half::bf16;
use std::hint::black_box;
use std::time::{Duration, Instant};

/// (m, n, k): tokens x out-features x in-features of SmolLM2's projections at 2048 tokens.
const GEMM_SHAPES: [(usize, usize, usize); 3] =
    [(2048, 576, 1536), (2048, 1536, 576), (1024, 1024, 1024)];
/// Weights `[n, k]` read per decoded token: MLP down/up projections and the LM head.
const GEMV_SHAPES: [(usize, usize); 3] = [(1536, 576), (576, 1536), (49152, 576)];
const THREADS: [usize; 2] = [1, 2];
/// The weight copies of one GEMV case cover at least this many bytes.
const GEMV_STREAM_BYTES: usize = 96 << 20;

/// Deterministic values in [-1, 1).
fn data(len: usize, seed: u32) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let h = (i as u32)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(seed.wrapping_mul(40_503));
            (h >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        })
        .collect()
}

struct Stats {
    median_s: f64,
    best_s: f64,
    samples: usize,
}

/// Times `f`: warm up (at least 3 calls and 100 ms), then take samples of `inner` calls each
/// (`inner` chosen so a sample lasts >= 2 ms) until the budget is spent (at least 5 samples,
/// at most 200). Returns per-call seconds.
fn time_case(budget: Duration, mut f: impl FnMut()) -> Stats {
    let t0 = Instant::now();
    let mut calls = 0u32;
    while calls < 3 || t0.elapsed() < Duration::from_millis(100) {
        f();
        calls += 1;
    }
    let per_call = t0.elapsed().as_secs_f64() / f64::from(calls);
    let inner = ((2e-3 / per_call).ceil() as usize).max(1);
    let mut samples = Vec::new();
    let start = Instant::now();
    while samples.len() < 5 || (start.elapsed() < budget && samples.len() < 200) {
        let t = Instant::now();
        for _ in 0..inner {
            f();
        }
        samples.push(t.elapsed().as_secs_f64() / inner as f64);
    }
    samples.sort_by(f64::total_cmp);
    Stats {
        median_s: samples[samples.len() / 2],
        best_s: samples[0],
        samples: samples.len(),
    }
}

struct Row {
    case: String,
    median: f64,
    best: f64,
    unit: &'static str,
    samples: usize,
}

struct Bench {
    filter: Option<String>,
    budget: Duration,
    rows: Vec<Row>,
}

impl Bench {
    fn wants(&self, case: &str) -> bool {
        self.filter
            .as_ref()
            .is_none_or(|f| case.contains(f.as_str()))
    }

    /// Runs one case on `pool`; `work` is FLOPs or bytes per call.
    fn run(
        &mut self,
        pool: &rayon::ThreadPool,
        case: String,
        work: f64,
        unit: &'static str,
        f: impl FnMut() + Send,
    ) {
        let budget = self.budget;
        let s = pool.install(|| time_case(budget, f));
        let row = Row {
            median: work / s.median_s / 1e9,
            best: work / s.best_s / 1e9,
            case,
            unit,
            samples: s.samples,
        };
        eprintln!(
            "{:<34} {:>8.1} {:>8.1}  {}  ({} samples)",
            row.case, row.median, row.best, row.unit, row.samples
        );
        self.rows.push(row);
    }
}

fn gemm_cases(bench: &mut Bench, pool: &rayon::ThreadPool, t: usize) {
    for (m, n, k) in GEMM_SHAPES {
        let name = |op: &str| format!("gemm/{op}/{m}x{n}x{k}/t{t}");
        let flops = 2.0 * (m * n * k) as f64;
        let x = data(m * k, 1); // [m, k]
        let w = data(n * k, 2); // [n, k]
        let dy = data(m * n, 3); // [m, n]
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let mut y = vec![0f32; m * n]; // [m, n]
        let mut dx = vec![0f32; m * k]; // [m, k]
        let mut dw = vec![0f32; n * k]; // [n, k]

        let case = name("f32_fwd");
        if bench.wants(&case) {
            bench.run(pool, case, flops, "GF/s", || {
                sgemm(m, n, k, &x, Op::N, &w, Op::T, &mut y, false);
                black_box(&mut y);
            });
        }
        let case = name("f32_dx");
        if bench.wants(&case) {
            bench.run(pool, case, flops, "GF/s", || {
                sgemm(m, k, n, &dy, Op::N, &w, Op::N, &mut dx, false);
                black_box(&mut dx);
            });
        }
        let case = name("f32_dw");
        if bench.wants(&case) {
            bench.run(pool, case, flops, "GF/s", || {
                sgemm(n, k, m, &dy, Op::T, &x, Op::N, &mut dw, false);
                black_box(&mut dw);
            });
        }
        let case = name("bf16_fwd");
        if bench.wants(&case) {
            bench.run(pool, case, flops, "GF/s", || {
                matmul_weight_t(&x, WeightRef::BF16(&wb), &mut y, m, n, k, false);
                black_box(&mut y);
            });
        }
        for &kernel in Bf16Kernel::available() {
            let kname = |op: &str| name(&format!("{}_{op}", kernel.name()));
            type Case<'a> = (usize, usize, usize, Operand<'a>, Op, Operand<'a>, Op);
            let cases: [(&str, Case, &mut [f32]); 3] = [
                (
                    "fwd",
                    (m, n, k, Operand::F32(&x), Op::N, Operand::Bf16(&wb), Op::T),
                    &mut y,
                ),
                (
                    "dx",
                    (m, k, n, Operand::F32(&dy), Op::N, Operand::Bf16(&wb), Op::N),
                    &mut dx,
                ),
                (
                    "dw",
                    (n, k, m, Operand::F32(&dy), Op::T, Operand::F32(&x), Op::N),
                    &mut dw,
                ),
            ];
            for (op, (cm, cn, ck, a, op_a, b, op_b), out) in cases {
                let case = kname(op);
                if bench.wants(&case) {
                    bench.run(pool, case, flops, "GF/s", || {
                        bf16_gemm_with(kernel, cm, cn, ck, a, op_a, b, op_b, out, false);
                        black_box(&mut *out);
                    });
                }
            }
        }
    }
}

fn gemv_case<W: ferrotron_tensor::Element + ferrotron_tensor::gemv::Widen + Send + Sync>(
    bench: &mut Bench,
    pool: &rayon::ThreadPool,
    case: String,
    n: usize,
    k: usize,
    from_f32: impl Fn(f32) -> W,
) {
    if !bench.wants(&case) {
        return;
    }
    let bytes = n * k * size_of::<W>();
    let copies = GEMV_STREAM_BYTES.div_ceil(bytes).max(2);
    let ws: Vec<Vec<W>> = (0..copies)
        .map(|c| {
            data(n * k, 10 + c as u32)
                .into_iter()
                .map(&from_f32)
                .collect()
        })
        .collect();
    let x = data(k, 4);
    let mut y = vec![0f32; n];
    let mut next = 0;
    bench.run(pool, case, bytes as f64, "GB/s", || {
        gemv(&ws[next], &x, &mut y, false);
        black_box(&mut y);
        next = (next + 1) % copies;
    });
}

/// The machine's measured f32 FMA and bf16 dot peaks on `t` threads (`peak/...` rows), so the
/// GEMM rows read as a fraction of what this CPU can do.
fn peak_rows(bench: &mut Bench, pool: &rayon::ThreadPool, t: usize) {
    let peaks = pool.install(|| {
        ferrotron_tensor::peak::f32_fma()
            .into_iter()
            .chain(Bf16Kernel::available().iter().copied().filter_map(bf16_dot))
            .collect::<Vec<_>>()
    });
    for p in peaks {
        let case = format!("peak/{}/t{t}", p.name);
        if bench.wants(&case) {
            eprintln!("{case:<34} {:>8.1} {:>8.1}  GF/s", p.gflops, p.gflops);
            bench.rows.push(Row {
                case,
                median: p.gflops,
                best: p.gflops,
                unit: "GF/s",
                samples: 5,
            });
        }
    }
}

fn main() {
    // `cargo bench` passes `--bench`; any other bare argument is a case-name filter.
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let budget_ms = std::env::var("FERROTRON_BENCH_CASE_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1500);
    let mut bench = Bench {
        filter,
        budget: Duration::from_millis(budget_ms),
        rows: Vec::new(),
    };
    let t_start = Instant::now();
    for t in THREADS {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build()
            .expect("rayon pool");
        peak_rows(&mut bench, &pool, t);
        gemm_cases(&mut bench, &pool, t);
        for (n, k) in GEMV_SHAPES {
            gemv_case(
                &mut bench,
                &pool,
                format!("gemv/f32/{n}x{k}/t{t}"),
                n,
                k,
                |v| v,
            );
            gemv_case(
                &mut bench,
                &pool,
                format!("gemv/bf16/{n}x{k}/t{t}"),
                n,
                k,
                bf16::from_f32,
            );
        }
    }

    println!();
    println!(
        "ferrotron-tensor GEMM/GEMV ({} ms per case, {:.0} s total)",
        budget_ms,
        t_start.elapsed().as_secs_f64()
    );
    println!("{:<34} {:>8} {:>8}  unit", "case", "median", "best");
    for r in &bench.rows {
        println!(
            "{:<34} {:>8.1} {:>8.1}  {}",
            r.case, r.median, r.best, r.unit
        );
    }
}
