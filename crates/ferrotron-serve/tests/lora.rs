//! LoRA adapters over HTTP, with the committed PEFT fixture on the tiny LLaMA: `model` selects
//! an adapter loaded at start (greedy output equal to `generate` with the adapter, the
//! response naming the adapter), `/v1/models` lists adapters with their parent,
//! adapters load and unload at run time (vLLM's endpoints and messages) only when the server
//! allows it, and bad names and paths get OpenAI errors.

use ferrotron_checkpoint::peft::PeftAdapter;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod common;
use common::*;

fn adapter_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/lora/tiny-llama")
}

fn complete(server: &Server, model: &str, prompt: &str) -> (u16, Value) {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0});
    server.post("/v1/completions", body)
}

#[test]
fn a_request_selects_its_adapter_by_model_name() {
    let dir = adapter_dir();
    let server = Server::start_with(64, &[("x", &dir)], false);
    let prompt = "w5 w17 w33 w8 w90 w41";
    let x = PeftAdapter::read(&dir).unwrap();
    let weights = x.served_weights(&server.model).unwrap();
    let want_x = greedy_of(&server.model, Some(Arc::new(weights)), &ids(prompt), 10);
    let want_base = server.greedy(&ids(prompt), 10);
    assert_ne!(want_x, want_base, "the adapter changes nothing");
    for (model, want) in [("x", &want_x), ("tiny", &want_base), ("x", &want_x)] {
        let (status, body) = complete(&server, model, prompt);
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["model"], model);
        assert_eq!(body["choices"][0]["text"], server.words(want), "{model}");
    }
    let (status, models) = server.request("GET", "/v1/models", "");
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    let data = models["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    assert_eq!(
        (&data[1]["id"], &data[1]["parent"]),
        (&json!("x"), &json!("tiny"))
    );
    assert_eq!(data[1]["root"], dir.to_string_lossy().as_ref());
    assert_eq!(
        server.metric("ferrotron:lora_requests_total{lora_name=\"x\"}"),
        2.0
    );
    let (status, body) = complete(&server, "y", prompt);
    assert_eq!((status, &body["error"]["param"]), (404, &json!("model")));
    // Loading at run time is off unless the server allows it.
    let load = json!({"lora_name": "y", "lora_path": dir});
    let (status, body) = server.post("/v1/load_lora_adapter", load);
    assert_eq!(status, 403, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--allow-runtime-lora-updating")
    );
}

#[test]
fn adapters_load_and_unload_at_run_time() {
    let dir = adapter_dir();
    let server = Server::start_with(64, &[], true);
    let prompt = "w9 w4 w61 w30";
    let load = |name: &str, path: &Path| {
        server.post(
            "/v1/load_lora_adapter",
            json!({"lora_name": name, "lora_path": path}),
        )
    };
    let (status, body) = load("y", &dir);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, "Success: LoRA adapter 'y' added successfully.");
    let (status, y) = complete(&server, "y", prompt);
    assert_eq!(status, 200, "{y}");
    // Names already served, including the base model's, are refused.
    for name in ["y", "tiny"] {
        let (status, body) = load(name, &dir);
        assert_eq!(status, 400, "{body}");
        assert_eq!(body["error"]["param"], "lora_name");
    }
    let (status, body) = load("z", Path::new("/nonexistent/adapter"));
    assert_eq!(
        (status, &body["error"]["param"]),
        (400, &json!("lora_path")),
        "{body}"
    );
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("adapter_config.json")
    );
    let (status, body) = server.post("/v1/load_lora_adapter", json!({"lora_name": "z"}));
    assert_eq!(status, 400, "{body}");
    let unload = || server.post("/v1/unload_lora_adapter", json!({"lora_name": "y"}));
    let (status, body) = unload();
    assert_eq!(
        (status, body),
        (
            200,
            json!("Success: LoRA adapter 'y' removed successfully.")
        )
    );
    assert_eq!(complete(&server, "y", prompt).0, 404);
    let (status, body) = unload();
    assert_eq!(status, 404, "{body}");
    assert_eq!(
        body["error"]["message"],
        "The lora adapter 'y' cannot be found."
    );
    // Loaded again, the same adapter gives the same output (with fresh cache blocks).
    assert_eq!(load("y", &dir).0, 200);
    let (status, again) = complete(&server, "y", prompt);
    assert_eq!(status, 200);
    assert_eq!(again["choices"][0]["text"], y["choices"][0]["text"]);
    assert_eq!(server.metric("ferrotron:lora_adapters_loaded"), 1.0);
}
