//! The real SmolLM2-135M-Instruct Q4_1 GGUF (`FERROTRON_SMOLLM2_GGUF`) run directly, its
//! quantized weights kept in their blocks: the bytes held are the file's, logits and perplexity
//! agree with the same model dequantized (`ferrotron convert gguf-to-hf`, which matches
//! transformers), and `generate` / `serve` answer from the file alone. Without the variable the
//! tests are reported as ignored (`common::weights`).

use ferrotron_checkpoint::gguf::{GgufFile, load_gguf_model};
use ferrotron_model::families::load_hf_model;
use ferrotron_model::{
    GptModel, KvCache, LogitsMode, NewTokens, PagedKvCache, RaggedBatch, RaggedSeq,
};
use ferrotron_tensor::DType;
use serde_json::Value;

mod common;
use common::weights::{self, GGUF, trials};
use common::{ferrotron, model_dir};

fn main() {
    weights::run(trials![needs [GGUF]:
        quantized_weights_stay_in_their_blocks,
        logits_agree_with_the_dequantized_model,
        a_request_computes_the_same_in_any_batch,
        perplexity_agrees_with_the_dequantized_model,
        generate_answers_from_the_gguf_file_alone,
        lora_trains_on_the_quantized_base,
    ]);
}

/// Genesis 1:1-13 (KJV), about 300 SmolLM2 tokens.
const GENESIS: &str = "In the beginning God created the heaven and the earth. And the earth was \
    without form, and void; and darkness was upon the face of the deep. And the Spirit of God \
    moved upon the face of the waters. And God said, Let there be light: and there was light. \
    And God saw the light, that it was good: and God divided the light from the darkness. And \
    God called the light Day, and the darkness he called Night. And the evening and the morning \
    were the first day. And God said, Let there be a firmament in the midst of the waters, and \
    let it divide the waters from the waters. And God made the firmament, and divided the \
    waters which were under the firmament from the waters which were above the firmament: and \
    it was so. And God called the firmament Heaven. And the evening and the morning were the \
    second day. And God said, Let the waters under the heaven be gathered together unto one \
    place, and let the dry land appear: and it was so. And God called the dry land Earth; and \
    the gathering together of the waters called he Seas: and God saw that it was good. And God \
    said, Let the earth bring forth grass, the herb yielding seed, and the fruit tree yielding \
    fruit after his kind, whose seed is in itself, upon the earth: and it was so. And the earth \
    brought forth grass, and herb yielding seed after his kind, and the tree yielding fruit, \
    whose seed was in itself, after his kind: and God saw that it was good. And the evening and \
    the morning were the third day.";

fn gguf() -> std::path::PathBuf {
    weights::path(GGUF)
}

fn quantized_weights_stay_in_their_blocks() {
    let file = GgufFile::open(gguf()).unwrap();
    let quantized: usize = file
        .tensors()
        .iter()
        .filter(|t| t.ggml_type.quant_type().is_some())
        .map(|t| file.tensor_data(&t.name).unwrap().len())
        .sum();
    let loaded = load_gguf_model(&gguf(), DType::F32).unwrap();
    let table = loaded.model.param_table();
    // Every quantized byte of the file is held once (q/k/v and gate/up fused, rows reordered),
    // nothing dequantized: the dense storage is the 61 f32 norm gains of 576 values.
    assert_eq!(table.quantized_bytes(), quantized);
    assert_eq!(table.storage_bytes(), 61 * 576 * 4);
    assert_eq!(loaded.type_counts["Q4_1"], 210);
}

/// Last-position logits of `ids` after running them in pieces of `piece` tokens.
fn logits(model: &GptModel, ids: &[u32], piece: usize) -> Vec<f32> {
    let mut cache = KvCache::new(model.config(), 1, ids.len()).unwrap();
    let mut last = Vec::new();
    for p in ids.chunks(piece) {
        last = model.forward(p, &mut cache, LogitsMode::Last).unwrap();
    }
    last
}

fn logits_agree_with_the_dequantized_model() {
    let (dense, _) = load_hf_model(model_dir(), DType::F32).unwrap();
    let (bf16, _) = load_hf_model(model_dir(), DType::BF16).unwrap();
    let quant = load_gguf_model(&gguf(), DType::F32).unwrap();
    let ids = tokenizer_ids(&quant, GENESIS);
    let ids = &ids[..64];
    let want = logits(&dense, ids, 64);
    let max_diff = |got: &[f32]| {
        got.iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max)
    };
    // The yardstick: the same dequantized weights rounded to bf16 and multiplied in bf16.
    let bf16_diff = max_diff(&logits(&bf16, ids, 64));
    // A 64-token prompt multiplies in bf16; one token at a time takes the int8 decode kernels
    // (activations quantized per 32 values, as llama.cpp's Q8_0).
    for (piece, factor) in [(64, 1.5), (1, 4.0)] {
        let got = logits(&quant.model, ids, piece);
        let diff = max_diff(&got);
        println!("pieces of {piece}: max |logit diff| {diff} (bf16 model: {bf16_diff})");
        assert!(
            diff < factor * bf16_diff,
            "pieces of {piece}: {diff} vs bf16 {bf16_diff}"
        );
        let argmax = ferrotron_tensor::ops::argmax;
        assert_eq!(argmax(&got), argmax(&want), "pieces of {piece}");
    }
}

