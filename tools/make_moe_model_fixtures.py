#!/usr/bin/env python3
"""Tiny, deterministic HuggingFace MoE reference checkpoints (transformers 5.23, pinned in requirements.txt):
``fixtures/tiny-{mixtral,qwen2-moe,olmoe}/``, built and checked exactly as ``make_family_fixtures.py`` builds the
dense families (same ``config.json`` / ``model.safetensors`` / ``reference.safetensors`` / ``grads.safetensors``,
the same input ids, greedy continuation and re-load check; see that script's docstring), plus

* ``aux_grads.safetensors`` -- Megatron-Core's balancing losses on top of the LM loss, computed in PyTorch from
  HF's own router logits (``output_router_logits=True``; HF's ``load_balancing_loss_func`` concatenates every
  layer, which Megatron does not, so it is not used):
    - ``aux.<l>``   f32 [1]  MoE layer ``l``'s ``aux_loss``: ``coeff·E/(k·T²)·Σ_i (Σ_t p_ti)·c_i`` with ``p`` the
                             softmax of the layer's router logits over all ``E`` experts, ``c_i`` the tokens whose
                             top-k of ``p`` holds expert ``i``, ``T`` = 2·24 tokens, ``coeff`` =
                             ``router_aux_loss_coef`` (0.01); Megatron's ``switch_load_balancing_loss_func``
    - ``z.<l>``     f32 [1]  its z-loss ``Z_COEFF·mean_t(logsumexp_t²)`` (``z_loss_func``, ``Z_COEFF`` = 0.001)
    - ``loss``      f32 [1]  ``lm_loss + Σ_l (aux.<l> + z.<l>)``
    - ``grad.<param name>``  the gradients of that total, for the word embedding (which every layer's losses
                             reach) and every router (``...mlp.gate.weight``) only, to keep the fixture small.

The experts (transformers 5 fuses them in memory into ``experts.gate_up_proj`` [E, 2f, h] and
``experts.down_proj`` [E, h, f]; ``save_pretrained`` writes them per expert, which the script asserts) and the
router weights are re-initialised like every other matrix (``0.15·randn``).

tiny-mixtral    MixtralForCausalLM; 4 experts, top-2, softmax renormalised over the top-k; expert width 32
                (``intermediate_size``); GQA 4/2; no sliding window; untied.
tiny-qwen2-moe  Qwen2MoeForCausalLM; 3 layers, ``mlp_only_layers`` [1] (layer 1 a dense MLP of
                ``intermediate_size`` 80), 6 experts of ``moe_intermediate_size`` 16, top-2 without renormalising
                (``norm_topk_prob`` false), a shared expert of width 32 scaled by ``sigmoid(shared_expert_gate)``,
                q/k/v biases; untied.
tiny-olmoe      OlmoeForCausalLM; 8 experts of width 16, top-3 without renormalising; full-width q/k RMSNorm;
                untied.

    tools/.venv/bin/python tools/make_moe_model_fixtures.py
"""

from __future__ import annotations

import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import make_family_fixtures as fam
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

AUX_COEFF = 0.01
Z_COEFF = 0.001
COMMON = {**fam.COMMON, "router_aux_loss_coef": AUX_COEFF}


