//! The HTTP server end to end over raw HTTP/1.1 on loopback, with the tiny LLaMA fixture and
//! a word-level tokenizer written beside it (`w3 w4 ...` is token ids 3, 4, ...): responses
//! in OpenAI's shapes, greedy completions equal to `generate`, streaming with usage and
//! `[DONE]`, stop strings, errors with the right status and `param`, tokenize round trips, a
//! client that disconnects mid-stream freeing its blocks, and a shutdown that lets a request
//! in flight finish.

use serde_json::{Value, json};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

mod common;
use common::*;

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
