//! The serving engine on the committed tiny fixtures: a lone request reproduces `generate`
//! token for token; concurrent requests under a small token budget (chunked prefill) and a
//! small KV pool (preemption) each get their solo output; a repeated prompt hits the prefix
//! cache; stop tokens, length limits, cancellation and log-probabilities behave as the OpenAI
//! API says.

use ferrotron_infer::engine::{
    Engine, EngineConfig, EngineHandle, FinishReason, Request, RequestOutput, RequestParams,
    SpeculativeConfig,
};
use ferrotron_infer::sampler::{SamplingParams, log_softmax};
use ferrotron_model::{GptModel, KvCache, LogitsMode};
use std::ops::ControlFlow;
use std::sync::mpsc::{Receiver, channel};
use std::sync::{Arc, Mutex};

mod common;
use common::*;

#[test]
fn a_lone_request_reproduces_generate() {
    for name in ["tiny-llama", "tiny-mistral", "tiny-bloom"] {
        let m = model(name);
        let v = m.config().vocab_size;
        let blocks = m.config().max_position_embeddings.div_ceil(4) + 8;
        let mut engine = Engine::new(m.clone(), config(blocks, 64, true)).unwrap();
        let p = prompt(11, 21, v);
        let out = submit(&mut engine, 0, p.clone(), greedy(30));
        run_to_end(&mut engine);
        assert_eq!(
            tokens(&out),
            solo_generate(&m, &p, 30, SamplingParams::greedy()),
            "{name}"
        );
        assert_eq!(finish(&out), FinishReason::Length);
        let seeded = SamplingParams::new(false, 0.9, 20, 0.95, 1.1, 42).unwrap();
        let params = RequestParams {
            sampling: seeded,
            ..greedy(25)
        };
        let out = submit(&mut engine, 1, p.clone(), params);
        run_to_end(&mut engine);
        assert_eq!(
            tokens(&out),
            solo_generate(&m, &p, 25, seeded),
            "{name} sampled"
        );
    }
}

#[test]
fn concurrent_requests_with_chunked_prefill_and_preemption_get_their_solo_outputs() {
    let m = model("tiny-llama");
    let v = m.config().vocab_size;
    // 32 blocks of 4 = 128 tokens (the model's context) for 6 requests of up to 70 tokens: the
    // pool runs out and sequences are preempted; 8 tokens per step chunk every prompt.
    let mut engine = Engine::new(m.clone(), config(32, 8, true)).unwrap();
    let prompts: Vec<Vec<u32>> = (0..6)
        .map(|i| prompt(100 + i, 9 + 7 * i as usize, v))
        .collect();
    let outs: Vec<Outputs> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| submit(&mut engine, i as u64, p.clone(), greedy(30)))
        .collect();
    run_to_end(&mut engine);
    let stats = engine.stats();
    assert!(
        stats
            .num_preemptions_total
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0,
        "no preemption"
    );
    for (i, (p, out)) in prompts.iter().zip(&outs).enumerate() {
        let want = solo_generate(&m, p, 30, SamplingParams::greedy());
        assert_eq!(tokens(out), want, "request {i}");
        assert_eq!(
            out.lock().unwrap().len(),
            30,
            "request {i}: one output per token"
        );
    }
    assert_eq!(stats.kv_cache_usage(), 0.0, "every block released");
}

#[test]
fn a_repeated_prompt_hits_the_prefix_cache() {
    let m = model("tiny-llama");
    let p = prompt(5, 18, m.config().vocab_size);
    for caching in [true, false] {
        let mut engine = Engine::new(m.clone(), config(40, 64, caching)).unwrap();
        let first = submit(&mut engine, 0, p.clone(), greedy(5));
        run_to_end(&mut engine);
        let again = submit(&mut engine, 1, p.clone(), greedy(5));
        run_to_end(&mut engine);
        assert_eq!(tokens(&again), tokens(&first));
        let cached = again.lock().unwrap()[0].cached_tokens;
        // 18 tokens: full blocks of the first 17 -> 16 tokens.
        assert_eq!(cached, if caching { 16 } else { 0 });
        assert_eq!(first.lock().unwrap()[0].cached_tokens, 0);
    }
}