def perturb_(model: torch.nn.Module, seed: int) -> None:
    """Every norm weight 1 + 0.2·randn, every bias 0.1·randn, every other parameter (linear, embedding, router,
    fused experts) 0.15·randn."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.15 * noise)


def build(cls, config, seed: int):
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    perturb_(model, seed)
    model.eval()
    return model


def megatron_losses(router_logits, topk: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    aux, z = [], []
    for logits in router_logits:
        t, e = logits.shape
        p = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(p, topk, dim=-1).indices
        counts = torch.zeros(e).scatter_add_(0, chosen.flatten(), torch.ones(chosen.numel()))
        aux.append(AUX_COEFF * e / (topk * t * t) * (p.sum(0) * counts).sum())
        z.append(Z_COEFF * torch.logsumexp(logits.float(), dim=-1).square().mean())
    return aux, z


def aux_grads(out, topk: int) -> None:
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    with safe_open(str(out / "reference.safetensors"), "pt") as f:
        input_ids = f.get_tensor("input_ids")
    model.train()
    model.zero_grad(set_to_none=True)
    res = model(input_ids, labels=input_ids, output_router_logits=True)
    # With output_router_logits HF adds its own (all-layer) aux loss to `loss`: recompute the LM loss alone.
    logits = res.logits.float()
    lm = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1))
    aux, z = megatron_losses(res.router_logits, topk)
    total = lm + sum(aux) + sum(z)
    total.backward()
    tensors = {"loss": total.detach().reshape(1), "lm_loss": lm.detach().reshape(1)}
    moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    assert len(moe_layers) == len(aux), (moe_layers, len(aux))
    for layer, a, zz in zip(moe_layers, aux, z):
        tensors[f"aux.{layer}"] = a.detach().reshape(1)
        tensors[f"z.{layer}"] = zz.detach().reshape(1)
    for name, p in model.named_parameters():
        if name == "model.embed_tokens.weight" or name.endswith("mlp.gate.weight"):
            tensors[f"grad.{name}"] = p.grad.detach().contiguous()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "aux_grads.safetensors"))
    print(f"  lm {lm.item():.6f} aux {[round(a.item(), 6) for a in aux]} z {[round(v.item(), 6) for v in z]}")


def check_experts_on_disk(out, num_experts: int) -> None:
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert not any("gate_up_proj" in k for k in keys), "fused experts on disk"
    assert any(f".experts.{num_experts - 1}." in k for k in keys), "experts not per expert on disk"


def finish(name: str, build_model, seed: int):
    """``make_family_fixtures.finish`` with the first input seed from ``seed`` on whose greedy continuation
    passes its checks (no near-tie, no EOS, no constant row)."""
    for s in range(seed, seed + 50):
        try:
            return fam.finish(name, build_model(), seed=s, tied=False)
        except AssertionError as e:
            if not any(w in str(e) for w in ("near-tie", "eos generated", "constant continuation")):
                raise
            print(f"{name}: input seed {s} rejected ({e})")
    raise AssertionError(f"{name}: no input seed in {seed}..{seed + 50} passes")


def tiny_mixtral() -> None:
    cfg = fam.make_config(MixtralConfig, **{**COMMON, "intermediate_size": 32}, num_local_experts=4,
                          num_experts_per_tok=2, hidden_act="silu", rms_norm_eps=1e-5, sliding_window=None,
                          router_jitter_noise=0.0, attention_dropout=0.0, tie_word_embeddings=False)
    out = finish("tiny-mixtral", lambda: build(MixtralForCausalLM, cfg, seed=21), seed=121)
    check_experts_on_disk(out, 4)
    aux_grads(out, topk=2)


def tiny_qwen2_moe() -> None:
    cfg = fam.make_config(Qwen2MoeConfig, **{**COMMON, "num_hidden_layers": 3}, num_experts=6,
                          num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                          norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1], qkv_bias=True,
                          hidden_act="silu", rms_norm_eps=1e-6, use_sliding_window=False, attention_dropout=0.0,
                          tie_word_embeddings=False)
    model = build(Qwen2MoeForCausalLM, cfg, seed=22)
    assert not hasattr(model.model.layers[1].mlp, "gate") and hasattr(model.model.layers[2].mlp, "gate")
    out = finish("tiny-qwen2-moe", lambda: build(Qwen2MoeForCausalLM, cfg, seed=22), seed=122)
    check_experts_on_disk(out, 6)
    aux_grads(out, topk=2)


def tiny_olmoe() -> None:
    cfg = fam.make_config(OlmoeConfig, **{**COMMON, "intermediate_size": 16}, num_experts=8,
                          num_experts_per_tok=3, norm_topk_prob=False, hidden_act="silu", rms_norm_eps=1e-5,
                          clip_qkv=None, attention_bias=False, attention_dropout=0.0, tie_word_embeddings=False)
    model = build(OlmoeForCausalLM, cfg, seed=23)
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (48,) and attn.k_norm.weight.shape == (24,)
    out = finish("tiny-olmoe", lambda: build(OlmoeForCausalLM, cfg, seed=23), seed=123)
    check_experts_on_disk(out, 8)
    aux_grads(out, topk=3)


def main() -> int:
    fam.setup_determinism()
    tiny_mixtral()
    tiny_qwen2_moe()
    tiny_olmoe()
    return 0


if __name__ == "__main__":
    sys.exit(main())