/// A served request computes what `generate` computes whatever its step holds: its prompt
/// rows through the dequantized tiles (also a prompt's last rows after a prefix-cache hit),
/// its generated rows through int8 dot products even beside 23 other decodes (more rows
/// than [`ferrotron_tensor::quant::INT8_MAX_ROWS`], where the choice by number would take
/// the tiles): logits bit for bit.
fn a_request_computes_the_same_in_any_batch() {
    let loaded = load_gguf_model(&gguf(), DType::F32).unwrap();
    let model = &loaded.model;
    let ids = tokenizer_ids(&loaded, GENESIS);
    let (prompt, generated) = (&ids[..40], &ids[40..43]);
    let mut cache = KvCache::new(model.config(), 1, 64).unwrap();
    let mut want = vec![
        (model)
            .forward_with_lora(
                prompt,
                &mut cache,
                LogitsMode::Last,
                None,
                NewTokens::Prompt,
            )
            .unwrap(),
    ];
    for &t in generated {
        let new = NewTokens::Generated;
        want.push(
            model
                .forward_with_lora(&[t], &mut cache, LogitsMode::Last, None, new)
                .unwrap(),
        );
    }
    // The request in blocks 0..3, 23 others of 2-token prompts in blocks 3.., 16 per block.
    let others = 23;
    let mut paged = PagedKvCache::new(model.config(), 16, 3 + others).unwrap();
    let seq = |num_tokens, context_len, table: Vec<u32>, prompt_len| RaggedSeq {
        num_tokens,
        context_len,
        block_table: table,
        num_logits: 1,
        row_by_row: false,
        adapter: None,
        prompt_len,
    };
    let request = |n, ctx| seq(n, ctx, vec![0, 1, 2], prompt.len());
    let other = |i: usize, n, ctx| seq(n, ctx, vec![3 + i as u32], 2);
    // The prompt's first 32 tokens alone, its last 8 beside the others' prompts.
    let mut step = |tokens: Vec<u32>, seqs| {
        let batch = RaggedBatch { tokens, seqs };
        model.forward_paged(&batch, &mut paged).unwrap()
    };
    step(prompt[..32].to_vec(), vec![request(32, 0)]);
    let v = model.config().vocab_size;
    let mut tokens = prompt[32..].to_vec();
    let mut seqs = vec![request(8, 32)];
    for i in 0..others {
        tokens.extend_from_slice(&ids[100 + 2 * i..102 + 2 * i]);
        seqs.push(other(i, 2, 0));
    }
    let got = step(tokens, seqs);
    assert!(
        got[..v] == want[0][..],
        "the prompt's logits after a cached prefix"
    );
    for (k, &t) in generated.iter().enumerate() {
        let mut tokens = vec![t];
        let mut seqs = vec![request(1, prompt.len() + k)];
        for i in 0..others {
            tokens.push(ids[200 + i]);
            seqs.push(other(i, 1, 2 + k));
        }
        let got = step(tokens, seqs);
        assert!(
            got[..v] == want[k + 1][..],
            "generated token {k} beside {others} decodes"
        );
    }
}

/// `text` encoded by the tokenizer the GGUF file's metadata describes.
fn tokenizer_ids(model: &ferrotron_checkpoint::gguf::GgufModel, text: &str) -> Vec<u32> {
    let json = serde_json::to_string(&model.tokenizer.tokenizer_json).unwrap();
    let tok = ferrotron_data::Tokenizer::from_json(&json, &gguf()).unwrap();
    tok.encode(text, true).unwrap()
}

/// `ferrotron perplexity --json` of GENESIS in windows of 64.
fn perplexity(model: &str, extra: &[&str]) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("genesis.txt");
    std::fs::write(&text, GENESIS).unwrap();
    let mut args = vec![
        "perplexity",
        "--model",
        model,
        "--file",
        text.to_str().unwrap(),
    ];
    args.extend(["--ctx-size", "64", "--json"]);
    args.extend(extra);
    let o = ferrotron(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["chunks"].as_u64().unwrap() >= 4, "{v}");
    v["ppl"].as_f64().unwrap()
}

fn perplexity_agrees_with_the_dequantized_model() {
    let want = perplexity(model_dir().to_str().unwrap(), &[]);
    let file = gguf();
    for extra in [&[][..], &["--ubatch-size", "16"]] {
        let got = perplexity(file.to_str().unwrap(), extra);
        println!("perplexity {extra:?}: GGUF direct {got}, dequantized {want}");
        assert!(
            (got / want - 1.0).abs() < 0.02,
            "{extra:?}: {got} vs {want}"
        );
    }
}

