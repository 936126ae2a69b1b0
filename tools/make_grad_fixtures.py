#!/usr/bin/env python3
"""Reference gradients for the tiny fixtures (run after make_fixtures.py), for the training issue.

For each fixtures/tiny-*/ directory: load the checkpoint in float32 (eager attention), run
``model(input_ids, labels=input_ids)`` on the stored ``input_ids`` ([2, 24]), i.e. the mean
next-token cross entropy over the 2*23 shifted positions, backpropagate, and write
``grads.safetensors`` holding

* ``loss``                     f32 [1]
* ``grad_norm.<param name>``   f32 [1]  L2 norm of every parameter's gradient (HF names)
* ``grad.<param name>``        f32 full gradient for a few parameters: layer 0 q/k/v projections (and
                                 biases when present), layer 1 down_proj, layer 0 input_layernorm,
                                 the final norm, and the embedding.

    tools/.venv/bin/python tools/make_grad_fixtures.py
"""

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent / "fixtures"
FULL = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.self_attn.q_proj.bias",
    "model.layers.0.self_attn.k_proj.bias",
    "model.layers.0.self_attn.v_proj.bias",
    "model.layers.0.input_layernorm.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.norm.weight",
]


def main() -> None:
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    for name in ["tiny-llama", "tiny-llama3", "tiny-qwen2", "tiny-mistral"]:
        d = ROOT / name
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        model.train()  # dropout probabilities are 0 in these configs
        ids = load_file(str(d / "reference.safetensors"))["input_ids"]
        out = model(ids, labels=ids)
        out.loss.backward()
        tensors = {"loss": out.loss.detach().reshape(1)}
        for pname, p in model.named_parameters():
            tensors[f"grad_norm.{pname}"] = p.grad.norm().reshape(1)
            if pname in FULL:
                tensors[f"grad.{pname}"] = p.grad.contiguous()
        save_file(tensors, str(d / "grads.safetensors"))
        size = (d / "grads.safetensors").stat().st_size
        print(f"{name}: loss {out.loss.item():.6f}, {len(tensors)} tensors, {size} bytes")


if __name__ == "__main__":
    main()
