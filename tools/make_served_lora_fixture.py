#!/usr/bin/env python3
"""PEFT adapters as PEFT trains them, for serving (issue 18's multi-LoRA): every projection
with its own ``lora_A``, and adapters on only some projections of a layer Ferrotron fuses.

For tiny-llama (fixtures/tiny-llama/, from make_fixtures.py), two adapters with
``init_lora_weights=False`` (random ``lora_A`` and ``lora_B``, as a trained adapter has):

* ``qv``: ``LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])``, the LoRA
  paper's choice (k is not adapted: its rows of the fused adapter stay zero);
* ``all``: ``LoraConfig(r=8, lora_alpha=16)`` on q/k/v/o and gate/up/down (q, k and v with
  three different ``lora_A``: Ferrotron stacks them).

Writes ``fixtures/lora/served/<adapter>/``: ``adapter_config.json`` +
``adapter_model.safetensors`` (``PeftModel.save_pretrained``) and ``reference.safetensors``:
``logits`` f32 [b, s, v] of the PEFT model on the tiny fixture's ``input_ids``.

    tools/.venv/bin/python tools/make_served_lora_fixture.py
"""

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from make_lora_fixture import save_adapter

ROOT = Path(__file__).resolve().parent.parent / "fixtures"
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"qv": (4, 8, ["q_proj", "v_proj"]), "all": (8, 16, ALL)}


def main() -> None:
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    ids = load_file(str(ROOT / "tiny-llama" / "reference.safetensors"))["input_ids"]
    for name, (r, alpha, targets) in ADAPTERS.items():
        base = AutoModelForCausalLM.from_pretrained(
            ROOT / "tiny-llama", dtype=torch.float32, attn_implementation="eager"
        )
        config = LoraConfig(
            r=r, lora_alpha=alpha, lora_dropout=0.05, target_modules=targets,
            init_lora_weights=False, task_type="CAUSAL_LM",
        )
        model = get_peft_model(base, config).eval()
        out_dir = ROOT / "lora" / "served" / name
        save_adapter(model, out_dir, "fixtures/tiny-llama")
        with torch.no_grad():
            logits = model(ids).logits.contiguous()
        save_file({"logits": logits}, str(out_dir / "reference.safetensors"))
        print(f"{name}: logits {tuple(logits.shape)}, |logits| max {logits.abs().max():.4f}")


if __name__ == "__main__":
    main()
