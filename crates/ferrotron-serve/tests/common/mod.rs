//! What the server tests share: the tiny LLaMA fixture served with a word-level tokenizer
//! written beside it (`w3 w4 ...` is token ids 3, 4, ...) on loopback, raw HTTP/1.1 requests,
//! and `generate` to compare with.

#![allow(dead_code)] // each test file uses its own part

use ferrotron_data::Tokenizer;
use ferrotron_data::chat::ChatTemplate;
use ferrotron_infer::engine::{Engine, EngineConfig, EngineHandle, SchedulerConfig};
use ferrotron_infer::sampler::SamplingParams;
use ferrotron_infer::{GenerateOptions, generate};
use ferrotron_model::GptModel;
use ferrotron_model::families::load_hf_model;
use ferrotron_model::lora::LoraWeights;
use ferrotron_serve::{AppState, LoraRegistry, ServedModel};
use ferrotron_tensor::DType;
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

pub const VOCAB: usize = 112;
pub const EOS: u32 = 2;

/// tokenizer.json: `<unk>`, `<s>`, `</s>`, then `w3`..`w111`, split on whitespace.
pub fn write_tokenizer(dir: &Path) {
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

pub struct Server {
    pub addr: SocketAddr,
    pub model: Arc<GptModel>,
    pub tokenizer: Arc<Tokenizer>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl Server {
    pub fn start(max_num_batched_tokens: usize) -> Server {
        Server::start_with(max_num_batched_tokens, &[], false)
    }

    /// A server with the LoRA adapters `adapters` (name, PEFT directory) loaded at start,
    /// and runtime loading allowed when `runtime_lora_updating`.
    pub fn start_with(
        max_num_batched_tokens: usize,
        adapters: &[(&str, &Path)],
        runtime_lora_updating: bool,
    ) -> Server {
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
        let registry = LoraRegistry::new(model.clone(), "tiny", runtime_lora_updating);
        for (name, dir) in adapters {
            registry.load(name, dir).unwrap();
        }
        let state = Arc::new(AppState::new(served, engine, registry, 4));
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
    pub fn request(&self, method: &str, path: &str, body: &str) -> (u16, String) {
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

    pub fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let (status, text) = self.request("POST", path, &body.to_string());
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    pub fn metric(&self, name: &str) -> f64 {
        let (_, page) = self.request("GET", "/metrics", "");
        let line = page.lines().find(|l| l.starts_with(name)).unwrap();
        line.rsplit(' ').next().unwrap().parse().unwrap()
    }

    pub fn stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }

    pub fn words(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, true).unwrap()
    }

    pub fn greedy(&self, prompt: &[u32], max: usize) -> Vec<u32> {
        greedy_of(&self.model, None, prompt, max)
    }
}

/// `generate`'s greedy tokens of `model` with the LoRA adapter `lora` after `prompt`,
/// stopping at EOS.
pub fn greedy_of(
    model: &GptModel,
    lora: Option<Arc<LoraWeights>>,
    prompt: &[u32],
    max: usize,
) -> Vec<u32> {
    let options = GenerateOptions {
        max_new_tokens: max,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![EOS],
        lora,
    };
    generate(model, prompt, &options, &mut |_| ControlFlow::Continue(()))
        .unwrap()
        .generated_ids
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The body of a chunked transfer encoding.
pub fn dechunk(mut rest: &str) -> String {
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
pub fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: ").or(l.strip_prefix("data:")))
        .map(str::to_string)
        .collect()
}

pub fn ids(text: &str) -> Vec<u32> {
    text.split_whitespace()
        .map(|w| w[1..].parse().unwrap())
        .collect()
}
