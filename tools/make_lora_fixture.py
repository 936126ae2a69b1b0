#!/usr/bin/env python3
"""Reference LoRA adapters, logits and gradients from HF PEFT for the LoRA issue.

For tiny-llama and tiny-qwen2 (fixtures/tiny-*/, from make_fixtures.py): wrap the model in a
PEFT ``LoraConfig(r=4, lora_alpha=8, lora_dropout=0)`` on every projection (q/k/v/o,
gate/up/down), then make the adapter one that Ferrotron's fused ``linear_qkv`` / ``linear_fc1``
adapters can express exactly: q, k and v share one ``lora_A`` (as gate and up do), and every
``lora_B`` is drawn at random (PEFT initialises it to zero, which would make every ``lora_A``
gradient zero). Writes ``fixtures/lora/<name>/``:

* ``adapter_config.json`` + ``adapter_model.safetensors``: ``PeftModel.save_pretrained``;
* ``reference.safetensors``: ``loss`` f32 [1] of ``model(input_ids, labels=input_ids)`` on the
  tiny fixture's ``input_ids``, its ``logits`` f32 [b, s, v], and ``grad.<adapter tensor
  name>`` for every ``lora_A`` / ``lora_B`` (the saved adapter's names).

    tools/.venv/bin/python tools/make_lora_fixture.py
"""

import json
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent / "fixtures"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Projections that Ferrotron fuses: the later ones take the first one's lora_A.
SHARED_A = [("q_proj", ["k_proj", "v_proj"]), ("gate_proj", ["up_proj"])]


def save_adapter(model, out_dir: Path, base: str) -> None:
    """``save_pretrained`` of a PEFT model's adapter into ``out_dir`` with ``base`` as its
    ``base_model_name_or_path``, without PEFT's model-card template and with a stable
    ``adapter_config.json`` (sorted keys and ``target_modules``)."""
    model.peft_config["default"].base_model_name_or_path = base
    model.save_pretrained(out_dir)
    (out_dir / "README.md").unlink()  # PEFT's model-card template
    cfg_path = out_dir / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["target_modules"] = sorted(cfg["target_modules"])  # saved from a set
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def main() -> None:
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    for name in ["tiny-llama", "tiny-qwen2"]:
        base = AutoModelForCausalLM.from_pretrained(
            ROOT / name, dtype=torch.float32, attn_implementation="eager"
        )
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
        model = get_peft_model(base, config)
        with torch.no_grad():
            for layer in model.base_model.model.model.layers:
                blocks = {"q_proj": layer.self_attn, "gate_proj": layer.mlp}
                for first, rest in SHARED_A:
                    owner = blocks[first]
                    a = getattr(owner, first).lora_A["default"].weight
                    for other in rest:
                        getattr(owner, other).lora_A["default"].weight.copy_(a)
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.copy_(torch.randn_like(p) * 0.1)
        out_dir = ROOT / "lora" / name
        save_adapter(model, out_dir, f"fixtures/{name}")
        model.train()
        ids = load_file(str(ROOT / name / "reference.safetensors"))["input_ids"]
        out = model(ids, labels=ids)
        out.loss.backward()
        tensors = {"loss": out.loss.detach().reshape(1), "logits": out.logits.detach().contiguous()}
        for pname, p in model.named_parameters():
            if p.requires_grad:
                saved = pname.replace(".default.", ".")
                tensors[f"grad.{saved}"] = p.grad.contiguous()
        save_file(tensors, str(out_dir / "reference.safetensors"))
        print(f"{name}: loss {out.loss.item():.6f}, {len(tensors)} tensors")


if __name__ == "__main__":
    main()
