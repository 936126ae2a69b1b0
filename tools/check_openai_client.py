"""Drives a running `ferrotron serve` with the official `openai` Python client and checks
what a user of the OpenAI API relies on. Exits non-zero, naming the check, on the first
failure. Run by crates/ferrotron/tests/serve.rs against SmolLM2:

    python tools/check_openai_client.py --base-url http://127.0.0.1:PORT/v1 --model NAME \
        --greedy-prompt "What is the capital of France?" --greedy-text "The capital ..."

--greedy-text is what `ferrotron generate --chat --greedy` answers to --greedy-prompt.
"""

import argparse
import sys

import openai


def check(name, ok, detail=""):
    if not ok:
        sys.exit(f"FAIL {name}: {detail}")
    print(f"ok   {name}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--greedy-prompt", required=True)
    ap.add_argument("--greedy-text", required=True)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="none", max_retries=0)
    messages = [{"role": "user", "content": args.greedy_prompt}]

    models = client.models.list()
    check("models.list names the served model", [m.id for m in models.data] == [args.model],
          [m.id for m in models.data])

    r = client.chat.completions.create(model=args.model, messages=messages, temperature=0,
                                       max_completion_tokens=args.max_tokens)
    text = r.choices[0].message.content
    check("temperature 0 equals `ferrotron generate --greedy`", text == args.greedy_text,
          f"{text!r} vs {args.greedy_text!r}")
    check("usage adds up", r.usage.total_tokens == r.usage.prompt_tokens
          + r.usage.completion_tokens, r.usage)

    stream = client.chat.completions.create(
        model=args.model, messages=messages, temperature=0, max_tokens=args.max_tokens,
        stream=True, stream_options={"include_usage": True})
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    check("streamed deltas join to the same text", "".join(pieces) == text,
          "".join(pieces))
    check("stream ends with usage", usage is not None
          and usage.completion_tokens == r.usage.completion_tokens, usage)
    check("stream reports the finish reason", finish == r.choices[0].finish_reason, finish)

    r = client.chat.completions.create(model=args.model, messages=messages, temperature=0,
                                       max_tokens=5, logprobs=True)
    lp = r.choices[0].logprobs.content
    check("logprobs=True without top_logprobs", len(lp) == r.usage.completion_tokens
          and all(t.logprob <= 0 and t.top_logprobs == [] for t in lp), lp)

    sampled = [client.chat.completions.create(
        model=args.model, messages=messages, temperature=1.0, top_p=0.95, seed=seed,
        max_tokens=24).choices[0].message.content for seed in (7, 7, 8)]
    check("a seed reproduces the sample", sampled[0] == sampled[1], sampled)

    r = client.chat.completions.create(model=args.model, messages=messages, n=3,
                                       temperature=1.0, seed=3, max_tokens=8)
    check("n choices", [c.index for c in r.choices] == [0, 1, 2], r.choices)

    r = client.completions.create(model=args.model, prompt="One, two, three, four,",
                                  max_tokens=16, temperature=0, stop=[" six"])
    c = r.choices[0]
    check("a stop string ends the completion", c.finish_reason == "stop"
          and " six" not in c.text, c)

    try:
        client.chat.completions.create(model=args.model, messages=messages,
                                       max_tokens=10**6)
        check("max_tokens beyond the context is a 400", False, "no error")
    except openai.BadRequestError as e:
        check("max_tokens beyond the context is a 400", e.status_code == 400
              and "maximum context length" in str(e), e)
    try:
        client.chat.completions.create(model="no-such-model", messages=messages)
        check("an unknown model is a 404", False, "no error")
    except openai.NotFoundError as e:
        check("an unknown model is a 404", e.status_code == 404, e)
    print("all checks passed")


if __name__ == "__main__":
    main()
