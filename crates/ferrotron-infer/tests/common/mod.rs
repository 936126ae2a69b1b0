//! What the engine tests share: the tiny fixtures, an engine config, prompts, and requests
//! submitted with their outputs collected.

#![allow(dead_code)] // each test file uses its own part

use ferrotron_infer::engine::{
    Engine, EngineConfig, FinishReason, Request, RequestOutput, RequestParams, SchedulerConfig,
};
use ferrotron_infer::sampler::SamplingParams;
use ferrotron_infer::{GenerateOptions, generate};
use ferrotron_model::GptModel;
use ferrotron_model::families::load_hf_model;
use ferrotron_model::lora::LoraWeights;
use ferrotron_tensor::DType;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

pub fn model(name: &str) -> Arc<GptModel> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name);
    Arc::new(load_hf_model(&dir, DType::F32).unwrap().0)
}

pub fn config(num_blocks: usize, budget: usize, prefix_caching: bool) -> EngineConfig {
    EngineConfig {
        block_size: 4,
        num_blocks,
        scheduler: SchedulerConfig {
            max_num_seqs: 8,
            max_num_batched_tokens: budget,
        },
        enable_prefix_caching: prefix_caching,
        speculative: None,
        speculative_disable_by_batch_size: None,
    }
}

pub fn prompt(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) as u32 % vocab as u32
        })
        .collect()
}

/// Outputs collected per request.
pub type Outputs = Arc<Mutex<Vec<RequestOutput>>>;

pub fn submit(engine: &mut Engine, id: u64, prompt: Vec<u32>, params: RequestParams) -> Outputs {
    let request = Request {
        id,
        prompt,
        params,
        lora: None,
    };
    submit_request(engine, request)
}

/// Queues `request`, collecting its outputs.
pub fn submit_request(engine: &mut Engine, request: Request) -> Outputs {
    let outputs = Outputs::default();
    let sink = outputs.clone();
    let sink = Box::new(move |o| {
        sink.lock().unwrap().push(o);
        ControlFlow::Continue(())
    });
    engine.add_request(request, sink).unwrap();
    outputs
}

/// Submits `prompts` as requests `first_id..` with `params`, runs the engine until they end
/// and returns each one's tokens.
pub fn run_prompts(
    engine: &mut Engine,
    prompts: &[Vec<u32>],
    params: &RequestParams,
    first_id: u64,
) -> Vec<Vec<u32>> {
    let outs: Vec<Outputs> = prompts
        .iter()
        .zip(first_id..)
        .map(|(p, id)| submit(engine, id, p.clone(), params.clone()))
        .collect();
    run_to_end(engine);
    outs.iter().map(tokens).collect()
}

pub fn run_to_end(engine: &mut Engine) {
    while engine.has_work() {
        engine.step().unwrap();
    }
}

pub fn tokens(outputs: &Outputs) -> Vec<u32> {
    let o = outputs.lock().unwrap();
    o.iter()
        .filter_map(|o| o.token.as_ref().map(|t| t.token))
        .collect()
}

pub fn finish(outputs: &Outputs) -> FinishReason {
    outputs.lock().unwrap().last().unwrap().finished.unwrap()
}

pub fn solo_generate(
    model: &GptModel,
    prompt: &[u32],
    max: usize,
    sampling: SamplingParams,
) -> Vec<u32> {
    solo_generate_with(model, None, prompt, max, sampling)
}

/// `generate`'s tokens of `model` with the LoRA adapter `lora` after `prompt`.
pub fn solo_generate_with(
    model: &GptModel,
    lora: Option<Arc<LoraWeights>>,
    prompt: &[u32],
    max: usize,
    sampling: SamplingParams,
) -> Vec<u32> {
    let options = GenerateOptions {
        max_new_tokens: max,
        sampling,
        stop_token_ids: vec![],
        lora,
    };
    generate(model, prompt, &options, &mut |_| ControlFlow::Continue(()))
        .unwrap()
        .generated_ids
}

pub fn greedy(max_tokens: usize) -> RequestParams {
    RequestParams {
        max_tokens,
        ..RequestParams::default()
    }
}