#[test]
fn stop_tokens_length_limits_and_cancellation() {
    let m = model("tiny-llama");
    let v = m.config().vocab_size;
    let p = prompt(9, 12, v);
    let free = solo_generate(&m, &p, 10, SamplingParams::greedy());
    let mut engine = Engine::new(m.clone(), config(40, 64, true)).unwrap();
    let stop = free[3];
    let first_stop = free.iter().position(|&t| t == stop).unwrap();
    let params = RequestParams {
        stop_token_ids: vec![stop],
        ..greedy(10)
    };
    let out = submit(&mut engine, 0, p.clone(), params);
    run_to_end(&mut engine);
    assert_eq!(
        tokens(&out),
        free[..=first_stop],
        "the stop token ends and is kept"
    );
    assert_eq!(finish(&out), FinishReason::Stop(stop));
    // The context length bounds the output.
    let long = prompt(3, m.config().max_position_embeddings - 4, v);
    let out = submit(&mut engine, 1, long, greedy(100));
    run_to_end(&mut engine);
    assert_eq!(tokens(&out).len(), 4);
    assert_eq!(finish(&out), FinishReason::Length);
    // A sink that breaks cancels its request and frees its blocks.
    let seen = Arc::new(Mutex::new(0));
    let s = seen.clone();
    let sink = Box::new(move |_| {
        *s.lock().unwrap() += 1;
        ControlFlow::Break(())
    });
    let request = Request {
        id: 2,
        prompt: p.clone(),
        params: greedy(10),
        lora: None,
    };
    engine.add_request(request, sink).unwrap();
    run_to_end(&mut engine);
    assert_eq!(*seen.lock().unwrap(), 1);
    assert_eq!(engine.stats().kv_cache_usage(), 0.0);
    // Requests the engine cannot run.
    let errors = [
        (vec![], greedy(4), "empty"),
        (
            prompt(1, 128, v),
            greedy(4),
            "maximum context length is 128",
        ),
        (vec![v as u32], greedy(4), "outside the vocabulary"),
        (p.clone(), greedy(0), "max_tokens"),
    ];
    for (prompt, params, want) in errors {
        let request = Request {
            id: 9,
            prompt,
            params,
            lora: None,
        };
        let err = engine
            .add_request(request, Box::new(|_| ControlFlow::Continue(())))
            .unwrap_err();
        assert!(err.to_string().contains(want), "{err}");
    }
    let small = Engine::new(m.clone(), config(31, 8, true))
        .err()
        .unwrap()
        .to_string();
    assert!(
        small.contains("less than the model's context of 128 tokens"),
        "{small}"
    );
}

#[test]
fn logprobs_are_the_raw_logits_log_softmax() {
    let m = model("tiny-llama");
    let p = prompt(21, 10, m.config().vocab_size);
    let mut engine = Engine::new(m.clone(), config(40, 64, true)).unwrap();
    let params = RequestParams {
        logprobs: Some(3),
        ..greedy(1)
    };
    let out = submit(&mut engine, 0, p.clone(), params);
    run_to_end(&mut engine);
    let mut cache = KvCache::new(m.config(), 1, p.len()).unwrap();
    let logits = m.forward(&p, &mut cache, LogitsMode::Last).unwrap();
    let mut lp = vec![0f32; logits.len()];
    log_softmax(&logits, &mut lp);
    let o = out.lock().unwrap();
    let t = o[0].token.as_ref().unwrap();
    assert_eq!(t.logprob, Some(lp[t.token as usize]));
    assert_eq!(t.top_logprobs.len(), 3);
    assert_eq!(
        t.top_logprobs[0],
        (t.token, lp[t.token as usize]),
        "greedy picks the top token"
    );
    assert!(t.top_logprobs.windows(2).all(|w| w[0].1 >= w[1].1));
}

#[test]
fn the_engine_thread_serves_requests_from_other_threads_and_drains_on_shutdown() {
    let m = model("tiny-llama");
    let v = m.config().vocab_size;
    let handle = Arc::new(
        EngineHandle::spawn(Engine::new(m.clone(), config(64, 16, true)).unwrap()).unwrap(),
    );
    let receivers: Vec<(Vec<u32>, Receiver<RequestOutput>)> = (0..4)
        .map(|i| {
            let p = prompt(40 + i, 15, v);
            let (tx, rx) = channel();
            let sink = Box::new(move |o| match tx.send(o) {
                Ok(()) => ControlFlow::Continue(()),
                Err(_) => ControlFlow::Break(()),
            });
            let id = handle.next_request_id();
            handle
                .submit(
                    Request {
                        id,
                        prompt: p.clone(),
                        params: greedy(12),
                        lora: None,
                    },
                    sink,
                )
                .unwrap();
            (p, rx)
        })
        .collect();
    handle.shutdown();
    for (p, rx) in receivers {
        let got: Vec<u32> = rx.iter().filter_map(|o| o.token.map(|t| t.token)).collect();
        assert_eq!(got, solo_generate(&m, &p, 12, SamplingParams::greedy()));
    }
    let err = handle.submit(
        Request {
            id: 99,
            prompt: vec![1],
            params: greedy(1),
            lora: None,
        },
        Box::new(|_| ControlFlow::Continue(())),
    );
    assert!(err.unwrap_err().to_string().contains("stopped"));
}

