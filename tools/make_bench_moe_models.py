#!/usr/bin/env python3
"""The MoE benchmark's models (scripts/bench-moe.sh): a tiny-but-not-toy Mixtral and the dense LLaMA of
equal active parameters, random (transformers' init, seeded), written with ``save_pretrained`` in f32:

* ``<out>/mixtral``: ``MixtralForCausalLM``, hidden 512, 8 layers, 8 heads / 4 kv heads, 8 experts of width 1024,
  top-2 (every token goes through 2 x 1024 of expert width), vocab 32000, untied;
* ``<out>/dense``: ``LlamaForCausalLM`` of the same sizes with one MLP of width 2048: the same active
  parameters per token (the router's 8 x 512 aside);
* ``<out>/deepseek``: ``DeepseekV2ForCausalLM`` shaped like V2-Lite: hidden 512, 8 layers, 8 heads of
  multi-latent attention (no query latent, ``kv_lora_rank`` 128, ``qk_nope_head_dim`` 64, ``qk_rope_head_dim``
  32, ``v_head_dim`` 64, plain rope), layer 0 a dense MLP of width 2048, then 16 routed experts of width 256,
  top-4 (greedy, pre-softmax) plus 2 shared experts (width 512): 1536 of expert width per token.

    tools/.venv/bin/python tools/make_bench_moe_models.py .cache/bench-moe
"""

import sys
from pathlib import Path

import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
)

COMMON = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
              vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2)


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".cache/bench-moe")
    torch.manual_seed(0)
    moe = MixtralForCausalLM(MixtralConfig(**COMMON, intermediate_size=1024, num_local_experts=8,
                                           num_experts_per_tok=2, sliding_window=None))
    moe.save_pretrained(out / "mixtral")
    dense = LlamaForCausalLM(LlamaConfig(**COMMON, intermediate_size=2048))
    dense.save_pretrained(out / "dense")
    mla = {k: v for k, v in COMMON.items() if k != "num_key_value_heads"}
    deepseek = DeepseekV2ForCausalLM(DeepseekV2Config(
        **mla, intermediate_size=2048, q_lora_rank=None, kv_lora_rank=128, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
        n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy", norm_topk_prob=False))
    deepseek.save_pretrained(out / "deepseek")
    for name, m in [("mixtral", moe), ("dense", dense), ("deepseek", deepseek)]:
        print(f"{out / name}: {sum(p.numel() for p in m.parameters()) / 1e6:.1f}M parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
