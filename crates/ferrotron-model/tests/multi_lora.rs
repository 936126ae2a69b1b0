//! Several LoRA adapters served over one base in one ragged batch ([`LoraWeights`],
//! [`RaggedSeq::adapter`]): a sequence alone gets bit for bit the logits of
//! [`GptModel::forward_with_lora`] (what `generate` runs), at prefill and at every decode
//! step, and those of the model with its adapter built in ([`GptModel::with_lora`]) to float
//! rounding; sequences of different adapters and of none, batched together, each get their solo logits
//! within float rounding; an adapter made for another base is refused. LLaMA (GQA) and
//! Qwen2 (q/k/v biases).

use ferrotron_model::lora::LoraWeights;
use ferrotron_model::{
    GptModel, InitConfig, KvCache, LogitsMode, LoraConfig, NewTokens, PagedKvCache, RaggedBatch,
    RaggedSeq,
};
use std::collections::HashMap;
use std::sync::Arc;

mod common;
use common::{fixture, randomize_adapter_outputs, tokens};

const FAMILIES: [&str; 2] = ["tiny-llama", "tiny-qwen2"];
const BLOCK: usize = 4;

fn lora() -> LoraConfig {
    LoraConfig {
        target_modules: vec![
            "linear_qkv".into(),
            "linear_fc1".into(),
            "*.layers.1.*.linear_proj".into(),
        ],
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
    }
}

/// The base of `name` with the adapter of seed `seed` built in (`linear_out` random too: a
/// fresh one is zero).
fn adapted(name: &str, seed: u64) -> GptModel {
    let init = InitConfig {
        seed,
        ..InitConfig::default()
    };
    let mut model = fixture(name).with_lora(lora(), &init).unwrap();
    randomize_adapter_outputs(&mut model, seed);
    model
}

/// `adapted`'s adapter as served weights over `base`, through its PEFT tensors.
fn served(base: &GptModel, adapted: &GptModel) -> Arc<LoraWeights> {
    let tensors: HashMap<String, _> = adapted
        .peft_tensors()
        .unwrap()
        .into_iter()
        .map(|t| (t.name.clone(), t))
        .collect();
    let weights = base
        .lora_weights_from_peft(4, 8.0, |n| tensors.get(n).cloned())
        .unwrap();
    Arc::new(weights)
}

fn seq(n: usize, ctx: usize, table: Vec<u32>, adapter: Option<&Arc<LoraWeights>>) -> RaggedSeq {
    RaggedSeq {
        num_tokens: n,
        context_len: ctx,
        block_table: table,
        num_logits: 1,
        row_by_row: false,
        adapter: adapter.cloned(),
        // A sequence's first chunk is its prompt, later ones generated tokens.
        prompt_len: if ctx == 0 { n } else { ctx },
    }
}

/// Last-row logits of each chunk fed to `model` (with `lora`) through a contiguous cache: the
/// first chunk a prompt, the others generated tokens.
fn solo_with(model: &GptModel, lora: Option<&LoraWeights>, chunks: &[&[u32]]) -> Vec<Vec<f32>> {
    let total = chunks.iter().map(|c| c.len()).sum();
    let mut cache = KvCache::new(model.config(), 1, total).unwrap();
    chunks
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let new = if i == 0 {
                NewTokens::Prompt
            } else {
                NewTokens::Generated
            };
            model
                .forward_with_lora(c, &mut cache, LogitsMode::Last, lora, new)
                .unwrap()
        })
        .collect()
}

fn solo(model: &GptModel, chunks: &[&[u32]]) -> Vec<Vec<f32>> {
    solo_with(model, None, chunks)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

#[test]
fn a_lone_sequence_matches_the_model_with_its_adapter_built_in() {
    for name in FAMILIES {
        let base = fixture(name);
        let with = adapted(name, 11);
        let weights = served(&base, &with);
        assert_eq!(weights.num_adapted(), 2 * 2 + 1);
        let ids = tokens(base.config().vocab_size, 3, 14);
        let chunks: Vec<&[u32]> = std::iter::once(&ids[..11])
            .chain(ids[11..].chunks(1))
            .collect();
        let want = solo_with(&base, Some(&weights), &chunks);
        assert_ne!(
            want,
            solo(&base, &chunks),
            "{name}: the adapter changes nothing"
        );
        for (w, built_in) in want.iter().zip(solo(&with, &chunks)) {
            let diff = max_diff(w, &built_in);
            assert!(diff < 1e-5, "{name}: {diff} from the built-in adapter");
        }
        let mut cache = PagedKvCache::new(base.config(), BLOCK, 8).unwrap();
        let mut ctx = 0;
        for (chunk, want) in chunks.iter().zip(&want) {
            let batch = RaggedBatch {
                tokens: chunk.to_vec(),
                seqs: vec![seq(chunk.len(), ctx, vec![5, 1, 7, 2], Some(&weights))],
            };
            let got = base.forward_paged(&batch, &mut cache).unwrap();
            assert!(got == *want, "{name}: logits differ at position {ctx}");
            ctx += chunk.len();
        }
    }
}

#[test]
fn sequences_of_several_adapters_share_a_batch() {
    for name in FAMILIES {
        let base = fixture(name);
        let (with_x, with_y) = (adapted(name, 21), adapted(name, 22));
        let (x, y) = (served(&base, &with_x), served(&base, &with_y));
        let v = base.config().vocab_size;
        let prompts: Vec<Vec<u32>> = (0..4)
            .map(|i| tokens(v, 40 + i, 5 + 2 * i as usize))
            .collect();
        // Two sequences of x side by side (one row range), the base, then y.
        let adapters = [Some(&x), Some(&x), None, Some(&y)];
        let models = [&with_x, &with_x, &base, &with_y];
        let mut cache = PagedKvCache::new(base.config(), BLOCK, 16).unwrap();
        let batch = RaggedBatch {
            tokens: prompts.concat(),
            seqs: (0..4)
                .map(|i| {
                    let table = (4 * i as u32..4 * i as u32 + 4).collect();
                    seq(prompts[i].len(), 0, table, adapters[i])
                })
                .collect(),
        };
        let got = base.forward_paged(&batch, &mut cache).unwrap();
        for (i, g) in got.chunks_exact(v).enumerate() {
            let diff = max_diff(g, &solo(models[i], &[&prompts[i]])[0]);
            assert!(diff < 1e-4, "{name} sequence {i}: max |diff| {diff}");
        }
    }
}

#[test]
fn an_adapter_of_another_base_is_refused() {
    let llama = fixture("tiny-llama");
    let qwen = fixture("tiny-qwen2");
    let weights = served(&qwen, &adapted("tiny-qwen2", 5));
    let mut cache = PagedKvCache::new(llama.config(), BLOCK, 4).unwrap();
    let batch = RaggedBatch {
        tokens: vec![1, 2, 3],
        seqs: vec![seq(3, 0, vec![0], Some(&weights))],
    };
    let err = llama.forward_paged(&batch, &mut cache).unwrap_err();
    assert!(err.to_string().contains("another base model"), "{err}");
    let err = llama.lora_weights_from_peft(4, 8.0, |_| None).unwrap_err();
    assert!(err.to_string().contains("adapts none"), "{err}");
}
