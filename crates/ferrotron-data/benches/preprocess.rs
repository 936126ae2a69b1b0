//! Preprocessing throughput (MB/s of text, tokens/s, docs/s) on the KJV Bible, one verse per
//! line, with the SmolLM2 tokenizer, at 1 and 2 workers.
//!
//! `cargo bench -p ferrotron-data --bench preprocess`
//!
//! Needs the corpus: `apt-get install bible-kjv` (the bench runs `bible -l0 "Gen1:1-Rev22:21"`
//! and keeps the verse lines), or a text file in `$FERROTRON_BENCH_CORPUS`; and the tokenizer:
//! `$FERROTRON_SMOLLM2_HF` (an HF directory), `$FERROTRON_SMOLLM2_GGUF` (converted here), or
//! `.cache/smollm2-hf`. Settings: `$FERROTRON_BENCH_WORKERS` (default `1,2`),
//! `$FERROTRON_BENCH_REPS` (default 3; the median is reported).

use ferrotron_checkpoint::GgufFile;
use ferrotron_checkpoint::gguf::hf_tokenizer_from_gguf;
use ferrotron_data::Tokenizer;
use ferrotron_data::preprocess::{PreprocessConfig, preprocess_data};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn tokenizer_dir(tmp: &Path) -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("FERROTRON_SMOLLM2_HF") {
        return Some(d.into());
    }
    let cached = root().join(".cache/smollm2-hf");
    if cached.join("tokenizer.json").is_file() {
        return Some(cached);
    }
    let gguf = std::env::var_os("FERROTRON_SMOLLM2_GGUF")?;
    let files = hf_tokenizer_from_gguf(&GgufFile::open(&gguf).ok()?, None).ok()?;
    std::fs::write(tmp.join("tokenizer.json"), files.tokenizer_json.to_string()).ok()?;
    Some(tmp.to_path_buf())
}

/// The KJV text, one verse per line (verse numbers removed), written to `tmp/kjv.txt`.
fn corpus(tmp: &Path) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("FERROTRON_BENCH_CORPUS") {
        return Some(p.into());
    }
    let out = Command::new("bible")
        .args(["-l0", "Gen1:1-Rev22:21"])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut verses = String::new();
    for line in text.lines() {
        // Verse lines read "  12 text"; chapter headings and blank lines are dropped.
        let t = line.trim_start();
        let digits = t.len() - t.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        if digits > 0 && line.starts_with(' ') && t[digits..].starts_with(' ') {
            verses.push_str(&t[digits + 1..]);
            verses.push('\n');
        }
    }
    let path = tmp.join("kjv.txt");
    std::fs::write(&path, verses).ok()?;
    Some(path)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// CPU time (user + system) of this process so far, from /proc/self/stat (clock ticks of
/// 1/100 s); zero where unavailable. On a shared machine, MB per CPU-second is the steadier
/// measure of our own cost.
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after_name = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<u64> = after_name
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    // Fields 14 and 15 of the whole line are the 12th and 13th after the name.
    let ticks = f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0);
    Duration::from_millis(ticks * 10)
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("preprocess bench: run with `cargo bench -p ferrotron-data --bench preprocess`");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let Some(tok_dir) = tokenizer_dir(tmp.path()) else {
        println!(
            "SKIPPED: no SmolLM2 tokenizer (set FERROTRON_SMOLLM2_HF or FERROTRON_SMOLLM2_GGUF)"
        );
        return;
    };
    let Some(input) = corpus(tmp.path()) else {
        println!("SKIPPED: no corpus (apt-get install bible-kjv, or set FERROTRON_BENCH_CORPUS)");
        return;
    };
    let tokenizer = Tokenizer::from_dir(&tok_dir).unwrap();
    let workers: Vec<usize> = std::env::var("FERROTRON_BENCH_WORKERS")
        .unwrap_or_else(|_| "1,2".into())
        .split(',')
        .map(|w| {
            w.trim()
                .parse()
                .expect("FERROTRON_BENCH_WORKERS: comma-separated counts")
        })
        .collect();
    let reps: usize = std::env::var("FERROTRON_BENCH_REPS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(3)
        .max(1);
    let size = std::fs::metadata(&input).unwrap().len();
    println!(
        "corpus {} ({:.2} MB), tokenizer {} (vocab {}), {reps} runs each, median",
        input.display(),
        size as f64 / 1e6,
        tok_dir.display(),
        tokenizer.vocab_size()
    );
    // Tokenizer alone, one thread, no pipeline: the ceiling one worker can reach.
    let text = std::fs::read_to_string(&input).unwrap();
    let mut times = Vec::new();
    let mut tokens = 0;
    for _ in 0..reps {
        let t0 = std::time::Instant::now();
        tokens = text
            .lines()
            .map(|l| tokenizer.encode(l, false).unwrap().len())
            .sum::<usize>();
        times.push(t0.elapsed());
    }
    let t = median(times).as_secs_f64();
    println!(
        "encode only, 1 thread: {:.2} MB/s, {:.0} tokens/s ({tokens} tokens, {t:.3} s)",
        text.len() as f64 / 1e6 / t,
        tokens as f64 / t
    );
    println!(
        "workers      MB/s     tokens/s     docs/s    seconds  MB/cpu-s   documents     tokens"
    );
    for &w in &workers {
        let mut times = Vec::new();
        let mut cpu = Vec::new();
        let mut last = None;
        for _ in 0..reps {
            let mut cfg = PreprocessConfig::new(vec![input.clone()], tmp.path().join("out"));
            cfg.workers = w;
            cfg.append_eod = Some(0);
            let c0 = cpu_time();
            let report = preprocess_data(&cfg, &tokenizer, &mut |_| {}).unwrap();
            cpu.push(cpu_time() - c0);
            times.push(report.elapsed);
            last = Some(report);
        }
        let r = last.unwrap();
        let t = median(times).as_secs_f64();
        let c = median(cpu).as_secs_f64();
        println!(
            "{w:>7} {:>9.2} {:>12.0} {:>10.0} {:>10.3} {:>9.2} {:>11} {:>10}",
            r.bytes_read as f64 / 1e6 / t,
            r.tokens as f64 / t,
            r.documents as f64 / t,
            t,
            r.bytes_read as f64 / 1e6 / c,
            r.documents,
            r.tokens
        );
    }
}
