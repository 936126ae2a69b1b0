"""Load test of an OpenAI-compatible completion server (Ferrotron's `ferrotron serve`,
llama.cpp's `llama-server`, vLLM), in the manner of `vllm bench serve`: a bounded number of
concurrent streaming requests over loopback, each prompt exactly --input-len tokens of real
text (KJV, tokenized with the model's own tokenizer and sent as token ids, so every server
does the same work), exactly --output-len new tokens (`ignore_eos`), greedy.

Prints request throughput, output and total token throughput, and mean / median / p99 of
TTFT, TPOT (excluding the first token), ITL and end-to-end latency; --json writes them.
With --repeat-prompt-len N it also sends one N-token prompt twice in a row and reports the
cold and warm TTFT (prefix caching).

    python tools/load_test.py --base-url http://127.0.0.1:8000/v1 --model smollm2 \
        --tokenizer .cache/smollm2-hf --concurrency 8 --num-prompts 32
"""

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import openai
from tokenizers import Tokenizer


def prompts_from_corpus(tokenizer, corpus, n, length):
    """n prompts of exactly `length` token ids, consecutive windows of the corpus."""
    ids = []
    with open(corpus) as f:
        for line in f:
            ids.extend(tokenizer.encode(json.loads(line)["text"], add_special_tokens=False).ids)
            if len(ids) >= (n + 1) * length:
                break
    if len(ids) < n * length:
        sys.exit(f"{corpus}: only {len(ids)} tokens, need {n * length}")
    return [ids[i * length:(i + 1) * length] for i in range(n)]


async def one_request(client, model, prompt, output_len):
    """Streams one completion; returns (ttft, inter-token gaps, e2e, output tokens)."""
    start = time.perf_counter()
    stamps = []
    usage = None
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=output_len, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
    end = time.perf_counter()
    if not stamps:
        raise RuntimeError("no tokens streamed")
    n_out = usage.completion_tokens if usage is not None else len(stamps)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - start, gaps, end - start, n_out


def summarize(name, values, scale=1e3):
    values = sorted(values)
    if not values:
        return {}
    p99 = values[min(len(values) - 1, int(round(0.99 * (len(values) - 1))))]
    return {f"mean_{name}_ms": statistics.fmean(values) * scale,
            f"median_{name}_ms": statistics.median(values) * scale,
            f"p99_{name}_ms": p99 * scale}


async def run(args):
    tokenizer = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key="none", timeout=600,
                                max_retries=0)
    prompts = prompts_from_corpus(tokenizer, args.corpus, args.num_prompts, args.input_len)
    # Warm-up: one short request (model pages, kernels).
    await one_request(client, args.model.split(",")[0], prompts[0][:16], 4)
    limit = asyncio.Semaphore(args.concurrency)

    models = args.model.split(",")

    async def bounded(i, p):
        async with limit:
            return await one_request(client, models[i % len(models)], p, args.output_len)

    start = time.perf_counter()
    results = await asyncio.gather(*(bounded(i, p) for i, p in enumerate(prompts)),
                                   return_exceptions=True)
    duration = time.perf_counter() - start
    ok = [r for r in results if not isinstance(r, BaseException)]
    failed = [r for r in results if isinstance(r, BaseException)]
    out_tokens = sum(r[3] for r in ok)
    report = {
        "concurrency": args.concurrency, "num_prompts": args.num_prompts,
        "input_len": args.input_len, "output_len": args.output_len,
        "successful_requests": len(ok), "failed_requests": len(failed),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + len(ok) * args.input_len) / duration,
    }
    report |= summarize("ttft", [r[0] for r in ok])
    report |= summarize("tpot", [(r[2] - r[0]) / (r[3] - 1) for r in ok if r[3] > 1])
    report |= summarize("itl", [g for r in ok for g in r[1]])
    report |= summarize("e2el", [r[2] for r in ok])
    if failed:
        report["first_error"] = repr(failed[0])
    if args.repeat_prompt_len:
        (long,) = prompts_from_corpus(tokenizer, args.corpus, 1, args.repeat_prompt_len)
        first = args.model.split(",")[0]
        cold = (await one_request(client, first, long, 1))[0]
        warm = (await one_request(client, first, long, 1))[0]
        report |= {"repeat_prompt_len": args.repeat_prompt_len,
                   "cold_ttft_ms": cold * 1e3, "warm_ttft_ms": warm * 1e3,
                   "warm_over_cold": warm / cold}
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", required=True,
                    help="the served model name, or several comma-separated (e.g. LoRA "
                         "adapters): request i goes to the (i mod n)-th")
    ap.add_argument("--tokenizer", required=True, help="HF model directory with tokenizer.json")
    ap.add_argument("--corpus", default=".cache/kjv/kjv.jsonl",
                    help='JSONL with a "text" field per line (default: the KJV corpus)')
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeat-prompt-len", type=int, default=0,
                    help="also time one prompt of this many tokens cold, then again warm")
    ap.add_argument("--label", default="", help="a name printed with the results")
    ap.add_argument("--json", help="append the results as one JSON line to this file")
    args = ap.parse_args()
    report = asyncio.run(run(args))
    report["label"] = args.label
    print(f"== {args.label} concurrency {args.concurrency}")
    for k, v in report.items():
        print(f"  {k:28s} {v:.2f}" if isinstance(v, float) else f"  {k:28s} {v}")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(report) + "\n")
    sys.exit(1 if report["failed_requests"] else 0)


if __name__ == "__main__":
    main()
