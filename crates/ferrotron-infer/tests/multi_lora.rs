//! LoRA adapters per request on the committed PEFT fixture (`fixtures/lora/tiny-llama`): a
//! lone request with an adapter reproduces `generate` with that adapter, token for token, and
//! so does the model with the adapter built in (`PeftAdapter::apply_to`) on these prompts;
//! requests of two adapters and of none, running
//! together, each get their solo output; the prefix cache never serves one adapter's blocks
//! to another; an adapter of another base is refused by name.

use ferrotron_checkpoint::peft::PeftAdapter;
use ferrotron_infer::engine::{Engine, LoraRequest, Request};
use ferrotron_infer::sampler::SamplingParams;
use ferrotron_model::GptModel;
use std::path::PathBuf;
use std::sync::Arc;

mod common;
use common::*;

fn adapter(name: &str) -> PeftAdapter {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/lora")
        .join(name);
    PeftAdapter::read(&dir).unwrap()
}

/// The fixture's adapter (`x`), and one with twice its `alpha` (`y`): two adapters of one
/// base, as requests name them.
fn two_adapters(base: &GptModel) -> [(PeftAdapter, LoraRequest); 2] {
    let x = adapter("tiny-llama");
    let mut y = x.clone();
    y.alpha *= 2.0;
    [(x, "x", 1), (y, "y", 2)].map(|(a, name, id)| {
        let weights = Arc::new(a.served_weights(base).unwrap());
        let request = LoraRequest {
            name: name.into(),
            id,
            weights,
        };
        (a, request)
    })
}

fn request(id: u64, prompt: &[u32], max_tokens: usize, lora: Option<&LoraRequest>) -> Request {
    Request {
        id,
        prompt: prompt.to_vec(),
        params: greedy(max_tokens),
        lora: lora.cloned(),
    }
}

#[test]
fn requests_of_several_adapters_get_their_solo_outputs() {
    let base = model("tiny-llama");
    let v = base.config().vocab_size;
    let [(x, lx), (y, ly)] = two_adapters(&base);
    let with_x = x.apply_to((*base).clone()).unwrap();
    let with_y = y.apply_to((*base).clone()).unwrap();
    let p = prompt(5, 19, v);
    let want_x = solo_generate(&with_x, &p, 12, SamplingParams::greedy());
    let want_y = solo_generate(&with_y, &p, 12, SamplingParams::greedy());
    let want_base = solo_generate(&base, &p, 12, SamplingParams::greedy());
    assert!(
        want_x != want_base && want_y != want_x,
        "the adapters change nothing"
    );

    // Alone: token for token.
    let blocks = base.config().max_position_embeddings.div_ceil(4) + 8;
    let mut engine = Engine::new(base.clone(), config(blocks, 64, true)).unwrap();
    let out = submit_request(&mut engine, request(0, &p, 12, Some(&lx)));
    run_to_end(&mut engine);
    assert_eq!(tokens(&out), want_x);

    // Together, under a small token budget (chunked prefill beside decodes); x's blocks of
    // the first run are cached, but only x may hit them.
    let mut engine = Engine::new(base.clone(), config(blocks, 16, true)).unwrap();
    let first = submit_request(&mut engine, request(1, &p, 12, Some(&lx)));
    run_to_end(&mut engine);
    assert_eq!(first.lock().unwrap()[0].cached_tokens, 0);
    let loras = [Some(&ly), None, Some(&lx), Some(&ly)];
    let outs: Vec<_> = loras
        .iter()
        .zip(10..)
        .map(|(l, id)| submit_request(&mut engine, request(id, &p, 12, *l)))
        .collect();
    run_to_end(&mut engine);
    let wants = [&want_y, &want_base, &want_x, &want_y];
    for (i, (out, want)) in outs.iter().zip(wants).enumerate() {
        assert_eq!(tokens(out), *want, "request {i}");
    }
    let cached: Vec<usize> = outs
        .iter()
        .map(|o| o.lock().unwrap()[0].cached_tokens)
        .collect();
    // x hits the blocks of its first run, the second y those the first y committed before it
    // was admitted (a step runs 16 tokens); the base and the first y find none of theirs.
    assert_eq!(cached, [0, 0, 16, 16]);
}

#[test]
fn an_adapter_of_another_base_is_refused_by_name() {
    let llama = model("tiny-llama");
    let bloom = model("tiny-bloom");
    let weights = Arc::new(adapter("tiny-llama").served_weights(&llama).unwrap());
    let blocks = bloom.config().max_position_embeddings.div_ceil(4);
    let mut engine = Engine::new(bloom.clone(), config(blocks, 64, true)).unwrap();
    let lora = LoraRequest {
        name: "llama-adapter".into(),
        id: 3,
        weights,
    };
    let sink = Box::new(|_| std::ops::ControlFlow::Continue(()));
    let err = engine
        .add_request(request(0, &[1, 2, 3], 4, Some(&lora)), sink)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("llama-adapter") && err.contains("another base"),
        "{err}"
    );
    // A PEFT adapter whose matrices do not fit names the tensor.
    let mut wrong_rank = adapter("tiny-llama");
    wrong_rank.rank = 3;
    let err = wrong_rank.served_weights(&llama).unwrap_err().to_string();
    assert!(
        err.contains("lora_A.weight") && err.contains("[3, "),
        "{err}"
    );
}
