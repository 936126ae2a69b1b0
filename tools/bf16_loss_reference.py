"""PyTorch's view of the bf16 vs f32 loss gap of ``scripts/bf16-loss-curves.sh``.

Trains SmolLM2-135M on the KJV corpus in PyTorch with the same batches (Megatron-Core's own
``GPTDataset``: seed 1234, split ``969,30,1``, the run's train / valid / test sample counts),
the same schedule (lr warmup over 21 iterations from 0, then cosine to lr/10 over 200
iterations, counted in samples as Megatron does), the same AdamW (betas 0.9 / 0.999, eps 1e-8,
weight decay 0.01 on matrices only, global-norm clipping at 1.0) and two micro-batches of 2
per iteration, in three precisions:

* ``f32``: everything in f32 (the yardstick; it should agree with our f32 curve);
* ``megatron-bf16``: Megatron's ``--bf16``: the model's parameters *are* bf16 (norms
  included, ``Float16Module``), rounded from f32 master weights after every optimizer step;
  gradients accumulated over micro-batches in f32 (``main_grad``); clipping and AdamW on the
  f32 masters;
* ``megatron-bf16-rounded``: as ``megatron-bf16``, but the master weights start from the
  bf16-rounded parameters (what Megatron's ``reload_model_params`` gives a bf16 run that loads
  a model-only checkpoint), not from the checkpoint's f32 values;
* ``autocast``: f32 parameters, ``torch.autocast("cpu", dtype=torch.bfloat16)`` compute (what
  ``scripts/bench-train.sh`` times as PyTorch's bf16).

Prints one JSON line per (precision, iteration) with the lm loss, and a table of the relative
differences of each bf16 variant against f32. The question it answers: is the gap of our bf16
run over our f32 run during lr warmup (BENCHMARKS.md, bf16 section) a property of Megatron's
bf16 semantics (bf16 parameters) or of our kernels?

    tools/.venv/bin/python tools/bf16_loss_reference.py --iters 30 \
        --model .cache/smollm2-hf --data .cache/kjv/kjv_text_document > runs/bf16-ref.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile

import torch
import torch.nn.functional as F
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from transformers import AutoModelForCausalLM


class Tokenizer:
    """The fields Megatron's GPT dataset reads; masks are not reset at EOD, so eod is unused."""

    eod = 0
    vocab_size = 49152
    unique_identifiers = {"class": "SmolLM2", "vocab_size": 49152}


def train_samples(args):
    """The train split's samples in the order Megatron (and ferrotron) draws them."""
    valid = (args.train_iters // (args.train_iters // 2) + 1) * 2 * args.gbs
    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=args.seq,
        blend=([args.data], None),
        split="969,30,1",
        path_to_cache=tempfile.mkdtemp(),
        tokenizer=Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    sizes = [args.train_iters * args.gbs, valid, 2 * args.gbs]
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    return train


def lr_at(args, iteration):
    """Megatron's get_lr at (iteration - 1) * gbs consumed samples."""
    steps, warmup, decay = (iteration - 1) * args.gbs, args.warmup * args.gbs, args.train_iters * args.gbs
    if steps <= warmup:
        return args.lr * steps / warmup
    r = (steps - warmup) / (decay - warmup)
    return args.min_lr + (args.lr - args.min_lr) * 0.5 * (math.cos(math.pi * r) + 1)


def run(args, precision, dataset):
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    # Megatron's embedding has no padding row: HF's `padding_idx` (the pad token, 2 here, which
    # is also the corpus's EOD) would drop that row's gradient.
    model.get_input_embeddings().padding_idx = None
    params = [p for p in model.parameters() if p.requires_grad]
    bf16_params = precision.startswith("megatron-bf16")
    master = [p.detach().clone() for p in params] if bf16_params else params
    if bf16_params:
        model.to(torch.bfloat16)
        params = [p for p in model.parameters() if p.requires_grad]
    if precision == "megatron-bf16-rounded":
        master = [p.detach().float() for p in params]
    groups = [
        {"params": [m for m in master if m.dim() >= 2], "weight_decay": 0.01},
        {"params": [m for m in master if m.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=0.0, betas=(0.9, 0.999), eps=1e-8)
    micro = args.gbs // 2
    for it in range(1, args.iters + 1):
        main_grads = [torch.zeros_like(m) for m in master]
        total = 0.0
        for mb in range(micro):
            rows = [dataset[(it - 1) * args.gbs + mb * 2 + j] for j in range(2)]
            tokens = torch.stack([r["tokens"] for r in rows]).long()
            labels = torch.stack([r["labels"] for r in rows]).long()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
                logits = model(input_ids=tokens).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()) / micro
            loss.backward()
            total += loss.item()
            for g, p in zip(main_grads, params):
                g += p.grad.float()
                p.grad = None
        for m, g in zip(master, main_grads):
            m.grad = g
        norm = torch.nn.utils.clip_grad_norm_(master, 1.0).item()
        for group in opt.param_groups:
            group["lr"] = lr_at(args, it)
        opt.step()
        for m in master:
            m.grad = None
        if bf16_params:
            with torch.no_grad():
                for p, m in zip(params, master):
                    p.copy_(m)
        print(json.dumps({"precision": precision, "iteration": it, "lm_loss": total, "grad_norm": norm}), flush=True)
        yield total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="the SmolLM2-135M HF directory")
    ap.add_argument("--data", required=True, help="the KJV corpus prefix (.bin/.idx)")
    ap.add_argument("--iters", type=int, default=30, help="iterations to run of each precision")
    ap.add_argument("--train-iters", type=int, default=200, help="the schedule's length (the sample order too)")
    ap.add_argument("--warmup", type=int, default=21, help="lr warmup iterations")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--gbs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--min-lr", type=float, default=1e-5)
    ap.add_argument("--precisions", default="f32,megatron-bf16,autocast")
    args = ap.parse_args()
    torch.manual_seed(1234)
    dataset = train_samples(args)
    curves = {p: list(run(args, p, dataset)) for p in args.precisions.split(",")}
    base = curves.get("f32")
    if base:
        names = [p for p in curves if p != "f32"]
        print("iteration  f32      " + "  ".join(f"{n:>22}" for n in names), file=sys.stderr)
        for i, f in enumerate(base):
            cells = "  ".join(f"{curves[n][i]:.4f} ({100 * (curves[n][i] / f - 1):+6.2f}%)" for n in names)
            print(f"{i + 1:9d}  {f:.4f}  {cells}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
