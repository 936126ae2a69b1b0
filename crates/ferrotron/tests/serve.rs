//! `ferrotron serve` on the real SmolLM2-135M-Instruct (the HF directory of
//! `FERROTRON_SMOLLM2_HF`): a temperature-0 chat answer equals `ferrotron generate --chat
//! --greedy`, alone and with other requests in flight; the official `openai` Python client
//! (`FERROTRON_OPENAI_PYTHON`: a Python with `openai` installed) passes
//! tools/check_openai_client.py; SIGTERM lets a streaming request finish and exits 0; many
//! requests in a row (1,000) leave the RSS flat; the quantized GGUF of `FERROTRON_SMOLLM2_GGUF`
//! serves what `generate` answers from it; LoRA adapters selected per request (`--lora`, and
//! one loaded at run time) answer what `generate --lora` answers, beside the base model in
//! the same batches. Without the variables the tests are reported as ignored
//! (`common::weights`).

use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

mod common;
use common::ferrotron;
use common::weights::{self, GGUF, HF, OPENAI_PYTHON, trials};

fn main() {
    let mut all = trials![needs [HF]:
        greedy_chat_equals_generate_alone_and_batched,
        sigterm_finishes_the_stream_in_flight_and_exits_0,
        many_requests_leave_the_rss_flat,
        a_client_that_disconnects_mid_stream_cancels_its_request,
        lora_adapters_answer_what_generate_with_them_answers,
    ];
    all.extend(trials![needs [OPENAI_PYTHON]: the_openai_python_client_passes_its_checks]);
    all.extend(trials![needs [GGUF]: a_gguf_file_serves_what_generate_answers]);
    all.extend(trials![needs [HF, GGUF]: a_quantized_draft_model_keeps_the_greedy_answers]);
    weights::run(all);
}

const NAME: &str = "smollm2";

