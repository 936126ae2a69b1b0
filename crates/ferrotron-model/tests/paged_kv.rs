//! The paged forward against the contiguous KV cache on the committed tiny fixtures: one
//! sequence gives bit-identical logits at every prefill and decode step (so a lone serving
//! request reproduces `generate`), and a ragged batch of sequences — decode rows beside
//! prompt chunks that start after cached tokens, blocks scattered over the pool — gives each
//! sequence its solo logits within float rounding. LLaMA (GQA), Mistral (sliding window),
//! Bloom (ALiBi), Qwen2 (biases), Mixtral and Qwen2-MoE (MoE layers, a shared expert),
//! DeepSeek-V2 (multi-latent attention, its keys and values cached per head).

use ferrotron_model::{GptModel, KvCache, LogitsMode, PagedKvCache, RaggedBatch, RaggedSeq};

mod common;
use common::{fixture, tokens};

const FAMILIES: [&str; 7] = [
    "tiny-llama",
    "tiny-mistral",
    "tiny-bloom",
    "tiny-qwen2",
    "tiny-mixtral",
    "tiny-qwen2-moe",
    "tiny-deepseek-v2",
];
const BLOCK: usize = 4;

/// Logits of each step of feeding `chunks` to a contiguous cache (last row of each chunk).
fn contiguous_steps(model: &GptModel, chunks: &[&[u32]]) -> Vec<Vec<f32>> {
    let total = chunks.iter().map(|c| c.len()).sum();
    let mut cache = KvCache::new(model.config(), 1, total).unwrap();
    chunks
        .iter()
        .map(|c| model.forward(c, &mut cache, LogitsMode::Last).unwrap())
        .collect()
}

#[test]
fn one_sequence_is_bit_identical_to_the_contiguous_cache() {
    for name in FAMILIES {
        let model = fixture(name);
        let c = model.config();
        let ids = tokens(c.vocab_size, 7, 23);
        // generate's pattern: one prefill, then one token per step.
        let chunks: Vec<&[u32]> = std::iter::once(&ids[..17])
            .chain(ids[17..].chunks(1))
            .collect();
        let want = contiguous_steps(&model, &chunks);
        let mut cache = PagedKvCache::new(c, BLOCK, 16).unwrap();
        // Blocks out of order: the table, not the pool order, decides.
        let table: Vec<u32> = vec![9, 2, 14, 5, 0, 11];
        let mut context_len = 0;
        for (chunk, want) in chunks.iter().zip(&want) {
            let batch = RaggedBatch {
                tokens: chunk.to_vec(),
                seqs: vec![RaggedSeq {
                    num_tokens: chunk.len(),
                    context_len,
                    block_table: table.clone(),
                    num_logits: 1,
                    row_by_row: false,
                    adapter: None,
                    prompt_len: 17,
                }],
            };
            let got = model.forward_paged(&batch, &mut cache).unwrap();
            assert!(
                got == *want,
                "{name}: paged logits differ at position {context_len}"
            );
            context_len += chunk.len();
        }
    }
}

#[test]
fn a_ragged_batch_gives_every_sequence_its_solo_logits() {
    for name in FAMILIES {
        let model = fixture(name);
        let c = model.config();
        let mut cache = PagedKvCache::new(c, BLOCK, 24).unwrap();
        let (a, b, d) = (
            tokens(c.vocab_size, 1, 13),
            tokens(c.vocab_size, 2, 9),
            tokens(c.vocab_size, 3, 11),
        );
        let tables: [Vec<u32>; 3] = [vec![3, 17, 8, 21], vec![0, 12, 6], vec![19, 1, 15]];
        // Step 1: a's first 10 tokens, b's 9 (no logits for a: a chunk mid-prompt).
        // Step 2: a's last 3 (a chunk after 10 cached), b decodes 1, d's first 11.
        // Step 3: a decodes 1 (its 13th), b decodes 1, d decodes 1.
        // Prompts: a's 13 tokens, b's 9, d's 11.
        let seq = |n, ctx, t: &Vec<u32>, logits, prompt_len| RaggedSeq {
            num_tokens: n,
            context_len: ctx,
            block_table: t.clone(),
            num_logits: usize::from(logits),
            row_by_row: false,
            adapter: None,
            prompt_len,
        };
        let extra = tokens(c.vocab_size, 4, 3);
        let steps = [
            RaggedBatch {
                tokens: [&a[..10], &b[..]].concat(),
                seqs: vec![
                    seq(10, 0, &tables[0], false, 13),
                    seq(9, 0, &tables[1], true, 9),
                ],
            },
            RaggedBatch {
                tokens: [&a[10..], &extra[..1], &d[..]].concat(),
                seqs: vec![
                    seq(3, 10, &tables[0], true, 13),
                    seq(1, 9, &tables[1], true, 9),
                    seq(11, 0, &tables[2], true, 11),
                ],
            },
            RaggedBatch {
                tokens: extra.to_vec(),
                seqs: vec![
                    seq(1, 13, &tables[0], true, 13),
                    seq(1, 10, &tables[1], true, 9),
                    seq(1, 11, &tables[2], true, 11),
                ],
            },
        ];
        let got: Vec<Vec<f32>> = steps
            .iter()
            .map(|s| model.forward_paged(s, &mut cache).unwrap())
            .collect();
        let v = c.vocab_size;
        let solo_a = contiguous_steps(&model, &[&a[..10], &a[10..], &extra[..1]]);
        let solo_b = contiguous_steps(&model, &[&b, &extra[..1], &extra[1..2]]);
        let solo_d = contiguous_steps(&model, &[&d, &extra[2..]]);
        let expected = [
            vec![&solo_b[0]],
            vec![&solo_a[1], &solo_b[1], &solo_d[0]],
            vec![&solo_a[2], &solo_b[2], &solo_d[1]],
        ];
        for (step, (got, want)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(got.len(), want.len() * v, "{name} step {step}: logits rows");
            for (i, (g, w)) in got.chunks_exact(v).zip(want).enumerate() {
                let diff = g
                    .iter()
                    .zip(w.iter())
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max);
                assert!(diff < 1e-4, "{name} step {step} seq {i}: max |diff| {diff}");
            }
        }
    }
}