/// Prompt-lookup speculation: greedy outputs are identical with and without it (proposals
/// are verified row by row with the arithmetic of decode steps), proposals do get accepted on
/// repetitive text, and seeded sampling stays reproducible.
#[test]
fn speculative_prompt_lookup_keeps_greedy_outputs_identical() {
    let m = model("tiny-llama");
    let v = m.config().vocab_size;
    let spec = SpeculativeConfig::Ngram(ferrotron_infer::engine::NgramConfig {
        num_speculative_tokens: 4,
        prompt_lookup_max: 3,
        prompt_lookup_min: 1,
    });
    // Repetitive prompts: a pattern repeated, so the n-grams recur.
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|i| prompt(200 + i, 5 + i as usize, v).repeat(4))
        .collect();
    let run = |speculative, params: &RequestParams| {
        let config = EngineConfig {
            speculative,
            ..config(40, 64, true)
        };
        let mut engine = Engine::new(m.clone(), config).unwrap();
        let outs = run_prompts(&mut engine, &prompts, params, 0);
        let stats = engine.stats();
        let accepted = stats
            .spec_decode_num_accepted_tokens_total
            .load(std::sync::atomic::Ordering::Relaxed);
        (outs, accepted)
    };
    let (plain, _) = run(None, &greedy(40));
    let (speculated, accepted) = run(Some(spec), &greedy(40));
    assert_eq!(speculated, plain);
    assert!(accepted > 0, "no proposal was accepted");
    for (p, out) in prompts.iter().zip(&plain) {
        assert_eq!(*out, solo_generate(&m, p, 40, SamplingParams::greedy()));
    }
    let sampled = RequestParams {
        sampling: SamplingParams::new(false, 0.8, 0, 1.0, 1.0, 5).unwrap(),
        ..greedy(40)
    };
    let (a, _) = run(Some(spec), &sampled);
    let (b, _) = run(Some(spec), &sampled);
    assert_eq!(a, b, "a seed reproduces a speculative sample");
    assert!(a.iter().all(|t| t.len() == 40));
}

/// `model` with every weight scaled by `1 + eps·u` (`u` pseudo-random in [-1, 1]): a draft
/// that mostly agrees with it.
fn perturbed(model: &GptModel, eps: f32) -> Arc<GptModel> {
    let params = model.parameters_f32();
    let tensors = model
        .layout()
        .decls()
        .iter()
        .zip(params)
        .enumerate()
        .map(|(i, (d, mut v))| {
            let noise = prompt(i as u64, v.len(), 2001);
            for (x, n) in v.iter_mut().zip(noise) {
                *x *= 1.0 + eps * (n as f32 / 1000.0 - 1.0);
            }
            ferrotron_tensor::Tensor::from_f32(&d.shape, v).unwrap()
        })
        .collect();
    Arc::new(GptModel::new(model.config().clone(), tensors).unwrap())
}

