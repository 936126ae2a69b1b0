#!/usr/bin/env python3
"""Reference DPO loss and LoRA gradients (TRL 1.16 `DPOTrainer._compute_loss`, loss_type
"sigmoid", the PEFT reference = the base with the adapter disabled) on tiny-llama with the
PEFT adapter of `make_lora_fixture.py` (run that first).

Two preference pairs of 16 tokens (a shared 6-token prompt per pair, different completions),
in TRL's concatenated order [chosen_0, chosen_1, rejected_0, rejected_1]:
``logps = Σ_t log p(ids[t+1] | ids[..=t]) · completion_mask[t+1]`` (TRL's shifted mask),
``z = (logπ(c) − logπ_ref(c)) − (logπ(r) − logπ_ref(r))``, ``loss = mean(−logσ(β·z))``,
β = 0.1. Writes ``fixtures/lora/tiny-llama/dpo.safetensors``: ``input_ids`` i64 [4, 16],
``completion_mask`` i64 [4, 16], ``loss`` [1], ``policy_logps`` / ``reference_logps`` [4],
and ``grad.<adapter tensor>`` for every lora_A / lora_B.

    tools/.venv/bin/python tools/make_dpo_fixture.py
"""

from pathlib import Path

import torch
import torch.nn.functional as F
from peft import PeftModel
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent / "fixtures"
BETA = 0.1


def sequence_logps(model, ids, mask):
    logits = model(input_ids=ids).logits[:, :-1].float()
    per_token = torch.gather(F.log_softmax(logits, dim=-1), 2, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (per_token * mask[:, 1:]).sum(dim=1)


def main() -> None:
    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(ROOT / "tiny-llama", dtype=torch.float32, attn_implementation="eager")
    model = PeftModel.from_pretrained(base, ROOT / "lora" / "tiny-llama", is_trainable=True)
    gen = torch.Generator().manual_seed(7)
    prompts = torch.randint(3, 112, (2, 6), generator=gen)
    chosen = torch.randint(3, 112, (2, 10), generator=gen)
    rejected = torch.randint(3, 112, (2, 10), generator=gen)
    ids = torch.cat([torch.cat([prompts, chosen], 1), torch.cat([prompts, rejected], 1)], 0)
    mask = torch.zeros_like(ids)
    mask[:, 6:] = 1
    mask[1, 14:] = 0  # a shorter completion (padding after it)
    mask[3, 12:] = 0
    with torch.no_grad(), model.disable_adapter():
        ref = sequence_logps(model, ids, mask)
    policy = sequence_logps(model, ids, mask)
    chosen_lr, rejected_lr = (policy - ref).chunk(2)
    loss = (-F.logsigmoid(BETA * (chosen_lr - rejected_lr))).mean()
    loss.backward()
    out = {
        "input_ids": ids.contiguous(),
        "completion_mask": mask.contiguous(),
        "loss": loss.detach().reshape(1),
        "policy_logps": policy.detach(),
        "reference_logps": ref,
    }
    for name, p in model.named_parameters():
        if p.requires_grad:
            out[f"grad.{name.replace('.default.', '.')}"] = p.grad.contiguous()
    save_file(out, str(ROOT / "lora" / "tiny-llama" / "dpo.safetensors"))
    print(f"loss {loss.item():.6f}, policy {policy.tolist()}, reference {ref.tolist()}")


if __name__ == "__main__":
    main()
