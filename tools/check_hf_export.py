#!/usr/bin/env python3
"""Check that an HF directory exported by Ferrotron (``export_hf``) loads in transformers and gives
the same logits as the directory it came from.

Run with the reference venv (tools/setup_venv.sh), after exporting, e.g.:

    cargo run --release -p ferrotron-checkpoint --example export_hf -- fixtures/tiny-llama /tmp/exp/tiny-llama
    tools/.venv/bin/python tools/check_hf_export.py fixtures/tiny-llama /tmp/exp/tiny-llama [ORIG EXPORTED ...]

For each (original, exported) pair both directories are loaded with
``AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32, attn_implementation="eager")`` on CPU
in eval mode, and fed the same seeded random ``input_ids`` ([2, min(32, max_position_embeddings)]).
Printed per pair: the model class, whether the state dicts have the same names and shapes, the max
|weight diff|, the max |logit diff| and whether every argmax agrees. The exit status is 1 when a logit
diff exceeds ``--tol`` (default 0: an f32 export must be exact), the argmax differs or the names/shapes
differ; ``--tol`` must be raised for bf16/f16 exports of f32 models.
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import AutoModelForCausalLM


def load(path: str):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def check(orig_dir: str, exp_dir: str, tol: float, seed: int) -> bool:
    orig, exp = load(orig_dir), load(exp_dir)
    so, se = orig.state_dict(), exp.state_dict()
    same_names = {k: tuple(v.shape) for k, v in so.items()} == {k: tuple(v.shape) for k, v in se.items()}
    weight_diff = max(((so[k] - se[k]).abs().max().item() for k in so if k in se), default=float("nan"))
    cfg = orig.config
    seq = min(32, cfg.max_position_embeddings)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (2, seq), generator=gen)
    with torch.no_grad():
        lo, le = orig(ids).logits, exp(ids).logits
    logit_diff = (lo - le).abs().max().item()
    argmax_same = bool((lo.argmax(-1) == le.argmax(-1)).all())
    ok = same_names and logit_diff <= tol and argmax_same
    print(
        f"{exp_dir}: {type(exp).__name__} ({exp.dtype}), names+shapes {'equal' if same_names else 'DIFFER'}, "
        f"max |weight diff| {weight_diff:.3g}, max |logit diff| {logit_diff:.3g} over {tuple(lo.shape)}, "
        f"argmax {'identical' if argmax_same else 'DIFFERS'} -> {'ok' if ok else 'FAIL'}"
    )
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dirs", nargs="+", help="ORIG EXPORTED pairs")
    p.add_argument("--tol", type=float, default=0.0, help="max allowed |logit diff| (default 0)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if len(a.dirs) % 2:
        p.error("expected ORIG EXPORTED pairs")
    torch.manual_seed(a.seed)
    results = [check(a.dirs[i], a.dirs[i + 1], a.tol, a.seed) for i in range(0, len(a.dirs), 2)]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
