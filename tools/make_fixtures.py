#!/usr/bin/env python3
"""Generate tiny, deterministic HuggingFace reference checkpoints for the Rust tests.

Run with the reference venv (see tools/README.md):

    tools/.venv/bin/python tools/make_fixtures.py            # writes fixtures/tiny-*/

Everything runs on CPU in float32 with fixed seeds and
``torch.use_deterministic_algorithms(True)``. Models are built with transformers' own classes and
written with ``save_pretrained`` (safetensors), so ``config.json`` / weight files are exactly what
transformers 5.23 writes. Every fixture directory holds:

* ``config.json``                      -- as written by ``save_pretrained``
* ``model.safetensors``                -- or shards + ``model.safetensors.index.json`` (tiny-qwen2)
* ``reference.safetensors``            -- ``input_ids`` (int64 [2, 24]) and ``logits`` (f32 [2, 24, vocab])
                                          from ``model(input_ids).logits``, eval mode, ``attn_implementation="eager"``.

Every RMSNorm weight is perturbed to ``1 + 0.2*randn`` and every bias to ``0.1*randn`` so that a loader that
forgets a norm weight or a bias is caught. Linear/embedding weights are ``0.15*randn`` so logits have std > 0.5.
After saving, each fixture is re-loaded from disk (``from_pretrained(..., dtype=float32)``) and its logits are
checked to be bit-identical to the stored reference.

Which fixture covers which case
-------------------------------
tiny-llama    LlamaForCausalLM; untied embeddings (separate ``lm_head.weight``); default rope (theta 10000);
              rms_norm_eps 1e-5; GQA (4 heads, 2 kv heads, head_dim 12 = hidden/heads, derived); f32 on disk.
tiny-llama3   LlamaForCausalLM; llama3 rope scaling (factor 8, low_freq_factor 1, high_freq_factor 4,
              original_max_position_embeddings 64, rope_theta 500000 -> with head_dim 12 the six rotary
              frequencies fall in all three llama3 regimes: kept / smoothly interpolated / divided by 8);
              tie_word_embeddings=True (no ``lm_head.weight`` in the file); weights stored as **bf16** on
              disk; the reference logits are computed in f32 from the bf16-rounded weights (i.e. exactly the
              stored weights upcast to f32).
tiny-qwen2    Qwen2ForCausalLM; q/k/v biases (no o_proj bias); untied; rms_norm_eps 1e-6; rope_theta 1e6;
              **sharded** safetensors (several ``model-0000X-of-0000N.safetensors`` + ``model.safetensors.index.json``).
tiny-mistral  MistralForCausalLM; sliding_window 8 < seq 24 (the script asserts the window changes the
              logits: transformers masks kv_idx <= q_idx - 8, i.e. each query sees itself + 7 previous
              tokens); explicit head_dim 24 != hidden/heads (= 12), so q_proj is [96, 48] and o_proj [48, 96];
              untied; intermediate 80.

All models: hidden 48, 2 layers, 4 attention heads, 2 kv heads, vocab 112, max_position_embeddings 128,
silu MLP. input_ids are uniform random in [0, vocab) (seeded), batch 2, seq 24.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

import transformers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
BATCH, SEQ = 2, 24
MAX_DIR_BYTES = 300 * 1024

COMMON = dict(
    hidden_size=48,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=112,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
)


def setup_determinism() -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.manual_seed(0)


def perturb_(model: torch.nn.Module, seed: int) -> None:
    """Re-initialise every parameter deterministically (independent of transformers' init code)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.15 * noise)


def make_inputs(vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=g, dtype=torch.int64)


@torch.no_grad()
def run_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    out = model(input_ids=input_ids)
    return out.logits.detach().to(torch.float32).contiguous()


def build(cls, config_cls, seed: int, **cfg):
    config = config_cls(**{**COMMON, **cfg})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    perturb_(model, seed)
    model.eval()
    return model


def finish(name: str, model, input_ids, logits, save_kwargs=None, save_dtype=None) -> Path:
    out = FIXTURES / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    save_kwargs = dict(save_kwargs or {})
    if save_dtype is not None:
        model = model.to(save_dtype)
    model.save_pretrained(out, safe_serialization=True, **save_kwargs)
    # save_pretrained may also write generation_config.json; keep it (it is what transformers writes).
    save_file({"input_ids": input_ids.contiguous(), "logits": logits.contiguous()}, str(out / "reference.safetensors"))

    # Re-load from disk in f32 and check bit-identical logits.
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    again = run_logits(reloaded, input_ids)
    if not torch.equal(again, logits):
        diff = (again - logits).abs().max().item()
        raise AssertionError(f"{name}: reloaded logits differ from reference (max abs diff {diff})")
    std = logits.std().item()
    assert std > 0.5, f"{name}: logits std {std} too small"
    size = sum(f.stat().st_size for f in out.iterdir())
    assert size < MAX_DIR_BYTES, f"{name}: fixture dir is {size} bytes (> {MAX_DIR_BYTES})"
    print(f"{name}: logits std {std:.3f}, mean {logits.mean().item():.4f}, dir {size} bytes")
    return out


def tiny_llama() -> None:
    model = build(LlamaForCausalLM, LlamaConfig, seed=1, tie_word_embeddings=False, rope_theta=10000.0)
    ids = make_inputs(model.config.vocab_size, seed=101)
    finish("tiny-llama", model, ids, run_logits(model, ids))


def tiny_llama3() -> None:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    model = build(LlamaForCausalLM, LlamaConfig, seed=2, tie_word_embeddings=True, rope_parameters=rope)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "not tied"
    # Check the llama3 scaling really hits all three regimes for this head_dim.
    inv = model.model.rotary_emb.inv_freq
    base = 1.0 / (500000.0 ** (torch.arange(0, model.config.head_dim, 2, dtype=torch.int64).float() / model.config.head_dim))
    ratio = (inv / base).tolist()
    assert any(abs(r - 1) < 1e-6 for r in ratio), ratio
    assert any(abs(r - 1 / 8) < 1e-6 for r in ratio), ratio
    assert any(1 / 8 + 1e-3 < r < 1 - 1e-3 for r in ratio), ratio
    print(f"tiny-llama3: inv_freq / unscaled = {[round(r, 6) for r in ratio]}")
    # Round weights to bf16 first, so f32 compute of the stored (bf16) weights reproduces the reference.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    ids = make_inputs(model.config.vocab_size, seed=102)
    logits = run_logits(model, ids)
    finish("tiny-llama3", model, ids, logits, save_dtype=torch.bfloat16)


def tiny_qwen2() -> None:
    model = build(Qwen2ForCausalLM, Qwen2Config, seed=3, tie_word_embeddings=False, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, use_sliding_window=False)
    ids = make_inputs(model.config.vocab_size, seed=103)
    out = finish("tiny-qwen2", model, ids, run_logits(model, ids), save_kwargs={"max_shard_size": "100KB"})
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 2 and (out / "model.safetensors.index.json").exists(), "tiny-qwen2 must be sharded"


def tiny_mistral() -> None:
    model = build(MistralForCausalLM, MistralConfig, seed=4, tie_word_embeddings=False, sliding_window=8,
                  head_dim=24, intermediate_size=80, rope_theta=10000.0)
    assert model.config.head_dim == 24 and model.model.layers[0].self_attn.q_proj.weight.shape == (96, 48)
    ids = make_inputs(model.config.vocab_size, seed=104)
    logits = run_logits(model, ids)
    # The window must matter: the same weights with no sliding window give different logits
    # (only for positions >= window).
    model.config.sliding_window = None
    full = run_logits(model, ids)
    model.config.sliding_window = 8
    assert torch.equal(run_logits(model, ids), logits), "mistral: non-deterministic"
    assert torch.equal(full[:, :8], logits[:, :8]), "mistral: first window positions should not change"
    d = (full[:, 8:] - logits[:, 8:]).abs().max().item()
    assert d > 1e-3, f"mistral: sliding window had no effect (max diff {d})"
    print(f"tiny-mistral: sliding window changes logits at positions >= 8 (max diff {d:.4f})")
    finish("tiny-mistral", model, ids, logits)


def main() -> int:
    setup_determinism()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    FIXTURES.mkdir(exist_ok=True)
    tiny_llama()
    tiny_llama3()
    tiny_qwen2()
    tiny_mistral()
    print("\nfiles:")
    for name in ("tiny-llama", "tiny-llama3", "tiny-qwen2", "tiny-mistral"):
        for f in sorted((FIXTURES / name).iterdir()):
            print(f"  {f.relative_to(ROOT)}  {f.stat().st_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
