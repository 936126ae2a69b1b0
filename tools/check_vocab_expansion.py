#!/usr/bin/env python3
"""Checks `ferrotron convert expand-vocab` against transformers (pinned in requirements.txt).

    tools/.venv/bin/python tools/check_vocab_expansion.py OLD_HF NEW_HF TOKENS_FILE

* tokenizer: the expanded directory's tokenizer encodes sample texts (each new token in
  context, plus plain text) exactly as ``AutoTokenizer.from_pretrained(OLD).add_tokens(tokens)``
  does, and its length is the same;
* weights: every new token's embedding row (and untied lm_head row) is the mean of the old
  rows of the ids the old tokenizer encodes it to, every old row is unchanged;
* logits: on text of old tokens, the expanded model's logits over the old vocabulary equal the
  old model's (max |diff| printed, must be 0 up to float noise).

Prints one JSON line; exits 1 when a check fails.
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    old_dir, new_dir, tokens_file = sys.argv[1:4]
    tokens = [l for l in open(tokens_file, encoding="utf-8").read().split("\n") if l]
    ref = AutoTokenizer.from_pretrained(old_dir)
    old_tok = AutoTokenizer.from_pretrained(old_dir)
    ref.add_tokens(tokens)
    new = AutoTokenizer.from_pretrained(new_dir)
    texts = [f"Today {t} is here, {t}{t} again." for t in tokens] + ["In the beginning God created the heaven."]
    tok_ok = len(new) == len(ref) and all(new.encode(t) == ref.encode(t) for t in texts)
    old_m = AutoModelForCausalLM.from_pretrained(old_dir, dtype=torch.float32)
    new_m = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32)
    v_old = old_m.config.vocab_size
    rows_ok = True
    tables = [(old_m.get_input_embeddings().weight, new_m.get_input_embeddings().weight)]
    if not old_m.config.tie_word_embeddings:
        tables.append((old_m.get_output_embeddings().weight, new_m.get_output_embeddings().weight))
    for old_w, new_w in tables:
        rows_ok &= torch.equal(old_w, new_w[:v_old])
        for t in tokens:
            if old_tok.convert_tokens_to_ids(t) not in (None, old_tok.unk_token_id):
                continue
            pieces = old_tok.encode(t, add_special_tokens=False)
            want = old_w[pieces].double().mean(0).float()
            rows_ok &= torch.allclose(new_w[new.convert_tokens_to_ids(t)], want, atol=1e-7)
    ids = old_tok("In the beginning God created the heaven and the earth.", return_tensors="pt").input_ids
    with torch.no_grad():
        diff = (old_m(ids).logits - new_m(ids).logits[..., :v_old]).abs().max().item()
    result = {"tokenizer_matches_add_tokens": tok_ok, "rows_are_piece_means": bool(rows_ok),
              "old_logits_max_abs_diff": diff, "vocab_size": [v_old, new_m.config.vocab_size],
              "tokenizer_len": [len(old_tok), len(new)]}
    print(json.dumps(result))
    sys.exit(0 if tok_ok and rows_ok and diff < 1e-5 else 1)


if __name__ == "__main__":
    main()
