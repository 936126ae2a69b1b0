//! The HTTP server end to end over raw HTTP/1.1 on loopback, with the tiny LLaMA fixture and
//! a word-level tokenizer written beside it (`w3 w4 ...` is token ids 3, 4, ...): responses
//! in OpenAI's shapes, greedy completions equal to `generate`, streaming with usage and
//! `[DONE]`, stop strings, errors with the right status and `param`, tokenize round trips, a
//! client that disconnects mid-stream freeing its blocks, and a shutdown that lets a request
//! in flight finish.

use ferrotron_data::Tokenizer;
use ferrotron_data::chat::ChatTemplate;
use ferrotron_infer::engine::{Engine, EngineConfig, EngineHandle, SchedulerConfig};
use ferrotron_infer::sampler::SamplingParams;
use ferrotron_infer::{GenerateOptions, generate};
use ferrotron_model::GptModel;
use ferrotron_model::families::load_hf_model;
use ferrotron_serve::{AppState, ServedModel};
use ferrotron_tensor::DType;
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

const VOCAB: usize = 112;
const EOS: u32 = 2;

/// tokenizer.json: `<unk>`, `<s>`, `</s>`, then `w3`..`w111`, split on whitespace.
fn write_tokenizer(dir: &Path) {
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    let mut vocab = serde_json::Map::new();
    for (i, s) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
        vocab.insert(s.to_string(), json!(i));
    }
    for i in 3..VOCAB {
        vocab.insert(format!("w{i}"), json!(i));
    }
    let tok = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
    let template = "{% for m in messages %}{{ m['content'] }} {% endfor %}\
                    {% if add_generation_prompt %}w3{% endif %}";
    let config = json!({"chat_template": template, "eos_token": "</s>", "bos_token": "<s>"});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
}

struct Server {
    addr: SocketAddr,
    model: Arc<GptModel>,
    tokenizer: Arc<Tokenizer>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl Server {
    fn start(max_num_batched_tokens: usize) -> Server {
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-llama");
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path());
        let model = Arc::new(load_hf_model(&fixture, DType::F32).unwrap().0);
        let tokenizer = Arc::new(Tokenizer::from_dir(dir.path()).unwrap());
        let template =
            ChatTemplate::from_tokenizer_config(dir.path().join("tokenizer_config.json")).unwrap();
        let config = EngineConfig {
            block_size: 16,
            num_blocks: 16,
            scheduler: SchedulerConfig {
                max_num_seqs: 4,
                max_num_batched_tokens,
            },
            enable_prefix_caching: true,
            speculative: None,
            speculative_disable_by_batch_size: None,
        };
        let engine = EngineHandle::spawn(Engine::new(model.clone(), config).unwrap()).unwrap();
        let served = ServedModel {
            name: "tiny".into(),
            tokenizer: tokenizer.clone(),
            chat_template: Some(template),
            eos_token_ids: vec![EOS],
        };
        let state = Arc::new(AppState::new(served, engine, 4));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                addr_tx.send(listener.local_addr().unwrap()).unwrap();
                let shutdown = async move {
                    let _ = stopped.await;
                };
                ferrotron_serve::serve(listener, state, shutdown, None)
                    .await
                    .unwrap();
            });
        });
        Server {
            addr: addr_rx.recv().unwrap(),
            model,
            tokenizer,
            stop: Some(stop),
            thread: Some(thread),
            _dir: dir,
        }
    }

    /// Raw HTTP/1.1 request; returns (status, body).
    fn request(&self, method: &str, path: &str, body: &str) -> (u16, String) {
        let mut s = TcpStream::connect(self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).unwrap();
        let raw = String::from_utf8(raw).unwrap();
        let (head, rest) = raw.split_once("\r\n\r\n").unwrap();
        let status = head[9..12].parse().unwrap();
        let body = if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(rest)
        } else {
            rest.to_string()
        };
        (status, body)
    }

    fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let (status, text) = self.request("POST", path, &body.to_string());
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    fn metric(&self, name: &str) -> f64 {
        let (_, page) = self.request("GET", "/metrics", "");
        let line = page.lines().find(|l| l.starts_with(name)).unwrap();
        line.rsplit(' ').next().unwrap().parse().unwrap()
    }

    fn stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }

    fn words(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, true).unwrap()
    }

    fn greedy(&self, prompt: &[u32], max: usize) -> Vec<u32> {
        let options = GenerateOptions {
            max_new_tokens: max,
            sampling: SamplingParams::greedy(),
            stop_token_ids: vec![EOS],
        };
        generate(&self.model, prompt, &options, &mut |_| {
            ControlFlow::Continue(())
        })
        .unwrap()
        .generated_ids
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The body of a chunked transfer encoding.
fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&tail[..n]);
        rest = &tail[n + 2..];
    }
    out
}

/// The `data:` payloads of an SSE body.
fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: ").or(l.strip_prefix("data:")))
        .map(str::to_string)
        .collect()
}

