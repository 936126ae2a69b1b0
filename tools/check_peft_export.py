#!/usr/bin/env python3
"""Checks a LoRA run's exports against HF PEFT (pinned in requirements.txt):

    tools/.venv/bin/python tools/check_peft_export.py BASE_HF ADAPTER_DIR MERGED_HF

``peft.PeftModel.from_pretrained(BASE, ADAPTER_DIR)`` (Ferrotron's ``checkpoint.export_peft``)
must give the logits of ``MERGED_HF`` (Ferrotron's ``checkpoint.export_hf`` of the same run,
the adapters merged as NeMo's ``LoRAMerge``) and of PEFT's own ``merge_and_unload()``, on a
sample text. Prints one JSON line with the max |logit diff| of each comparison and how far
the adapter moved the base's logits; exits 1 when a diff exceeds 1e-4.
"""

import json
import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    base_dir, adapter_dir, merged_dir = sys.argv[1:4]
    tok = AutoTokenizer.from_pretrained(base_dir)
    ids = tok("Hi! How was your weekend? I went hiking with my dog.", return_tensors="pt").input_ids
    load = lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    with torch.no_grad():
        base = load(base_dir)
        base_logits = base(ids).logits
        peft_model = PeftModel.from_pretrained(base, adapter_dir)
        peft_logits = peft_model(ids).logits
        peft_merged = peft_model.merge_and_unload()(ids).logits
        ours_merged = load(merged_dir)(ids).logits
    result = {
        "peft_vs_our_merged": (peft_logits - ours_merged).abs().max().item(),
        "peft_merge_and_unload_vs_our_merged": (peft_merged - ours_merged).abs().max().item(),
        "adapter_effect_vs_base": (peft_logits - base_logits).abs().max().item(),
    }
    print(json.dumps(result))
    sys.exit(0 if max(result["peft_vs_our_merged"], result["peft_merge_and_unload_vs_our_merged"]) < 1e-4 else 1)


if __name__ == "__main__":
    main()
