#!/usr/bin/env python3
"""PyTorch reference for the conversion benchmark (scripts/bench-convert.sh): HF directory ->
per-rank tensor-parallel shards the way Pai-Megatron-Patch's hf2mcore converters work — load the
whole state dict into memory (safetensors.torch), pack q/k/v per query group into linear_qkv and
gate/up into linear_fc1 per rank, split column/row/vocab-parallel tensors, and save one
safetensors file per rank.

    tools/.venv/bin/python tools/bench_convert_torch.py HF_DIR OUT_DIR --tp 2

Prints one line: `torch hf-to-ckpt tp T: S s, B bytes written`. Peak RSS is measured by the caller
(/usr/bin/time). Only tensor parallelism (pp 1), LLaMA-family without biases.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from safetensors.torch import load_file, save_file


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hf")
    p.add_argument("out")
    p.add_argument("--tp", type=int, default=1)
    a = p.parse_args()
    start = time.perf_counter()
    cfg = json.load(open(os.path.join(a.hf, "config.json")))
    state = {}
    for f in sorted(os.listdir(a.hf)):
        if f.startswith("model") and f.endswith(".safetensors"):
            state.update(load_file(os.path.join(a.hf, f)))
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads", heads)
    d = cfg.get("head_dim", h // heads)
    t = a.tp
    ranks = [dict() for _ in range(t)]
    emb = state.pop("model.embed_tokens.weight")
    for r, part in enumerate(torch.chunk(emb, t, dim=0)):
        ranks[r]["embedding.word_embeddings.weight"] = part.clone()
    for i in range(cfg["num_hidden_layers"]):
        hp, mp = f"model.layers.{i}", f"decoder.layers.{i}"
        q = state.pop(f"{hp}.self_attn.q_proj.weight").view(groups, heads // groups * d, h)
        k = state.pop(f"{hp}.self_attn.k_proj.weight").view(groups, d, h)
        v = state.pop(f"{hp}.self_attn.v_proj.weight").view(groups, d, h)
        qkv = torch.cat([q, k, v], dim=1)
        gate = state.pop(f"{hp}.mlp.gate_proj.weight")
        up = state.pop(f"{hp}.mlp.up_proj.weight")
        o = state.pop(f"{hp}.self_attn.o_proj.weight")
        down = state.pop(f"{hp}.mlp.down_proj.weight")
        n1 = state.pop(f"{hp}.input_layernorm.weight")
        n2 = state.pop(f"{hp}.post_attention_layernorm.weight")
        for r in range(t):
            s = ranks[r]
            s[f"{mp}.self_attention.linear_qkv.weight"] = torch.chunk(qkv, t, 0)[r].reshape(-1, h).clone()
            s[f"{mp}.self_attention.linear_proj.weight"] = torch.chunk(o, t, 1)[r].clone()
            s[f"{mp}.mlp.linear_fc1.weight"] = torch.cat(
                [torch.chunk(gate, t, 0)[r], torch.chunk(up, t, 0)[r]], 0
            ).clone()
            s[f"{mp}.mlp.linear_fc2.weight"] = torch.chunk(down, t, 1)[r].clone()
            if r == 0:
                s[f"{mp}.input_layernorm.weight"] = n1
                s[f"{mp}.pre_mlp_layernorm.weight"] = n2
    ranks[0]["decoder.final_layernorm.weight"] = state.pop("model.norm.weight")
    if "lm_head.weight" in state:
        for r, part in enumerate(torch.chunk(state.pop("lm_head.weight"), t, dim=0)):
            ranks[r]["output_layer.weight"] = part.clone()
    os.makedirs(a.out, exist_ok=True)
    written = 0
    for r, s in enumerate(ranks):
        path = os.path.join(a.out, f"model_tp{r:02d}_pp000.safetensors")
        save_file(s, path)
        written += os.path.getsize(path)
    print(f"torch hf-to-ckpt tp {t}: {time.perf_counter() - start:.2f} s, {written} bytes written")


if __name__ == "__main__":
    main()
