#!/usr/bin/env python3
"""Random PEFT LoRA adapters for a model directory, for serving benchmarks (issue 18's
multi-LoRA): ``LoraConfig(r, lora_alpha=r, target_modules=<every projection>,
init_lora_weights=False)`` — random ``lora_A`` and ``lora_B`` per projection, as trained
adapters have (a fresh PEFT adapter's ``lora_B`` is zero) — saved by
``PeftModel.save_pretrained`` to ``OUT/adapter<i>``.

    tools/.venv/bin/python tools/make_random_adapters.py --model .cache/smollm2-hf \
        --count 4 --rank 16 --out runs/bench-serve-adapters
"""

import argparse
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF model directory")
    ap.add_argument("--count", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--out", required=True, help="directory for adapter0, adapter1, ...")
    args = ap.parse_args()
    for i in range(args.count):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        config = LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=TARGETS,
                            init_lora_weights=False, task_type="CAUSAL_LM")
        model = get_peft_model(base, config)
        out = Path(args.out) / f"adapter{i}"
        model.save_pretrained(out)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