fn generate_answers_from_the_gguf_file_alone() {
    let file = gguf();
    let o = ferrotron(&[
        "generate",
        "--model",
        file.to_str().unwrap(),
        "--prompt",
        "The capital of France is",
        "--max-new-tokens",
        "8",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["text"].as_str().unwrap().starts_with(" Paris."), "{v}");
    // The chat template comes from the file's metadata.
    let o = ferrotron(&[
        "generate",
        "--model",
        file.to_str().unwrap(),
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-new-tokens",
        "16",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["text"].as_str().unwrap().contains("Paris"), "{v}");
}

/// (loss, gradients) of `model` predicting `ids[1..]` from `ids[..n-1]`.
fn loss_and_grads(model: &GptModel, ids: &[u32]) -> (f64, Vec<Vec<f32>>) {
    let s = ids.len() - 1;
    let labels: Vec<i64> = ids[1..].iter().map(|&t| t as i64).collect();
    let batch = ferrotron_model::TrainBatch::from_batch_major(&ids[..s], &labels, None, 1, s);
    let mut g = model.zero_grads();
    let mut views: Vec<&mut [f32]> = g.iter_mut().map(|g| g.as_mut_slice()).collect();
    let stats = model.forward_backward(&batch, &mut views, 1.0).unwrap();
    (stats.loss_sum / stats.loss_count, g)
}

/// LoRA on the quantized base (issue 19: "base weights frozen ... or loaded from a quantized
/// GGUF"): the blocks stay as they are, loss and adapter gradients agree with the same
/// adapters on the dequantized weights (the prompt's matmuls run on bf16 tiles, hence the
/// tolerance), and steps on the adapters lower the loss.
fn lora_trains_on_the_quantized_base() {
    use ferrotron_model::module::ParamRole;
    use ferrotron_model::{InitConfig, LoraConfig};
    let quant = load_gguf_model(&gguf(), DType::F32).unwrap();
    let ids = tokenizer_ids(&quant, GENESIS);
    let ids = &ids[..129];
    let table = quant.model.param_table();
    let blocks = table.quantized_bytes();
    let dense_values = (0..table.len())
        .map(|i| {
            ferrotron_tensor::Tensor::from_f32(table.shape(i), table.f32_values(i).into_owned())
        })
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let dense = GptModel::new(quant.model.config().clone(), dense_values).unwrap();
    let lora = LoraConfig {
        rank: 8,
        alpha: 16.0,
        ..LoraConfig::default()
    };
    let init = InitConfig::default();
    let mut q = quant.model.with_lora(lora.clone(), &init).unwrap();
    let d = dense.with_lora(lora, &init).unwrap();
    assert_eq!(q.param_table().quantized_bytes(), blocks);
    let (q_loss, q_grads) = loss_and_grads(&q, ids);
    let (d_loss, d_grads) = loss_and_grads(&d, ids);
    println!("loss on the quantized base {q_loss}, on the dequantized weights {d_loss}");
    // (The 128-row matmuls round activations to bf16: ~0.4% on this loss.)
    assert!(
        (q_loss - d_loss).abs() < 1e-2 * d_loss,
        "{q_loss} vs {d_loss}"
    );
    let adapters: Vec<usize> = (0..q_grads.len())
        .filter(|&i| q.layout().decls()[i].role == ParamRole::Adapter)
        .collect();
    assert_eq!(adapters.len(), 30 * 4 * 2);
    let mut worst = 0f64;
    for &i in &adapters {
        let (a, b) = (&q_grads[i], &d_grads[i]);
        let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        let diff: Vec<f32> = a.iter().zip(b).map(|(x, y)| x - y).collect();
        let rel = norm(&diff) / norm(b).max(1e-12);
        worst = worst.max(rel);
        assert!(
            rel < 0.1,
            "{}: relative gradient difference {rel}",
            q.parameters()[i].name
        );
    }
    println!("largest relative adapter-gradient difference: {worst:.3}");
    // Plain SGD on the adapters: the loss falls.
    let mut loss = q_loss;
    let mut grads = q_grads;
    for _ in 0..3 {
        let values: Vec<Vec<f32>> = adapters
            .iter()
            .map(|&i| {
                let w = q.parameter_f32(i).unwrap();
                w.iter().zip(&grads[i]).map(|(w, g)| w - 0.05 * g).collect()
            })
            .collect();
        let at = |i: usize| adapters.iter().position(|&a| a == i).unwrap();
        q.load_parameters_with(&adapters, |i| std::borrow::Cow::Borrowed(&values[at(i)]))
            .unwrap();
        let (l, g) = loss_and_grads(&q, ids);
        assert!(l < loss, "{l} after {loss}");
        (loss, grads) = (l, g);
    }
}
