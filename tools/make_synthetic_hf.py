#!/usr/bin/env python3
"""Write a synthetic LLaMA HF directory of a chosen size (random bf16 weights) for the conversion
benchmark (scripts/bench-convert.sh): config.json plus model-0000i-of-0000n.safetensors shards with
model.safetensors.index.json, as transformers' save_pretrained lays them out.

    python3 tools/make_synthetic_hf.py OUT_DIR [--hidden 2048 --layers 16 --heads 32 --groups 8
                                                --ffn 8192 --vocab 32000 --max-shard-gb 2]

The defaults give 1.10e9 parameters (2.2 GB in bf16): hidden 2048, 16 layers, 32 heads in 8 query
groups, FFN 8192, vocabulary 32000, untied output layer. Needs only numpy; the safetensors format
(8-byte header length, JSON header, raw little-endian data) is written directly. Values are random
bf16 numbers of magnitude 2^-6..2^-5 with random signs (fast to make, no NaN or Inf).
"""

from __future__ import annotations

import argparse
import json
import os
import struct

import numpy as np


def tensors(h: int, layers: int, heads: int, groups: int, ffn: int, vocab: int):
    d = h // heads
    yield "model.embed_tokens.weight", (vocab, h)
    for i in range(layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,)
        yield f"{p}.self_attn.q_proj.weight", (heads * d, h)
        yield f"{p}.self_attn.k_proj.weight", (groups * d, h)
        yield f"{p}.self_attn.v_proj.weight", (groups * d, h)
        yield f"{p}.self_attn.o_proj.weight", (h, heads * d)
        yield f"{p}.post_attention_layernorm.weight", (h,)
        yield f"{p}.mlp.gate_proj.weight", (ffn, h)
        yield f"{p}.mlp.up_proj.weight", (ffn, h)
        yield f"{p}.mlp.down_proj.weight", (h, ffn)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (vocab, h)


def random_bf16(rng: np.random.Generator, n: int) -> bytes:
    bits = rng.integers(0x3C80, 0x3D00, size=n, dtype=np.uint16)
    bits |= rng.integers(0, 2, size=n, dtype=np.uint16) << 15
    return bits.astype("<u2").tobytes()


def write_shard(path: str, names_shapes, rng) -> int:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in names_shapes:
        size = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape in names_shapes:
            n = int(np.prod(shape))
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                f.write(np.ones(n, dtype=np.float32).view(np.uint32).__rshift__(16).astype("<u2").tobytes())
            else:
                f.write(random_bf16(rng, n))
    return offset


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--max-shard-gb", type=float, default=2.0)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rng = np.random.default_rng(0)
    all_tensors = list(tensors(a.hidden, a.layers, a.heads, a.groups, a.ffn, a.vocab))
    limit = int(a.max_shard_gb * 1e9)
    shards, current, size = [], [], 0
    for name, shape in all_tensors:
        b = int(np.prod(shape)) * 2
        if current and size + b > limit:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += b
    shards.append(current)
    weight_map, total = {}, 0
    for i, part in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_shard(os.path.join(a.out, fname), part, rng)
        weight_map.update({n: fname for n, _ in part})
    params = sum(int(np.prod(s)) for _, s in all_tensors)
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_parameters": params, "total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": a.hidden,
        "intermediate_size": a.ffn,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.groups,
        "vocab_size": a.vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(f"wrote {a.out}: {params / 1e9:.2f}e9 parameters, {total / 1e9:.2f} GB in {len(shards)} shards")


if __name__ == "__main__":
    main()