/// A `ferrotron serve` process on a free port.
struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start() -> Server {
        Server::start_with(&[])
    }

    fn start_with(extra: &[&str]) -> Server {
        Server::start_model(&weights::path(HF), extra)
    }

    /// Serves `model` (an HF directory or a GGUF file) with a 0.5 GiB KV pool unless `extra`
    /// sets `--kv-cache-memory`.
    fn start_model(model: &std::path::Path, extra: &[&str]) -> Server {
        let pool = ["--kv-cache-memory", "0.5"];
        let pool = if extra.contains(&pool[0]) {
            &[][..]
        } else {
            &pool[..]
        };
        let mut child = Command::new(env!("CARGO_BIN_EXE_ferrotron"))
            .args(["serve", "--model", model.to_str().unwrap(), "--port", "0"])
            .args(["--served-model-name", NAME, "--log-stats-interval", "0"])
            .args(pool)
            .args(extra)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let addr = loop {
            let line = lines
                .next()
                .expect("serve exited before listening")
                .unwrap();
            if let Some(rest) = line.split_once(" on http://") {
                break rest.1.split_whitespace().next().unwrap().to_string();
            }
        };
        // Keep draining stderr so the server never blocks on a full pipe.
        std::thread::spawn(move || lines.for_each(drop));
        Server { child, addr }
    }

    /// Raw HTTP/1.1 POST of JSON; returns (status, body).
    fn post(&self, path: &str, body: &Value) -> (u16, String) {
        let mut s = TcpStream::connect(&self.addr).unwrap();
        let body = body.to_string();
        write!(
            s,
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).unwrap();
        let (head, rest) = raw.split_once("\r\n\r\n").unwrap();
        (head[9..12].parse().unwrap(), rest.to_string())
    }

    fn chat(&self, prompt: &str, max_tokens: usize) -> String {
        self.chat_as(NAME, prompt, max_tokens)
    }

    /// A temperature-0 chat answer of `model` (the served name or a LoRA adapter's).
    fn chat_as(&self, model: &str, prompt: &str, max_tokens: usize) -> String {
        let body = json!({"model": model, "messages": [{"role": "user", "content": prompt}],
                          "temperature": 0, "max_tokens": max_tokens});
        let (status, text) = self.post("/v1/chat/completions", &body);
        assert_eq!(status, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string()
    }

    /// [`Server::chat`] of every prompt, all in flight together.
    fn chat_all(&self, prompts: &[&str], max_tokens: usize) -> Vec<String> {
        std::thread::scope(|s| {
            let handles: Vec<_> = prompts
                .iter()
                .map(|p| s.spawn(|| self.chat(p, max_tokens)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// A `/metrics` value.
    fn metric(&self, name: &str) -> f64 {
        let mut s = TcpStream::connect(&self.addr).unwrap();
        write!(
            s,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut page = String::new();
        s.read_to_string(&mut page).unwrap();
        let line = page.lines().find(|l| l.starts_with(name)).unwrap();
        line.rsplit(' ').next().unwrap().parse().unwrap()
    }

    fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    fn terminate(&mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        assert!(
            Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .unwrap()
                .success()
        );
        self.child.wait().unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `ferrotron generate --chat --greedy` of `prompt` on the HF directory.
fn generate_text(prompt: &str, max_tokens: usize) -> String {
    generate_text_with(&weights::path(HF), prompt, max_tokens)
}

/// `ferrotron generate --chat --greedy` of `prompt` on `model`.
fn generate_text_with(model: &std::path::Path, prompt: &str, max_tokens: usize) -> String {
    generate_text_args(model, prompt, max_tokens, &[])
}

/// `ferrotron generate --chat --greedy` of `prompt` on `model` with `extra` flags.
fn generate_text_args(
    model: &std::path::Path,
    prompt: &str,
    max_tokens: usize,
    extra: &[&str],
) -> String {
    let n = max_tokens.to_string();
    let mut args = vec![
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--chat",
        "--prompt",
        prompt,
        "--greedy",
        "--max-new-tokens",
        &n,
        "--json",
    ];
    args.extend(extra);
    let o = ferrotron(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    v["text"].as_str().unwrap().to_string()
}

const PROMPTS: [&str; 4] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Who wrote Hamlet?",
];

fn greedy_chat_equals_generate_alone_and_batched() {
    let want: Vec<String> = PROMPTS.iter().map(|p| generate_text(p, 40)).collect();
    let server = Server::start();
    assert_eq!(server.chat(PROMPTS[0], 40), want[0], "alone");
    let got = server.chat_all(&PROMPTS, 40);
    assert_eq!(got, want, "four requests in flight together");
    drop(server);
    let spec = r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}"#;
    let server = Server::start_with(&["--speculative-config", spec]);
    for (p, w) in PROMPTS.iter().zip(&want) {
        assert_eq!(server.chat(p, 40), *w, "with prompt-lookup speculation");
    }
    assert!(server.metric("ferrotron:spec_decode_num_draft_tokens_total") > 0.0);
}

/// A quantized GGUF file served directly (weights kept in their blocks, chat template from its
/// metadata): a temperature-0 chat answer is what `generate --chat --greedy` on the same file
/// answers.
fn a_gguf_file_serves_what_generate_answers() {
    let file = weights::path(GGUF);
    let want: Vec<String> = PROMPTS[..2]
        .iter()
        .map(|p| generate_text_with(&file, p, 32))
        .collect();
    let server = Server::start_model(&file, &[]);
    for (p, w) in PROMPTS.iter().zip(&want) {
        assert_eq!(server.chat(p, 32), *w, "{p}");
    }
}

/// Draft-model speculation with the Q4_1 GGUF of the same model as the draft (same
/// tokenizer, a quarter of the bytes): the served f32 model's greedy answers are unchanged,
/// alone and four at a time, and most proposals are accepted.
fn a_quantized_draft_model_keeps_the_greedy_answers() {
    let want: Vec<String> = PROMPTS.iter().map(|p| generate_text(p, 40)).collect();
    let draft = weights::path(GGUF);
    let args = [
        "--draft-model",
        draft.to_str().unwrap(),
        "--num-speculative-tokens",
        "4",
        "--kv-cache-memory",
        "1",
    ];
    let server = Server::start_model(&weights::path(HF), &args);
    assert_eq!(server.chat(PROMPTS[0], 40), want[0], "alone");
    let got = server.chat_all(&PROMPTS, 40);
    assert_eq!(got, want, "four requests in flight together");
    let proposed = server.metric("ferrotron:spec_decode_num_draft_tokens_total");
    let accepted = server.metric("ferrotron:spec_decode_num_accepted_tokens_total");
    println!("draft model: {accepted} of {proposed} proposals accepted");
    assert!(
        proposed > 0.0 && accepted > 0.5 * proposed,
        "{accepted} of {proposed}"
    );
}

fn sigterm_finishes_the_stream_in_flight_and_exits_0() {
    let mut server = Server::start();
    let body = json!({"model": NAME, "prompt": "Once upon a time", "max_tokens": 64,
                      "ignore_eos": true, "temperature": 0, "stream": true})
    .to_string();
    let mut s = TcpStream::connect(&server.addr).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut first = [0u8; 256];
    let n = s.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
    let status = server.terminate();
    let mut rest = String::new();
    s.read_to_string(&mut rest).unwrap();
    let chunks = rest.matches("\"text_completion\"").count();
    assert!(rest.contains("data: [DONE]"), "the stream was cut: {rest}");
    assert!(chunks >= 60, "{chunks} chunks after SIGTERM");
    assert!(status.success(), "exit status {status}");
}

fn a_client_that_disconnects_mid_stream_cancels_its_request() {
    let server = Server::start();
    let body = json!({"model": NAME, "prompt": "Once upon a time", "max_tokens": 400,
                      "ignore_eos": true, "temperature": 0, "stream": true})
    .to_string();
    let mut s = TcpStream::connect(&server.addr).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut first = [0u8; 256];
    assert!(s.read(&mut first).unwrap() > 0);
    drop(s);
    let aborted = "ferrotron:request_success_total{finished_reason=\"abort\"}";
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while server.metric(aborted) < 1.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the request was not cancelled"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(server.metric("ferrotron:generation_tokens_total") < 400.0);
    assert_eq!(server.metric("ferrotron:num_requests_running"), 0.0);
    assert_eq!(server.metric("ferrotron:kv_cache_usage_perc"), 0.0);
}

fn many_requests_leave_the_rss_flat() {
    let server = Server::start();
    let body = json!({"model": NAME, "prompt": "The Lord is my shepherd; I shall not want.",
                      "max_tokens": 4, "temperature": 0.8, "seed": 1});
    let run = |n| {
        for _ in 0..n {
            assert_eq!(server.post("/v1/completions", &body).0, 200);
        }
    };
    run(100);
    let before = server.rss_kib();
    run(900);
    let after = server.rss_kib();
    assert!(
        after <= before + before / 20 + 8 * 1024,
        "RSS grew from {before} KiB to {after} KiB over 900 more requests (1000 in all)"
    );
}

fn the_openai_python_client_passes_its_checks() {
    let python = weights::path(OPENAI_PYTHON);
    let prompt = PROMPTS[0];
    let want = generate_text(prompt, 48);
    let server = Server::start();
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tools/check_openai_client.py");
    let o = Command::new(python)
        .arg(script)
        .args([
            "--base-url",
            &format!("http://{}/v1", server.addr),
            "--model",
            NAME,
        ])
        .args([
            "--greedy-prompt",
            prompt,
            "--greedy-text",
            &want,
            "--max-tokens",
            "48",
        ])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("all checks passed"), "{out}");
}

/// A PEFT adapter for SmolLM2 written to `dir`: rank 8 on every linear layer, `linear_in`
/// Xavier-normal from `seed` and `linear_out` uniform in ±0.1 (a fresh adapter's is zero,
/// which would change nothing).
fn write_random_adapter(dir: &std::path::Path, seed: u64) {
    use ferrotron_model::{InitConfig, LoraConfig, families::load_hf_model};
    let base = load_hf_model(&weights::path(HF), ferrotron_tensor::DType::F32)
        .unwrap()
        .0;
    let lora = LoraConfig {
        target_modules: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
            .map(String::from)
            .to_vec(),
        rank: 8,
        alpha: 16.0,
        dropout: 0.0,
    };
    let init = InitConfig {
        seed,
        ..InitConfig::default()
    };
    let mut model = base.with_lora(lora, &init).unwrap();
    let outs: Vec<usize> = (0..model.parameters().len())
        .filter(|&i| {
            model.layout().decls()[i]
                .name
                .ends_with("linear_out.weight")
        })
        .collect();
    let sizes: Vec<usize> = model.parameters().iter().map(|p| p.numel()).collect();
    let mut x = seed;
    model
        .load_parameters_with(&outs, |i| {
            let mut next = || {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
            };
            std::borrow::Cow::Owned((0..sizes[i]).map(|_| next()).collect())
        })
        .unwrap();
    ferrotron_checkpoint::peft::write_peft_adapter(&model, dir, "smollm2", false).unwrap();
}

/// Two adapters, `a` given with `--lora` and `b` loaded at run time: each answers at
/// temperature 0 what `generate --lora DIR --chat --greedy` answers, with requests of both and
/// of the base model in flight together.
fn lora_adapters_answer_what_generate_with_them_answers() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    write_random_adapter(&a, 1);
    write_random_adapter(&b, 2);
    let hf = weights::path(HF);
    let with = |dir: &std::path::Path, p: &str| {
        generate_text_args(&hf, p, 32, &["--lora", dir.to_str().unwrap()])
    };
    let jobs = [
        ("a", PROMPTS[1]),
        ("b", PROMPTS[1]),
        (NAME, PROMPTS[1]),
        ("a", PROMPTS[0]),
    ];
    let want: Vec<String> = jobs
        .iter()
        .map(|&(model, p)| match model {
            "a" => with(&a, p),
            "b" => with(&b, p),
            _ => generate_text(p, 32),
        })
        .collect();
    assert!(
        want[0] != want[2] && want[1] != want[0],
        "the adapters change nothing: {want:?}"
    );
    let lora_a = format!("a={}", a.display());
    let server = Server::start_with(&["--lora", &lora_a, "--allow-runtime-lora-updating"]);
    let load = json!({"lora_name": "b", "lora_path": b});
    let (status, text) = server.post("/v1/load_lora_adapter", &load);
    assert_eq!(status, 200, "{text}");
    assert_eq!(server.chat_as("a", PROMPTS[1], 32), want[0], "a alone");
    let server = &server;
    let got: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|&(model, p)| s.spawn(move || server.chat_as(model, p, 32)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got, want, "adapters and base in flight together");
}