fn ids(text: &str) -> Vec<u32> {
    text.split_whitespace()
        .map(|w| w[1..].parse().unwrap())
        .collect()
}

#[test]
fn greedy_completions_equal_generate_in_openai_shape() {
    let server = Server::start(64);
    let prompt = "w5 w17 w33 w8 w90 w41";
    let (status, body) = server.post(
        "/v1/completions",
        json!({"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}),
    );
    assert_eq!(status, 200, "{body}");
    let want = server.greedy(&ids(prompt), 12);
    let choice = &body["choices"][0];
    assert_eq!(choice["text"], server.words(&want));
    assert_eq!(body["object"], "text_completion");
    assert!(body["id"].as_str().unwrap().starts_with("cmpl-"));
    let finish = if want.last() == Some(&EOS) {
        "stop"
    } else {
        "length"
    };
    assert_eq!(choice["finish_reason"], finish);
    assert_eq!(body["usage"]["prompt_tokens"], 6);
    assert_eq!(body["usage"]["completion_tokens"], want.len());
    // The same prompt as token ids, twice with n = 2: prompt counted once per prompt.
    let (_, again) = server.post(
        "/v1/completions",
        json!({"prompt": ids(prompt), "max_tokens": 12, "temperature": 0, "n": 2}),
    );
    for c in again["choices"].as_array().unwrap() {
        assert_eq!(c["text"], server.words(&want));
    }
    assert_eq!(again["usage"]["prompt_tokens"], 6);
    // The models list.
    let (status, models) = server.request("GET", "/v1/models", "");
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], "tiny");
    assert_eq!(models["data"][0]["max_model_len"], 128);
}

#[test]
fn chat_streams_deltas_usage_and_done() {
    let server = Server::start(64);
    let request = json!({"messages": [{"role": "user", "content": "w9 w10 w11"}],
                         "temperature": 0, "max_tokens": 8, "stream": true,
                         "stream_options": {"include_usage": true}, "logprobs": true,
                         "top_logprobs": 2});
    let (status, body) = server.request("POST", "/v1/chat/completions", &request.to_string());
    assert_eq!(status, 200);
    let data = sse_data(&body);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .flat_map(|c| c["choices"].as_array().unwrap())
        .map(|c| c["delta"]["content"].as_str().unwrap().to_string())
        .collect();
    // The template renders "w9 w10 w11 w3" and the tokenizer adds no special tokens.
    let want = server.greedy(&[9, 10, 11, 3], 8);
    let words: Vec<u32> = want.iter().copied().filter(|&t| t != EOS).collect();
    assert_eq!(text.trim(), server.words(&words));
    let usage = &chunks.last().unwrap()["usage"];
    assert!(
        chunks.last().unwrap()["choices"]
            .as_array()
            .unwrap()
            .is_empty()
    );
    assert_eq!(usage["prompt_tokens"], 4);
    assert_eq!(usage["completion_tokens"], want.len());
    let lp = &chunks[0]["choices"][0]["logprobs"]["content"][0];
    assert_eq!(lp["top_logprobs"].as_array().unwrap().len(), 2);
    assert!(lp["logprob"].as_f64().unwrap() <= 0.0);
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
}

#[test]
fn stop_strings_cut_the_text_and_name_themselves() {
    let server = Server::start(64);
    let prompt = "w5 w17 w33";
    let free = server.greedy(&ids(prompt), 10);
    let cut = free.iter().position(|&t| t == EOS).unwrap_or(free.len());
    assert!(cut >= 3, "the fixture's greedy output is long enough");
    let stop = format!("w{}", free[2]);
    let (_, body) = server.post(
        "/v1/completions",
        json!({"prompt": prompt, "max_tokens": 10, "temperature": 0, "stop": [stop]}),
    );
    let c = &body["choices"][0];
    let first = free.iter().position(|&t| format!("w{t}") == stop).unwrap();
    let mut want = server.words(&free[..first]);
    if first > 0 {
        want.push(' ');
    }
    assert_eq!(c["text"], want, "text up to the stop string");
    assert_eq!(c["finish_reason"], "stop");
    assert_eq!(c["stop_reason"], stop);
}

