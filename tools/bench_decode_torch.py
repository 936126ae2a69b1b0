"""PyTorch reference for the decode benchmark (BENCHMARKS.md "Decode").

Greedy decode, batch 1, KV cache, 128 new tokens (EOS ignored) after "The capital of France is",
with transformers on an HF model directory (e.g. the one `ferrotron convert gguf-to-hf` wrote, which
also checks that transformers loads our conversion). Prints median tokens/s over N runs for f32 and
bf16 weights, in the same format as `cargo bench -p ferrotron-infer --bench decode`.

    tools/.venv/bin/python tools/bench_decode_torch.py MODEL_DIR [--runs 5] [--threads 2]
"""

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

PROMPT_IDS = [504, 3575, 282, 4649, 314]  # "The capital of France is" (SmolLM2 vocabulary)


def decode_rate(model, new_tokens):
    ids = torch.tensor([PROMPT_IDS])
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        past = out.past_key_values
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            out = model(token, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        return (new_tokens - 1) / (time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__} decode benchmark: {a.model_dir}, batch 1, "
          f"{a.new_tokens} new tokens, {a.threads} threads, {a.runs} runs")
    for name, dtype in [("f32", torch.float32), ("bf16", torch.bfloat16)]:
        model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=dtype).eval()
        rates = [decode_rate(model, a.new_tokens) for _ in range(a.runs + 1)][1:]
        print(f"weights {name:>4}: median {statistics.median(rates):.1f} tokens/s "
              f"(min {min(rates):.1f}, max {max(rates):.1f})")


if __name__ == "__main__":
    main()