#[test]
fn bad_batches_are_errors() {
    let model = fixture("tiny-llama");
    let c = model.config();
    let mut cache = PagedKvCache::new(c, BLOCK, 4).unwrap();
    let one = |n, ctx, table: Vec<u32>| RaggedBatch {
        tokens: tokens(c.vocab_size, 5, n),
        seqs: vec![RaggedSeq {
            num_tokens: n,
            context_len: ctx,
            block_table: table,
            num_logits: 1,
            row_by_row: false,
            adapter: None,
            prompt_len: n,
        }],
    };
    let cases = [
        (one(6, 0, vec![0]), "cannot hold 6 tokens"),
        (one(2, 0, vec![4]), "cannot hold 2 tokens in 4 blocks"),
        (
            one(2, c.max_position_embeddings - 1, vec![0; 64]),
            "max_position_embeddings",
        ),
        (
            RaggedBatch {
                tokens: vec![c.vocab_size as u32],
                seqs: one(1, 0, vec![0]).seqs,
            },
            "vocabulary size",
        ),
        (
            RaggedBatch {
                tokens: vec![1, 2],
                seqs: one(1, 0, vec![0]).seqs,
            },
            "2 tokens for 1 sequences",
        ),
    ];
    for (batch, want) in cases {
        let err = model
            .forward_paged(&batch, &mut cache)
            .unwrap_err()
            .to_string();
        assert!(err.contains(want), "{err:?} does not say {want:?}");
    }
    assert!(PagedKvCache::new(c, 0, 4).is_err());
}

/// Speculative verification: several new tokens of one sequence attended row by row give, for
/// each of them, the logits of decoding the tokens one step at a time, bit for bit.
#[test]
fn row_by_row_tokens_equal_one_decode_step_each() {
    for name in FAMILIES {
        let model = fixture(name);
        let c = model.config();
        let ids = tokens(c.vocab_size, 9, 14);
        let (prompt, rest) = ids.split_at(9);
        let table: Vec<u32> = vec![4, 1, 7, 3];
        let run = |chunks: &[&[u32]], row_by_row: bool| {
            let mut cache = PagedKvCache::new(c, BLOCK, 8).unwrap();
            let mut context_len = 0;
            let mut out = Vec::new();
            for chunk in chunks {
                let seq = RaggedSeq {
                    num_tokens: chunk.len(),
                    context_len,
                    block_table: table.clone(),
                    num_logits: if context_len == 0 { 1 } else { chunk.len() },
                    row_by_row: row_by_row && context_len > 0,
                    adapter: None,
                    prompt_len: prompt.len(),
                };
                let batch = RaggedBatch {
                    tokens: chunk.to_vec(),
                    seqs: vec![seq],
                };
                out.push(model.forward_paged(&batch, &mut cache).unwrap());
                context_len += chunk.len();
            }
            out
        };
        let one_by_one: Vec<&[u32]> = std::iter::once(prompt).chain(rest.chunks(1)).collect();
        let stepped = run(&one_by_one, false).concat();
        let verified = run(&[prompt, rest], true).concat();
        assert!(
            stepped == verified,
            "{name}: row-by-row logits differ from decode steps"
        );
    }
}
