"""Logits of transformers in bf16 on the bf16 fixture, the yardstick for our bf16 compute.

Run after ``make_fixtures.py`` with the reference venv (see tools/README.md):

    tools/.venv/bin/python tools/make_bf16_reference.py

Writes ``fixtures/tiny-llama3/reference_bf16.safetensors`` with ``logits`` (f32 [2, 24, vocab]): the
committed ``tiny-llama3`` checkpoint (stored in bf16) loaded with ``dtype=torch.bfloat16``,
``attn_implementation="eager"``, run on the same ``input_ids`` as ``reference.safetensors``.
The Rust test ``hf_parity::bf16_compute_is_as_close_to_f32_as_transformers_bf16`` requires our bf16
logits to be at least as close to the f32 reference as these are.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "tiny-llama3"


@torch.no_grad()
def main() -> int:
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    ref = load_file(str(FIXTURE / "reference.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.bfloat16, attn_implementation="eager")
    model.eval()
    logits = model(input_ids=ref["input_ids"]).logits.to(torch.float32).contiguous()
    out = FIXTURE / "reference_bf16.safetensors"
    save_file({"logits": logits}, str(out))
    diff = (logits - ref["logits"]).abs().max().item()
    flips = (logits.argmax(-1) != ref["logits"].argmax(-1)).sum().item()
    print(f"{out}: max |bf16 - f32 logits| = {diff:.4e}, argmax flips = {flips}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
