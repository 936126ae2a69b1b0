#!/usr/bin/env python3
"""PyTorch side of the training-speed benchmark (scripts/bench-train.sh).

One configuration per process (so ``ru_maxrss`` is that configuration's peak): an HF model
directory (e.g. the SmolLM2-135M that ``ferrotron convert gguf-to-hf`` wrote to
``.cache/smollm2-hf``) trained with f32 master weights, fwd + bwd + global-norm clipping +
``torch.optim.AdamW`` (lr 1e-5, betas 0.9/0.999, eps 1e-8, weight decay 0.01 on matrices only,
as Megatron leaves norms and biases undecayed), ``--warmup`` untimed then ``--steps`` timed
steps, ``torch.set_num_threads(--threads)``.

Modes: ``f32``; ``bf16`` = ``torch.autocast("cpu", dtype=torch.bfloat16)`` around the forward
and the loss (the reference design.md measured; weights and optimizer stay f32).

Tokens: the same stream as ``crates/ferrotron-train/examples/bench_train.rs``. Either a
64-bit LCG from ``--seed`` (``x = x*6364136223846793005 + 1442695040888963407 mod 2^64``,
token ``(x >> 33) % vocab``), or ``--tokens FILE``: a Megatron ``.bin`` data file (raw
little-endian ids, uint16 when vocab < 65500 else int32, as Megatron's indexed dataset writes
them), read cyclically. Sample ``k`` (step ``i``, row ``j``: ``k = i*b + j``) is stream items
``k*(s+1) .. k*(s+1)+s+1``; inputs are the first ``s``, targets the last ``s``, every target
counted (the loss is the mean over all ``b*s`` tokens, the logits upcast to f32 as
transformers' ``ForCausalLMLoss`` does).

Prints one JSON line on stdout: impl, mode, micro_batch, seq, threads, warmup, steps,
tokens_per_s (b*s / median step time), ms_per_step (median; min/max too), peak_rss_mib
(``ru_maxrss``, the whole process incl. model loading), loss_first / loss_last.

    tools/.venv/bin/python tools/bench_train_torch.py MODEL_DIR --mode f32 --micro-batch 1
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

LCG_MUL = 6364136223846793005
LCG_INC = 1442695040888963407
MASK64 = (1 << 64) - 1


def lcg_tokens(seed, n, vocab):
    """The first ``n`` tokens of the LCG stream (same as the Rust side)."""
    out, x = [], seed & MASK64
    for _ in range(n):
        x = (x * LCG_MUL + LCG_INC) & MASK64
        out.append((x >> 33) % vocab)
    return out


def file_tokens(path, vocab):
    """All ids of a Megatron ``.bin`` file (uint16 if vocab < 65500 else int32)."""
    import numpy as np

    dtype = np.uint16 if vocab < 65500 else np.int32
    size = os.path.getsize(path)
    if size % np.dtype(dtype).itemsize:
        sys.exit(f"--tokens {path}: {size} bytes is not a whole number of {np.dtype(dtype).name} ids")
    ids = np.fromfile(path, dtype=dtype).astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        sys.exit(f"--tokens {path}: ids outside [0, {vocab}) (max {ids.max()})")
    return ids.tolist()


def step_batches(stream, steps, b, s):
    """Per step, (inputs, targets) as [b, s] int64 tensors from the cyclic stream."""
    import torch

    if len(stream) < s + 1:
        sys.exit(f"token stream of {len(stream)} ids is shorter than seq + 1 = {s + 1}")
    batches = []
    for i in range(steps):
        rows = []
        for j in range(b):
            start = (i * b + j) * (s + 1)
            rows.append([stream[(start + t) % len(stream)] for t in range(s + 1)])
        full = torch.tensor(rows, dtype=torch.int64)
        batches.append((full[:, :-1].contiguous(), full[:, 1:].contiguous()))
    return batches


def adamw(model, lr, weight_decay, impl):
    import torch

    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.ndim >= 2]
    no_decay = [p for p in trainable if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kw = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[impl]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, **kw)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--mode", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--clip-grad", type=float, default=1.0, help="max global grad norm; 0 = off")
    ap.add_argument("--adamw", choices=["fused", "foreach", "for-loop"], default="fused",
                    help="torch.optim.AdamW implementation (fused was fastest on this CPU)")
    ap.add_argument("--seed", type=int, default=12345)
    ap.add_argument("--tokens", help="Megatron .bin token file instead of random tokens")
    ap.add_argument("--lora-rank", type=int, help="train PEFT LoRA adapters of this rank (alpha = rank) "
                    "on every projection (q/k/v/o, gate/up/down) of the frozen model")
    a = ap.parse_args()
    for name in ["micro_batch", "seq", "steps", "threads"]:
        if getattr(a, name) < 1:
            sys.exit(f"--{name.replace('_', '-')} must be >= 1")
    if a.warmup < 0:
        sys.exit("--warmup must be >= 0")

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a.threads)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    if a.lora_rank:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        config = LoraConfig(r=a.lora_rank, lora_alpha=a.lora_rank, lora_dropout=0.0, target_modules=targets)
        model = get_peft_model(model, config)
    model.train()
    vocab = model.config.vocab_size
    b, s, total = a.micro_batch, a.seq, a.warmup + a.steps
    stream = file_tokens(a.tokens, vocab) if a.tokens else lcg_tokens(a.seed, total * b * (s + 1), vocab)
    batches = step_batches(stream, total, b, s)
    opt = adamw(model, a.lr, a.weight_decay, a.adamw)
    params = [p for p in model.parameters() if p.requires_grad]

    def train_step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.mode == "bf16"):
            logits = model(input_ids=inputs, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, vocab), targets.view(-1))
        loss.backward()
        if a.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(params, a.clip_grad, foreach=True)
        opt.step()
        return loss.item()

    times, losses = [], []
    for i, (inputs, targets) in enumerate(batches):
        t = time.perf_counter()
        losses.append(train_step(inputs, targets))
        dt = time.perf_counter() - t
        kind = "warmup" if i < a.warmup else "timed"
        print(f"torch {a.mode} b={b} step {i + 1}/{total} ({kind}): {dt * 1e3:.0f} ms, loss {losses[-1]:.4f}",
              file=sys.stderr)
        if i >= a.warmup:
            times.append(dt)
    med = statistics.median(times)
    print(json.dumps({
        "impl": "torch",
        "version": torch.__version__,
        "mode": a.mode,
        "micro_batch": b,
        "seq": s,
        "threads": a.threads,
        "warmup": a.warmup,
        "steps": a.steps,
        "lora_rank": a.lora_rank,
        "tokens_per_s": round(b * s / med, 2),
        "ms_per_step": round(med * 1e3, 1),
        "ms_per_step_min": round(min(times) * 1e3, 1),
        "ms_per_step_max": round(max(times) * 1e3, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "loss_first": round(losses[0], 5),
        "loss_last": round(losses[-1], 5),
    }), flush=True)


if __name__ == "__main__":
    main()