#[test]
fn bad_requests_get_openai_errors() {
    let server = Server::start(64);
    let cases = [
        ("/v1/completions", "{\"prompt\": ", 400, None),
        (
            "/v1/completions",
            "{\"prompt\": \"w5\", \"temperature\": \"hot\"}",
            400,
            Some("temperature"),
        ),
        (
            "/v1/completions",
            "{\"prompt\": \"w5\", \"n\": 99}",
            400,
            Some("n"),
        ),
        (
            "/v1/completions",
            "{\"prompt\": \"w5\", \"max_tokens\": 500}",
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            "{\"prompt\": \"w5\", \"model\": \"gpt-9\"}",
            404,
            Some("model"),
        ),
        ("/v1/completions", "{\"prompt\": [200]}", 400, None),
        ("/v1/completions", "{\"prompt\": \"\"}", 400, Some("prompt")),
        (
            "/v1/chat/completions",
            "{\"messages\": []}",
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            "{\"messages\": [{\"role\": \"user\", \"content\": \"w5\"}], \"top_logprobs\": 2}",
            400,
            Some("top_logprobs"),
        ),
        ("/v1/nothing", "{}", 404, None),
    ];
    for (path, body, status, param) in cases {
        let (got, text) = server.request("POST", path, body);
        assert_eq!(got, status, "{path} {body}: {text}");
        let err: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(err["error"]["code"], status, "{text}");
        assert!(
            err["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
        assert_eq!(err["error"]["param"].as_str(), param, "{text}");
    }
    let long = (0..130)
        .map(|i| format!("w{}", 3 + i % 100))
        .collect::<Vec<_>>()
        .join(" ");
    let (status, body) = server.post("/v1/completions", json!({"prompt": long}));
    assert_eq!(status, 400);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("maximum context length is 128")
    );
}

#[test]
fn tokenize_and_detokenize_round_trip() {
    let server = Server::start(64);
    let (status, t) = server.post("/tokenize", json!({"prompt": "w7 w8 w9"}));
    assert_eq!(status, 200);
    assert_eq!(t["tokens"], json!([7, 8, 9]));
    assert_eq!(t["count"], 3);
    let (_, t) = server.post(
        "/tokenize",
        json!({"messages": [{"role": "user", "content": "w7"}]}),
    );
    assert_eq!(t["tokens"], json!([7, 3]));
    let (_, d) = server.post("/detokenize", json!({"tokens": [7, 8, 9]}));
    assert_eq!(d["prompt"], "w7 w8 w9");
    let (status, _) = server.post("/detokenize", json!({"tokens": [500]}));
    assert_eq!(status, 400);
    let (status, _) = server.request("GET", "/health", "");
    assert_eq!(status, 200);
}

#[test]
fn a_client_that_disconnects_mid_stream_leaves_no_blocks_held() {
    // One token per step: the request runs for a while.
    let server = Server::start(1);
    let body = json!({"prompt": "w5 w6 w7", "max_tokens": 100, "stream": true,
                      "ignore_eos": true, "temperature": 0.7, "seed": 1})
    .to_string();
    let mut s = TcpStream::connect(server.addr).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut first = [0u8; 64];
    let n = s.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
    drop(s);
    // The tiny model may finish the 100 tokens before the server notices the closed socket;
    // either way nothing may stay running or hold blocks. (The real model's test in
    // crates/ferrotron/tests/serve.rs sees the cancellation itself.)
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let ended = |s: &Server| {
        s.metric("ferrotron:request_success_total{finished_reason=\"abort\"}")
            + s.metric("ferrotron:request_success_total{finished_reason=\"length\"}")
    };
    while ended(&server) < 1.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the request never ended"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(server.metric("ferrotron:num_requests_running"), 0.0);
    assert_eq!(server.metric("ferrotron:kv_cache_usage_perc"), 0.0);
}

#[test]
fn shutdown_lets_the_request_it_accepted_finish() {
    let mut server = Server::start(1);
    let addr = server.addr;
    let client = std::thread::spawn(move || {
        let body = json!({"prompt": "w5 w6", "max_tokens": 40, "ignore_eos": true,
                          "temperature": 0})
        .to_string();
        let mut s = TcpStream::connect(addr).unwrap();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    });
    // Stop once the engine has the request (the tiny model may finish it before the stop).
    while server.metric("ferrotron:num_requests_running") < 1.0
        && server.metric("ferrotron:generation_tokens_total") < 1.0
    {
        std::thread::sleep(Duration::from_millis(1));
    }
    server.stop();
    let out = client.join().unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    let body: Value = serde_json::from_str(out.split_once("\r\n\r\n").unwrap().1).unwrap();
    assert_eq!(body["usage"]["completion_tokens"], 40);
    assert!(TcpStream::connect(addr).is_err(), "the listener is closed");
}

#[test]
fn echo_with_logprobs_scores_the_prompt_too() {
    let server = Server::start(4);
    let prompt = "w5 w17 w33 w8 w90 w41";
    let (status, body) = server.post(
        "/v1/completions",
        json!({"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": true,
               "logprobs": 2, "ignore_eos": true}),
    );
    assert_eq!(status, 200, "{body}");
    let c = &body["choices"][0];
    let want = server.greedy(&ids(prompt), 3);
    assert!(c["text"].as_str().unwrap().starts_with(prompt));
    let lp = &c["logprobs"];
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens.len(), 6 + 3);
    assert_eq!(tokens[..6], ["w5", "w17", "w33", "w8", "w90", "w41"]);
    assert_eq!(tokens[6], format!("w{}", want[0]));
    assert!(lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null());
    for i in 1..9 {
        assert!(lp["token_logprobs"][i].as_f64().unwrap() <= 0.0);
        assert_eq!(lp["top_logprobs"][i].as_object().unwrap().len(), 2);
    }
}
