#!/usr/bin/env python3
"""Reference reward-model loss and gradients (TRL 1.16 ``RewardTrainer``'s loss on HF's
``LlamaForSequenceClassification``) on tiny-llama with a one-label ``score`` head.

Two preference pairs (rows chosen_0, rejected_0, chosen_1, rejected_1; lengths 16, 11, 14, 9,
right-padded with id 0 = ``pad_token_id``); rewards = the score at each row's last non-pad
token; ``loss = mean(−logσ(r_c − r_r)) + 0.01·mean((r_c + r_r)²)`` (``center_rewards_coefficient``
0.01). Writes ``fixtures/reward/tiny-llama.safetensors``: ``input_ids`` i64 [4, 16], ``lengths``
i64 [4], ``score.weight`` [1, 48], ``rewards`` [4], ``loss`` [1] and ``grad.<HF name>`` for
score.weight, model.norm.weight, model.embed_tokens.weight and
model.layers.1.mlp.down_proj.weight; with TRL's ``margin`` column ``[0.5, -0.25]``
(``−logσ(r_c − r_r − m)``) also ``margins`` [2], ``loss_margin`` [1] and ``grad_margin.<HF
name>`` of the same parameters.

    tools/.venv/bin/python tools/make_reward_fixture.py
"""

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForSequenceClassification

ROOT = Path(__file__).resolve().parent.parent / "fixtures"
GRADS = ["score.weight", "model.norm.weight", "model.embed_tokens.weight",
         "model.layers.1.mlp.down_proj.weight"]


def main() -> None:
    torch.manual_seed(3)
    model = AutoModelForSequenceClassification.from_pretrained(
        ROOT / "tiny-llama", num_labels=1, pad_token_id=0, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        model.score.weight.copy_(torch.randn_like(model.score.weight) * 0.5)
    gen = torch.Generator().manual_seed(11)
    lengths = torch.tensor([16, 11, 14, 9])
    ids = torch.randint(3, 112, (4, 16), generator=gen)
    ids[1, :6] = ids[0, :6]  # a shared prompt per pair
    ids[3, :6] = ids[2, :6]
    mask = torch.arange(16)[None, :] < lengths[:, None]
    ids = ids.masked_fill(~mask, 0)
    rewards = model(input_ids=ids, attention_mask=mask.long()).logits.squeeze(-1)
    chosen, rejected = rewards[0::2], rewards[1::2]
    loss = -F.logsigmoid(chosen - rejected).mean() + 0.01 * torch.mean((chosen + rejected) ** 2)
    loss.backward()
    named = dict(model.named_parameters())
    out = {"input_ids": ids.contiguous(), "lengths": lengths, "rewards": rewards.detach(),
           "loss": loss.detach().reshape(1), "score.weight": model.score.weight.detach().contiguous()}
    for n in GRADS:
        out[f"grad.{n}"] = named[n].grad.contiguous()
    model.zero_grad()
    margins = torch.tensor([0.5, -0.25])
    rewards = model(input_ids=ids, attention_mask=mask.long()).logits.squeeze(-1)
    chosen, rejected = rewards[0::2], rewards[1::2]
    loss_margin = (-F.logsigmoid(chosen - rejected - margins).mean()
                   + 0.01 * torch.mean((chosen + rejected) ** 2))
    loss_margin.backward()
    out["margins"] = margins
    out["loss_margin"] = loss_margin.detach().reshape(1)
    for n in GRADS:
        out[f"grad_margin.{n}"] = named[n].grad.contiguous()
    (ROOT / "reward").mkdir(exist_ok=True)
    save_file(out, str(ROOT / "reward" / "tiny-llama.safetensors"))
    print(f"loss {loss.item():.6f}, rewards {rewards.tolist()}")


if __name__ == "__main__":
    main()
