#!/usr/bin/env python3
"""Reference values for ferrotron-optim's AdamW: torch.optim.AdamW on a few small tensors.

Run with the reference venv (see tools/README.md):

    tools/.venv/bin/python tools/make_optim_fixture.py     # writes fixtures/optim/adamw.json

Setup (CPU, float32, default single-tensor AdamW path: foreach=False, fused=False):

* three parameters (initial values rounded to bf16-representable floats), each in its own
  param group:
  ``w`` [3, 4] (weight_decay 0.1, lr_mult 1), ``norm`` [4] (weight_decay 0 -- the no-decay
  norm/bias group), ``emb`` [5, 2] (weight_decay 0.1, lr_mult 0.5);
* betas (0.9, 0.95), eps 1e-8, amsgrad False;
* 6 steps; before step t every group's lr is set to ``lrs[t] * lr_mult`` (a warmup-then-decay
  sequence, as the scheduler does); the gradient of each parameter at step t is given
  (seeded randn with per-tensor scales, one exact zero and one large value to probe eps and
  magnitude), written as float32;
* after every step we record the fp32 params, and ``bf16`` = the fp32 params rounded to
  bfloat16 (what ferrotron's bf16 mode stores after copying master -> params);
* at the end, ``exp_avg`` / ``exp_avg_sq`` / ``step`` from the optimizer state.

All floats are float32 values written as Python floats (exact round trip).
"""

import json
import pathlib

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "fixtures" / "optim" / "adamw.json"

BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
LRS = [0.0, 1e-2, 2e-2, 1.5e-2, 8e-3, 1e-3]
PARAMS = [
    # name, shape, weight decay, lr multiplier, grad scale
    ("w", [3, 4], WEIGHT_DECAY, 1.0, 1.0),
    ("norm", [4], 0.0, 1.0, 0.05),
    ("emb", [5, 2], WEIGHT_DECAY, 0.5, 3.0),
]


def flat(t: torch.Tensor) -> list:
    return [float(x) for x in t.detach().reshape(-1).tolist()]


def main() -> None:
    torch.manual_seed(1234)
    params = []
    for name, shape, _, _, _ in PARAMS:
        init = torch.randn(shape, dtype=torch.float32) * (1.0 if name != "norm" else 0.1)
        if name == "norm":
            init += 1.0
        # bf16-representable, so the bf16 run (master = bf16 params at start) sees the same start.
        params.append(torch.nn.Parameter(init.to(torch.bfloat16).float()))
    groups = [
        {"params": [p], "weight_decay": wd, "lr": LRS[0] * mult}
        for p, (_, _, wd, mult, _) in zip(params, PARAMS)
    ]
    opt = torch.optim.AdamW(groups, lr=LRS[0], betas=BETAS, eps=EPS, foreach=False, fused=False)

    record = {
        "torch_version": torch.__version__,
        "betas": list(BETAS),
        "eps": EPS,
        "lrs": LRS,
        "params": [
            {
                "name": name,
                "shape": shape,
                "weight_decay": wd,
                "lr_mult": mult,
                "init": flat(p),
                "grads": [],
                "after_step": [],
                "after_step_bf16": [],
            }
            for p, (name, shape, wd, mult, _) in zip(params, PARAMS)
        ],
    }
    for step, lr in enumerate(LRS):
        for g, (_, _, _, mult, _) in zip(opt.param_groups, PARAMS):
            g["lr"] = lr * mult
        for i, (p, (_, shape, _, _, scale)) in enumerate(zip(params, PARAMS)):
            grad = torch.randn(shape, dtype=torch.float32) * scale
            if i == 0:
                grad.view(-1)[step % grad.numel()] = 0.0  # an exact zero grad
            if i == 2 and step == 3:
                grad.view(-1)[1] = 1.0e3  # one large grad
            p.grad = grad
            record["params"][i]["grads"].append(flat(grad))
        opt.step()
        for i, p in enumerate(params):
            record["params"][i]["after_step"].append(flat(p))
            record["params"][i]["after_step_bf16"].append(flat(p.detach().to(torch.bfloat16).float()))

    for i, p in enumerate(params):
        st = opt.state[p]
        record["params"][i]["exp_avg"] = flat(st["exp_avg"])
        record["params"][i]["exp_avg_sq"] = flat(st["exp_avg_sq"])
        record["params"][i]["step"] = int(st["step"].item())

    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)} ({len(LRS)} steps, {len(PARAMS)} params)")


if __name__ == "__main__":
    main()
