//! `/metrics` in Prometheus' text format: the engine's counters and gauges
//! ([`ferrotron_infer::engine::EngineStats`]) and the server's latency histograms, under
//! vLLM's metric names with a `ferrotron:` prefix.

use crate::generation::ChoiceText;
use crate::state::AppState;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// Upper bounds (seconds) of the latency buckets (vLLM's TTFT buckets, trimmed).
const BUCKETS: [f64; 14] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
];

/// A cumulative histogram of seconds.
#[derive(Debug, Default)]
pub struct Histogram {
    /// Count per bucket of [`BUCKETS`], then the `+Inf` bucket.
    counts: [AtomicU64; 15],
    /// Sum in microseconds.
    sum_us: AtomicU64,
}

impl Histogram {
    /// Records one observation of `seconds`.
    pub fn observe(&self, seconds: f64) {
        let i = BUCKETS
            .iter()
            .position(|&b| seconds <= b)
            .unwrap_or(BUCKETS.len());
        self.counts[i].fetch_add(1, Relaxed);
        self.sum_us.fetch_add((seconds * 1e6) as u64, Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut total = 0;
        for (i, c) in self.counts.iter().enumerate() {
            total += c.load(Relaxed);
            let le = BUCKETS.get(i).map_or("+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {total}");
        }
        let sum = self.sum_us.load(Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {total}");
    }
}

/// Latencies the server measures per choice.
#[derive(Debug, Default)]
pub struct ServerMetrics {
    /// Request arrival to first token.
    pub time_to_first_token: Histogram,
    /// Request arrival to the choice's end.
    pub e2e_request_latency: Histogram,
    /// Decode time per output token after the first (TPOT).
    pub time_per_output_token: Histogram,
}

impl ServerMetrics {
    /// Records a finished choice of a request that arrived at `started`.
    pub fn choice_finished(&self, choice: &ChoiceText, started: Instant) {
        let e2e = started.elapsed().as_secs_f64();
        self.e2e_request_latency.observe(e2e);
        if let Some(ttft) = choice.first_token_seconds {
            self.time_to_first_token.observe(ttft);
            if choice.completion_tokens > 1 {
                let per = (e2e - ttft) / (choice.completion_tokens - 1) as f64;
                self.time_per_output_token.observe(per);
            }
        }
    }
}

/// The whole `/metrics` page.
pub fn render(state: &AppState) -> String {
    let s = state.engine.stats();
    let get = |a: &AtomicU64| a.load(Relaxed) as f64;
    let (drafted, accepted) = (
        get(&s.spec_decode_num_draft_tokens_total),
        get(&s.spec_decode_num_accepted_tokens_total),
    );
    let acceptance = if drafted > 0.0 {
        accepted / drafted
    } else {
        0.0
    };
    let (gauge, counter) = ("gauge", "counter");
    let rows = [
        (
            "num_requests_running",
            gauge,
            "Requests holding KV blocks.",
            get(&s.num_requests_running),
        ),
        (
            "num_requests_waiting",
            gauge,
            "Requests waiting for admission.",
            get(&s.num_requests_waiting),
        ),
        (
            "kv_cache_usage_perc",
            gauge,
            "Fraction of KV blocks in use (0-1).",
            s.kv_cache_usage(),
        ),
        (
            "prompt_tokens_total",
            counter,
            "Prompt tokens processed.",
            get(&s.prompt_tokens_total),
        ),
        (
            "generation_tokens_total",
            counter,
            "Tokens generated.",
            get(&s.generation_tokens_total),
        ),
        (
            "prefix_cache_queries_total",
            counter,
            "Prompt tokens looked up in the prefix cache.",
            get(&s.prefix_cache_queries_total),
        ),
        (
            "prefix_cache_hits_total",
            counter,
            "Prompt tokens served from the prefix cache.",
            get(&s.prefix_cache_hits_total),
        ),
        (
            "num_preemptions_total",
            counter,
            "Sequences preempted for KV blocks.",
            get(&s.num_preemptions_total),
        ),
        (
            "spec_decode_num_draft_tokens_total",
            counter,
            "Tokens proposed by speculative decoding.",
            drafted,
        ),
        (
            "spec_decode_num_accepted_tokens_total",
            counter,
            "Proposed tokens the model accepted.",
            accepted,
        ),
        (
            "spec_decode_draft_acceptance_rate",
            gauge,
            "Accepted / proposed tokens.",
            acceptance,
        ),
    ];
    let mut out = String::new();
    for (name, kind, help, value) in rows {
        let _ = writeln!(
            out,
            "# HELP ferrotron:{name} {help}\n# TYPE ferrotron:{name} {kind}\nferrotron:{name} {value}"
        );
    }
    let _ = writeln!(
        out,
        "# HELP ferrotron:request_success_total Finished requests by reason.\n\
         # TYPE ferrotron:request_success_total counter\n\
         ferrotron:request_success_total{{finished_reason=\"stop\"}} {}\n\
         ferrotron:request_success_total{{finished_reason=\"length\"}} {}\n\
         ferrotron:request_success_total{{finished_reason=\"abort\"}} {}",
        get(&s.request_success_stop),
        get(&s.request_success_length),
        get(&s.request_abort)
    );
    let adapters = state.adapters.list();
    let _ = writeln!(
        out,
        "# HELP ferrotron:lora_adapters_loaded LoRA adapters served.\n\
         # TYPE ferrotron:lora_adapters_loaded gauge\n\
         ferrotron:lora_adapters_loaded {}\n\
         # HELP ferrotron:lora_requests_total Requests per LoRA adapter.\n\
         # TYPE ferrotron:lora_requests_total counter",
        adapters.len()
    );
    for a in &adapters {
        let name = label_value(&a.name);
        let _ = writeln!(
            out,
            "ferrotron:lora_requests_total{{lora_name=\"{name}\"}} {}",
            a.requests
        );
    }
    let m = &state.metrics;
    let histograms = [
        (
            &m.time_to_first_token,
            "time_to_first_token_seconds",
            "Time to first token.",
        ),
        (
            &m.time_per_output_token,
            "time_per_output_token_seconds",
            "Time per output token after the first.",
        ),
        (
            &m.e2e_request_latency,
            "e2e_request_latency_seconds",
            "Request latency.",
        ),
    ];
    for (h, name, help) in histograms {
        h.render(&mut out, &format!("ferrotron:{name}"), help);
    }
    out
}

/// `value` as a Prometheus label value (backslash, quote and newline escaped).
fn label_value(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
