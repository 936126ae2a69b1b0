#!/usr/bin/env python3
"""Reference MoE routing and experts (transformers 5.23, pinned in requirements.txt): the router
(``gate``) and routed experts of three HF MoE blocks on 6 tokens of width 16, expert width 8:

* ``mixtral``: ``MixtralSparseMoeBlock``, 4 experts, top-2 (softmax, top-k, renormalised);
* ``olmoe``: ``OlmoeSparseMoeBlock``, 4 experts, top-2, ``norm_topk_prob=False`` (softmax over
  all experts, top-k, not renormalised; as Qwen2-MoE's routed part);
* ``deepseek_v2``: ``DeepseekV2Moe``'s ``gate`` and ``experts`` (the routed part; shared experts
  are a dense MLP), 8 experts in 4 groups, ``group_limited_greedy`` keeping 2 groups, top-2,
  ``routed_scaling_factor`` 16.

For each, ``y = experts(x, gate(x))`` and the gradients of ``Σ y·c``. Writes
``fixtures/moe/moe.safetensors`` with ``<family>.x`` [6, 16], ``.c`` [6, 16], ``.gate`` [E, 16],
``.gate_up_proj`` [E, 16, 16] (rows [gate; up]), ``.down_proj`` [E, 16, 8], ``.experts`` i64
[6, 2] (HF's choice), ``.y`` [6, 16] and ``.grad.x``, ``.grad.gate``, ``.grad.gate_up_proj``,
``.grad.down_proj``.

    tools/.venv/bin/python tools/make_moe_fixture.py
"""

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import DeepseekV2Config, MixtralConfig, OlmoeConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "moe" / "moe.safetensors"
T, H, F = 6, 16, 8


def blocks():
    yield "mixtral", MixtralSparseMoeBlock(MixtralConfig(
        hidden_size=H, intermediate_size=F, num_local_experts=4, num_experts_per_tok=2))
    yield "olmoe", OlmoeSparseMoeBlock(OlmoeConfig(
        hidden_size=H, intermediate_size=F, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False))
    yield "deepseek_v2", DeepseekV2Moe(DeepseekV2Config(
        hidden_size=H, num_attention_heads=2, num_key_value_heads=2, moe_intermediate_size=F,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
        topk_method="group_limited_greedy", routed_scaling_factor=16.0))


def main() -> None:
    torch.manual_seed(5)
    out = {}
    for name, block in blocks():
        with torch.no_grad():
            block.gate.weight.copy_(torch.randn_like(block.gate.weight))
            block.experts.gate_up_proj.copy_(torch.randn_like(block.experts.gate_up_proj) * 0.3)
            block.experts.down_proj.copy_(torch.randn_like(block.experts.down_proj) * 0.3)
        x = torch.randn(T, H, requires_grad=True)
        c = torch.randn(T, H)
        _, weights, experts = block.gate(x)
        y = block.experts(x, experts, weights)
        (y * c).sum().backward()
        tensors = {"x": x, "c": c, "gate": block.gate.weight, "gate_up_proj": block.experts.gate_up_proj,
                   "down_proj": block.experts.down_proj}
        for key, t in tensors.items():
            out[f"{name}.{key}"] = t.detach().contiguous()
            if t.requires_grad:
                out[f"{name}.grad.{key}"] = t.grad.contiguous()
        out[f"{name}.experts"] = experts.to(torch.int64).contiguous()
        out[f"{name}.y"] = y.detach().contiguous()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, OUT)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