/// Draft-model speculation: greedy outputs are identical with and without it, with a draft
/// that agrees (every proposal accepted) and one that does not always (some rejected), under
/// chunked prefill, prefix caching and a pool small enough to preempt; seeded sampling stays
/// reproducible.
#[test]
fn speculative_draft_model_keeps_greedy_outputs_identical() {
    let m = model("tiny-llama");
    let v = m.config().vocab_size;
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|i| prompt(300 + i, 9 + 3 * i as usize, v))
        .collect();
    let spec = SpeculativeConfig::DraftModel {
        num_speculative_tokens: 3,
    };
    let run = |draft: Option<Arc<GptModel>>, params: &RequestParams, blocks: usize| {
        let config = EngineConfig {
            speculative: draft.as_ref().map(|_| spec),
            ..config(blocks, 16, true)
        };
        let mut engine = Engine::new(m.clone(), config).unwrap();
        if let Some(d) = draft {
            engine = engine.with_draft_model(d).unwrap();
        }
        // Two rounds of the same prompts: the second hits the prefix cache.
        let mut outs = Vec::new();
        for round in 0..2 {
            outs.extend(run_prompts(&mut engine, &prompts, params, 10 * round));
        }
        let stats = engine.stats();
        let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        let counts = (
            load(&stats.spec_decode_num_draft_tokens_total),
            load(&stats.spec_decode_num_accepted_tokens_total),
            load(&stats.num_preemptions_total),
        );
        (outs, counts)
    };
    let (plain, _) = run(None, &greedy(30), 64);
    let (same, (proposed, accepted, _)) = run(Some(m.clone()), &greedy(30), 64);
    assert_eq!(same, plain, "a draft identical to the target");
    assert!(
        proposed > 0 && accepted == proposed,
        "{accepted} of {proposed} accepted"
    );
    let draft = perturbed(&m, 0.3);
    for blocks in [64, 32] {
        let (got, (proposed, accepted, preempted)) = run(Some(draft.clone()), &greedy(30), blocks);
        assert_eq!(got, plain, "a perturbed draft, {blocks} blocks");
        assert!(
            accepted > 0 && accepted < proposed,
            "{accepted} of {proposed} accepted"
        );
        assert_eq!(
            preempted > 0,
            blocks == 32,
            "{preempted} preemptions with {blocks} blocks"
        );
    }
    let sampled = RequestParams {
        sampling: SamplingParams::new(false, 0.8, 0, 1.0, 1.0, 5).unwrap(),
        ..greedy(30)
    };
    let (a, _) = run(Some(draft.clone()), &sampled, 64);
    let (b, _) = run(Some(draft), &sampled, 64);
    assert_eq!(a, b, "a seed reproduces a speculative sample");
    // Disabled from one running sequence on: nothing is proposed, the outputs stay.
    let crowded = EngineConfig {
        speculative: Some(spec),
        speculative_disable_by_batch_size: Some(1),
        ..config(64, 16, true)
    };
    let mut engine = Engine::new(m.clone(), crowded)
        .unwrap()
        .with_draft_model(m.clone())
        .unwrap();
    let outs = run_prompts(&mut engine, &prompts, &greedy(30), 0);
    let stats = engine.stats();
    let proposed = &stats.spec_decode_num_draft_tokens_total;
    assert_eq!(proposed.load(std::sync::atomic::Ordering::Relaxed), 0);
    assert_eq!(outs, plain[..4]);
    // The config and the model must go together.
    let e = Engine::new(m.clone(), config(64, 16, true)).unwrap();
    assert!(e.with_draft_model(m.clone()).is_err());
}

/// `prompt_logprobs`: every prompt token after the first gets its log-probability given the
/// tokens before it (the full forward's log-softmax), also when the prompt is prefilled in
/// chunks, on the request's first output; such requests skip the prefix cache.
#[test]
fn prompt_logprobs_score_every_prompt_token() {
    let m = model("tiny-llama");
    let p = prompt(31, 21, m.config().vocab_size);
    let mut cache = KvCache::new(m.config(), 1, p.len()).unwrap();
    let logits = m.forward(&p, &mut cache, LogitsMode::All).unwrap();
    let v = m.config().vocab_size;
    let mut engine = Engine::new(m.clone(), config(40, 8, true)).unwrap();
    let params = RequestParams {
        prompt_logprobs: Some(2),
        ..greedy(2)
    };
    for id in 0..2 {
        let out = submit(&mut engine, id, p.clone(), params.clone());
        run_to_end(&mut engine);
        let o = out.lock().unwrap();
        assert_eq!(o[0].cached_tokens, 0, "no prefix-cache hit");
        let lps = &o[0].prompt_logprobs;
        assert_eq!(lps.len(), p.len() - 1);
        for (i, t) in lps.iter().enumerate() {
            let mut lp = vec![0f32; v];
            log_softmax(&logits[i * v..(i + 1) * v], &mut lp);
            assert_eq!(t.token, p[i + 1]);
            let got = t.logprob.unwrap();
            assert!(
                (got - lp[p[i + 1] as usize]).abs() < 1e-4,
                "token {i}: {got}"
            );
            assert_eq!(t.top_logprobs.len(), 2);
        }
        assert!(o[1].prompt_logprobs.is_empty(), "only on the first output");
    }
}
