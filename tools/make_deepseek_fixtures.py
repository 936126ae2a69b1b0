#!/usr/bin/env python3
"""Tiny, deterministic DeepSeek-V2 reference checkpoints (transformers 5.23, pinned in requirements.txt):
``fixtures/tiny-deepseek-v2{,-lite}/``, built and checked exactly as ``make_moe_model_fixtures.py`` builds the
other MoE families (``config.json`` / ``model.safetensors`` / ``reference.safetensors`` / ``grads.safetensors`` /
``aux_grads.safetensors``; see that script's and ``make_family_fixtures.py``'s docstrings).

Both use multi-latent attention (MLA) with deliberately unequal head dims (``qk_nope_head_dim`` 12,
``qk_rope_head_dim`` 8, ``v_head_dim`` 10, or 24 for the lite one: values narrower and wider than the
queries' 20) so a mixed-up split cannot pass, RoPE on the 8-dim slice with
interleaved pairs, one shared ``k_pe`` head, shared experts (one ungated MLP of width
``moe_intermediate_size·n_shared_experts``) and ``first_k_dense_replace`` 1 (layer 0 a dense MLP).

tiny-deepseek-v2       ``q_lora_rank`` 24 (``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``), ``kv_lora_rank`` 16;
                       3 layers; 8 experts of width 16 in 4 groups, ``group_limited_greedy`` keeping 2 groups
                       (group score = the max expert), top-3, ``routed_scaling_factor`` 2.5; YaRN RoPE with
                       ``factor`` 4 over ``original_max_position_embeddings`` 16 (max 64; the 24-token inputs cross 16),
                       ``mscale`` 0.9 != ``mscale_all_dim`` 0.707 so both the cos/sin attention factor and the
                       softmax scale's ``mscale²`` are not 1.
tiny-deepseek-v2-lite  ``q_lora_rank`` null (a plain ``q_proj``), ``kv_lora_rank`` 16; 2 layers; 6 experts,
                       ``greedy`` top-2, no scaling; default RoPE.

    tools/.venv/bin/python tools/make_deepseek_fixtures.py
"""

from __future__ import annotations

import sys

from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

import make_family_fixtures as fam
import make_moe_model_fixtures as moe

MLA = dict(kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10)
BASE = {
    **{k: v for k, v in moe.COMMON.items() if k not in ("num_key_value_heads", "router_aux_loss_coef")},
    **MLA,
    "n_shared_experts": 2,
    "moe_intermediate_size": 16,
    "first_k_dense_replace": 1,
    "norm_topk_prob": False,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
}


def check_layer(model, q_lora: bool, v_head_dim: int) -> None:
    attn = model.model.layers[0].self_attn
    assert (attn.q_a_proj is not None) == q_lora and (attn.q_proj is None) == q_lora
    assert attn.kv_a_proj_with_mqa.weight.shape == (16 + 8, 48)
    assert attn.kv_b_proj.weight.shape == (4 * (12 + v_head_dim), 16)
    assert attn.o_proj.weight.shape == (48, 4 * v_head_dim)
    assert not hasattr(model.model.layers[0].mlp, "gate") and hasattr(model.model.layers[1].mlp, "gate")


def tiny_deepseek_v2() -> None:
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.9, "mscale_all_dim": 0.707}
    cfg = fam.make_config(DeepseekV2Config, **{**BASE, "num_hidden_layers": 3, "rope_parameters": rope,
                                                          "max_position_embeddings": 64},
                          q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                          topk_method="group_limited_greedy", routed_scaling_factor=2.5)
    model = moe.build(DeepseekV2ForCausalLM, cfg, seed=24)
    check_layer(model, q_lora=True, v_head_dim=10)
    rotary = model.model.rotary_emb
    assert abs(rotary.attention_scaling - 1.0) > 1e-3, rotary.attention_scaling
    assert abs(model.model.layers[0].self_attn.scaling * 20**0.5 - 1.0) > 1e-3
    out = moe.finish("tiny-deepseek-v2", lambda: moe.build(DeepseekV2ForCausalLM, cfg, seed=24), seed=124)
    moe.check_experts_on_disk(out, 8)
    moe.aux_grads(out, topk=3)


def tiny_deepseek_v2_lite() -> None:
    cfg = fam.make_config(DeepseekV2Config, **{**BASE, "v_head_dim": 24}, q_lora_rank=None, n_routed_experts=6,
                          num_experts_per_tok=2, topk_method="greedy", routed_scaling_factor=1.0)
    model = moe.build(DeepseekV2ForCausalLM, cfg, seed=25)
    check_layer(model, q_lora=False, v_head_dim=24)
    out = moe.finish("tiny-deepseek-v2-lite", lambda: moe.build(DeepseekV2ForCausalLM, cfg, seed=25), seed=125)
    moe.check_experts_on_disk(out, 6)
    moe.aux_grads(out, topk=2)


def main() -> int:
    fam.setup_determinism()
    tiny_deepseek_v2()
    tiny_deepseek_v2_lite()
    return 0


if __name__ == "__main__":
    sys.exit(main())
